"""Save a trained model as an MLflow model folder: a PyTorch model (`mlflow.pytorch.load_model` gives
it back), or a Hugging Face causal LM in MLflow's transformers flavour (`mlflow.transformers.load_model`
gives back a text-generation pipeline; the registry and `mlflow models serve` take it).

Takes a built module: the training side (the launcher) rebuilds and loads the model, so tracking
never imports the runtime's model code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def save_pytorch_model(model: torch.nn.Module, folder: Path, example_input: torch.Tensor) -> Path:
    """Write `model` to `folder` (replaced if present); returns it."""
    import mlflow.pytorch

    folder = Path(folder)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        try:  # MLflow 3's default: a torch.export graph, which needs an example input
            mlflow.pytorch.save_model(model, f"{tmp}/model", input_example=example_input.numpy())
        except Exception:  # models torch.export cannot trace: the pickled module
            shutil.rmtree(f"{tmp}/model", ignore_errors=True)
            mlflow.pytorch.save_model(model, f"{tmp}/model", serialization_format="pickle")
        shutil.rmtree(folder, ignore_errors=True)
        Path(f"{tmp}/model").rename(folder)
    return folder


def save_transformers_model(hf_dir: Path, folder: Path, tokenizer_file=None) -> Path:
    """Write the Hugging Face directory `hf_dir` (config + safetensors, as `trainkit export --hf` writes it)
    to `folder` as an MLflow transformers-flavour text-generation model; returns it. The tokenizer is the
    directory's own, else `tokenizer_file` (the recipe's data.tokenizer: a tokenizers JSON or a directory).

    MLflow's own path form (`transformers_model="dir"`) fails on transformers 5 (its task metadata's
    `impl` is a string there), so the model is loaded once here, in the process that writes it."""
    import mlflow.transformers
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    hf_dir, folder = Path(hf_dir), Path(folder)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError):  # a model built from a config: the recipe's tokenizer (a file or a directory)
        if tokenizer_file is None:
            raise ValueError(f"{hf_dir} has no tokenizer files and the recipe names no tokenizer: the "
                             "transformers flavour needs one") from None
        source = Path(tokenizer_file)
        tokenizer = AutoTokenizer.from_pretrained(source) if source.is_dir() else \
            PreTrainedTokenizerFast(tokenizer_file=str(source))
    # pinned here: MLflow otherwise infers them by loading the model again in a subprocess (~8 s)
    requirements = [f"transformers=={transformers.__version__}", f"torch=={torch.__version__.split('+')[0]}"]
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        mlflow.transformers.save_model(transformers_model={"model": model, "tokenizer": tokenizer}, path=f"{tmp}/model",
                                       task="text-generation", pip_requirements=requirements)
        shutil.rmtree(folder, ignore_errors=True)
        Path(f"{tmp}/model").rename(folder)
    return folder
