"""A pretrained Hugging Face directory as `validate` sees it: files, config and format, without torch or
transformers (the weights are read at run time by trainkit.runtime.pretrained)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_config(directory: str) -> Optional[dict]:
    """The directory's config.json as a dict, or None where it is missing or unreadable."""
    try:
        config = json.loads((Path(directory).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def directory_problems(directory: str) -> list[str]:
    """What is wrong with a pretrained directory, checked without torch or transformers (for `validate`):
    config.json readable with a model_type, safetensors present (pickle `.bin` weights refused), every
    file a regular file inside the directory (no symlink out), and the index's files present."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        return [f"pretrained directory not found: {directory}"]
    problems = []
    real = root.resolve()
    for entry in root.iterdir():
        if entry.is_symlink() and not entry.resolve().is_relative_to(real):
            problems.append(f"{entry.name} is a symlink out of the directory (to {entry.resolve()}); copy the file in")
    config = root / "config.json"
    try:
        described = json.loads(config.read_text())
        if not isinstance(described, dict) or "model_type" not in described:
            problems.append(f"{config}: no model_type (not a transformers config)")
    except FileNotFoundError:
        problems.append(f"{config} not found (save_pretrained writes it)")
    except (OSError, ValueError) as exc:
        problems.append(f"{config} is not readable JSON: {exc}")
    weights = sorted(root.glob("*.safetensors"))
    if not weights:
        pickles = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
        problems.append("no .safetensors weights" + (f" (found {', '.join(pickles)}: pickle files, which can run code "
                        "when loaded, are never read; convert them with save_pretrained(..., safe_serialization=True))"
                        if pickles else ""))
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append(f"{index}: not a safetensors index ({exc})")
            files = set()
        problems += [f"{index.name} names {f}, which is not in the directory" for f in sorted(files)
                     if not (root / f).is_file()]
    return problems

