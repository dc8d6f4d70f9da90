"""Property: any recipe text, mutation or override either validates or yields a clean RecipeError
(exit 2 from the CLI) — never another exception, never a traceback, never a hang."""

import copy
import subprocess

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainkit.recipe import Recipe, RecipeError, resolve

from conftest import TRAINKIT

BASE = {
    "name": "fuzz",
    "model": {"name": "mlp", "args": {"hidden": 16}},
    "data": {"name": "synthetic", "batch_size": 8, "num_workers": 0},
    "strategy": {"name": "pipeline", "microbatches": 2},
    "precision": "bf16",
    "trainer": {"max_steps": 10, "checkpoint": {"every": 5}},
    "launch": {"nproc_per_node": 2},
    "monitors": ["system", {"name": "profiler", "active": 1}],
    "tracking": {"experiment": "x"},
}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["ddp", "fsdp", "deepspeed", "${name}", "${oc.env:X}",
                                                           "${nope}", "fp16", "auto", "1:2", "!!x"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


def paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from paths(v, prefix + (i,))


def outcome(path, overrides=()):
    try:
        return isinstance(resolve(path, overrides).recipe, Recipe)
    except RecipeError as err:
        assert err.problems and all(str(p) for p in err.problems)
        return False


@FUZZ
@given(text=st.text(max_size=300))
def test_random_text(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    outcome(path)


@FUZZ
@given(data=st.data())
def test_mutated_recipes(tmp_path, data):
    recipe = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 4))):
        target = data.draw(st.sampled_from(list(paths(recipe))[1:]))
        parent = recipe
        for part in target[:-1]:
            parent = parent[part]
        action = data.draw(st.sampled_from(["delete", "replace", "add"]))
        if action == "delete":
            del parent[target[-1]]
        elif action == "replace":
            parent[target[-1]] = data.draw(values)
        elif isinstance(parent, dict):
            parent[data.draw(st.text(min_size=1, max_size=8))] = data.draw(values)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    outcome(path)


@FUZZ
@given(overrides=st.lists(st.one_of(
    st.text(max_size=30),
    st.builds(lambda k, v: f"{k}={v}",
              st.sampled_from(["trainer.max_steps", "strategy.name", "data", "monitors", "seed", "x.y.z",
                               "launch.nnodes", "strategy.microbatches", "precision", "model.args.hidden"]),
              st.text(max_size=12))), max_size=3))
def test_random_overrides(tmp_path, overrides):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(BASE))
    outcome(path, overrides)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=200))
def test_cli_exit_code_is_0_or_2_without_traceback(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    res = subprocess.run([*TRAINKIT, "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode in (0, 2)
    assert "Traceback" not in res.stderr
