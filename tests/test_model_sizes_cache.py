"""The memory plan's model trace is read back when nothing it depends on changed
(runtime/model_sizes_cache.py): the second launch of a recipe skips the ~1.4 s trace (torch's meta
kernels import torch._dynamo), and a change to the model's arguments or to its code is traced anew."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from run_helpers import env_for, mlp_recipe


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(folder))
    return folder / "model-sizes"


@pytest.fixture
def traces(monkeypatch):
    """Counts the traces that really ran."""
    from trainkit.runtime import memory_trace

    calls = []
    measured = memory_trace._measured_sizes
    monkeypatch.setattr(memory_trace, "_measured_sizes", lambda *a: calls.append(1) or measured(*a))
    return calls


def sizes_of(path):
    from trainkit.recipe import resolve
    from trainkit.runtime.memory_trace import model_sizes

    return model_sizes(resolve(path).recipe)


def test_the_same_model_is_read_back_and_changed_arguments_are_traced_again(tmp_path, cache, traces):
    first = sizes_of(mlp_recipe(tmp_path, "a"))
    again = sizes_of(mlp_recipe(tmp_path, "b", trainer={"max_steps": 3}))  # another recipe, the same model
    assert again == first and len(traces) == 1 and len(list(cache.iterdir())) == 1
    wider = sizes_of(mlp_recipe(tmp_path, "c", model={"args": {"hidden": 128}}))
    assert len(traces) == 2 and wider.parameters > first.parameters
    bigger_batch = sizes_of(mlp_recipe(tmp_path, "d", data={"batch_size": 16}))
    assert len(traces) == 3 and bigger_batch.activation_bytes == 2 * first.activation_bytes


def test_an_edit_to_a_local_models_code_is_traced_again(tmp_path, cache, traces, monkeypatch):
    package = tmp_path / "mymodels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = textwrap.dedent("""
        import torch
        from trainkit import model_factory

        @model_factory
        def build(num_classes=4):
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, WIDTH), torch.nn.Linear(WIDTH, num_classes))
        """)
    (package / "net.py").write_text(source.replace("WIDTH", "16"))
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = mlp_recipe(tmp_path, "local", model={"name": "mymodels.net:build", "args": {"num_classes": 4}})
    narrow = sizes_of(recipe)
    assert sizes_of(recipe) == narrow and len(traces) == 1
    (package / "net.py").write_text(source.replace("WIDTH", "32"))  # the user edits the model in place
    os.utime(package / "net.py", ns=(1, os.stat(package / "net.py").st_mtime_ns + 10**9))
    sys.modules.pop("mymodels.net", None)
    assert sizes_of(recipe).parameters > narrow.parameters and len(traces) == 2


def test_a_torn_or_foreign_entry_is_traced_again_and_an_empty_cache_dir_turns_it_off(tmp_path, cache, traces, monkeypatch):
    recipe = mlp_recipe(tmp_path, "a")
    first = sizes_of(recipe)
    (entry,) = cache.iterdir()
    entry.write_text('{"parameters": 7')  # a write cut short by another tool
    assert sizes_of(recipe) == first and len(traces) == 2
    entry.write_text(json.dumps({**dataclasses.asdict(first), "parameters": "7556"}))  # not a number
    assert sizes_of(recipe) == first and len(traces) == 3
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", "")
    for item in cache.iterdir():
        item.unlink()
    assert sizes_of(recipe) == first and len(traces) == 4 and not list(cache.iterdir())


@pytest.mark.slow  # two processes
def test_a_second_plan_of_the_recipe_does_not_trace(tmp_path):
    """The effect the cache is for, in fresh processes as a launch is: the second `plan` never imports
    torch._dynamo (the trace's cost) and prints the same plan."""
    recipe = mlp_recipe(tmp_path, "planned")
    script = ("import sys; from trainkit.cli import main; code = main(['plan', sys.argv[1]]); "
              "print('dynamo imported:', 'torch._dynamo' in sys.modules); sys.exit(code)")
    env = env_for(tmp_path, TRAINKIT_CACHE_DIR=str(tmp_path / "cache"))
    runs = [subprocess.run([sys.executable, "-c", script, str(recipe)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs
    assert runs[0].stdout.endswith("dynamo imported: True\n"), runs[0].stdout
    assert runs[1].stdout.endswith("dynamo imported: False\n"), runs[1].stdout
    plan = lambda text: [line for line in text.splitlines()[:-1] if "available:" not in line]  # noqa: E731 (memory free now)
    assert plan(runs[0].stdout) == plan(runs[1].stdout)


@pytest.mark.slow  # transformers runs `uname -p` on import
def test_a_pretrained_directory_whose_config_changes_is_traced_again(tmp_path, cache, traces, corpus):
    """A model block that names a directory (a pretrained checkpoint) is keyed by its files: a config.json
    rewritten in place (here: more layers) is traced again, not read back."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from run_helpers import write_recipe

    folder = tmp_path / "pretrained"
    config = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_attention_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **config)).save_pretrained(folder)
    recipe = write_recipe(tmp_path, "hf", {
        "task": {"name": "causal_lm"}, "model": {"name": "hf_causal_lm", "args": {"pretrained": str(folder)}},
        "data": {"name": "text", "files": corpus["files"], "tokenizer": corpus["tokenizer"], "seq_len": 16,
                 "batch_size": 2},
        "strategy": {"name": "ddp"}, "optimizer": {"name": "adamw", "lr": 1e-3}, "trainer": {"max_steps": 1},
        "launch": {"nproc_per_node": 1}, "tracking": {"enabled": False}})
    one_layer = sizes_of(recipe)
    assert sizes_of(recipe) == one_layer and len(traces) == 1
    LlamaConfig(num_hidden_layers=2, **config).save_pretrained(folder)  # config.json only
    os.utime(folder / "config.json", ns=(1, os.stat(folder / "config.json").st_mtime_ns + 10**9))
    assert sizes_of(recipe).parameters > one_layer.parameters and len(traces) == 2
