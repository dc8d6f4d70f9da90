"""`validate` knows the arguments of the built-in model factories (recipe/model_facts.py
`argument_names`): a typo or `lora` on a model without adapters is refused at its file:line:col before
anything launches, instead of the factory's TypeError in every rank after start-up (what a LoRA option
on the MLP gave: "training failed: TypeError: mlp() got an unexpected keyword argument 'lora'")."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from trainkit.cli import main
from trainkit.recipe.model_facts import facts_for

RECIPE = """\
name: args
model: {{name: {model}, args: {args}}}
data: {{name: synthetic, shape: [3, 8, 8], num_classes: 4, batch_size: 4, num_samples: 16}}
strategy: {{name: ddp}}
optimizer: {{name: sgd, lr: 0.1}}
trainer: {{max_steps: 1}}
launch: {{nproc_per_node: 1}}
tracking: {{enabled: false}}
"""


@pytest.mark.parametrize("model,factory", [("mlp", "trainkit.models:mlp"),
                                           ("transformer", "trainkit.models.transformer:transformer"),
                                           ("hf_causal_lm", "trainkit.models.hf:hf_causal_lm")])
def test_declared_arguments_are_the_factorys_signature(model, factory):
    """The facts are light (no torch) and written by hand: they must stay the factory's parameters."""
    import importlib

    module, _, name = factory.partition(":")
    signature = inspect.signature(getattr(importlib.import_module(module), name))
    assert facts_for(model).argument_names == frozenset(signature.parameters)


@pytest.mark.parametrize("model,args,named", [
    ("mlp", "{in_features: 192, num_classes: 4, lora: {r: 4}}", "mlp takes no argument 'lora' (LoRA adapters"),
    ("mlp", "{in_features: 192, hiden: 32}", "mlp takes no argument 'hiden'; it takes: depth, hidden,"),
    ("transformer", "{vocab_size: 64, lora: {r: 4}}", "transformer takes no argument 'lora'"),
    ("torchvision.resnet18", "{num_classes: 4, lora: {r: 4}}", "torchvision models take no lora argument"),
])
def test_an_argument_the_model_does_not_take_is_refused_where_it_is_written(tmp_path, capsys, model, args, named):
    path = tmp_path / "args.yaml"
    path.write_text(RECIPE.format(model=model, args=args))
    code = main(["validate", str(path)])
    out = capsys.readouterr()
    lines = [line for line in (out.err + out.out).splitlines() if line.startswith(f"{path}:2:")]
    assert code == 2 and "Traceback" not in out.err + out.out
    assert any(named in line and "model.args." in line for line in lines), out.err + out.out


def test_the_arguments_a_model_takes_pass(tmp_path, capsys):
    path = tmp_path / "args.yaml"
    path.write_text(RECIPE.format(model="mlp", args="{in_features: 192, hidden: 16, num_classes: 4, depth: 2}"))
    assert main(["validate", str(path)]) == 0, capsys.readouterr()
