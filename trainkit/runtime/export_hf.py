"""`trainkit export CHECKPOINT_DIR OUT_DIR --hf`: the trained model as a Hugging Face directory
(`config.json` + `model.safetensors`, and the tokenizer files of the pretrained directory it started
from), which `AutoModelForCausalLM.from_pretrained`, vLLM and the Hub read -- with LoRA adapters
folded into the base weights (PEFT's `merge_and_unload`), so no PEFT is needed to serve it.

The checkpoint is consolidated as `trainkit export` does for any strategy, the recipe the checkpoint
recorded builds the model (on the CPU, in one process), and the model writes itself: a model that
cannot (`save_merged`) is refused with what can.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..run_dir import CHECKPOINT_RECIPE
from .export import ExportError, consolidated_state_dict
from .model import factory


def export_hf(folder: Path, out: Path) -> str:
    folder, out = Path(folder), Path(out)
    recipe_file = folder / CHECKPOINT_RECIPE
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such checkpoint folder")
    if not recipe_file.is_file():
        raise ExportError(f"{folder}: no {CHECKPOINT_RECIPE} (the recipe that built the model), which --hf needs")
    spec = json.loads(recipe_file.read_text())["model"]
    try:
        model = factory(spec["name"])(**spec.get("args", {}))
    except (OSError, ValueError) as exc:  # e.g. the pretrained directory the recipe names is gone
        raise ExportError(f"cannot build the checkpoint's model {spec['name']} to export it: {exc}") from exc
    if not hasattr(model, "save_merged"):
        raise ExportError(f"--hf writes a Hugging Face model directory, and the checkpoint's model "
                          f"({spec['name']}) is not a Hugging Face model (model: hf_causal_lm); export it "
                          f"without --hf as one state_dict file")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: exists and is not empty; name a new directory")
    name, state = consolidated_state_dict(folder)
    model.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()})
    written = model.save_merged(out)
    return (f"trainkit: exported {spec['name']} from {folder} ({name}) as a Hugging Face directory to {out}: "
            f"{', '.join(written)}")
