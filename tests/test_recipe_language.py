"""The recipe language as users rely on it: composition, overrides, interpolation, safety limits,
the frozen typed Recipe, plugins, and the CLI contract (exit codes, formats, no heavy imports)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pydantic
import pytest

from trainkit.recipe import RecipeError, resolve
from trainkit.recipe.yaml_source import MAX_BYTES, MAX_DEPTH

from conftest import REPO, TRAINKIT

VALID = """\
name: demo
model: {name: mlp, args: {hidden: 64}}
data: {name: synthetic, batch_size: 8}
strategy: {name: ddp}
trainer: {max_steps: 10}
launch: {nproc_per_node: 2}
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def messages(excinfo) -> list[str]:
    return [str(p) for p in excinfo.value.problems]


def cli(*args, cwd=REPO, env=None):
    return subprocess.run([*TRAINKIT, *args], cwd=cwd, capture_output=True, text=True, timeout=60, env=env)


# --------------------------------------------------------------------------- resolver
def test_defaults_compose_in_order_and_the_recipe_wins(tmp_path):
    write(tmp_path, "base/a.yaml", "seed: 1\ntrainer: {max_steps: 5, log_every: 2}\n")
    write(tmp_path, "base/b.yaml", "seed: 2\n")
    recipe = write(tmp_path, "r.yaml", "defaults: [base/a.yaml, base/b.yaml]\n" + VALID)
    r = resolve(recipe).recipe
    assert r.seed == 2  # b over a
    assert r.trainer.max_steps == 10 and r.trainer.log_every == 2  # recipe over defaults, deep merge


def test_overrides_apply_and_errors_name_the_override(tmp_path):
    recipe = write(tmp_path, "r.yaml", VALID)
    r = resolve(recipe, ["trainer.max_steps=20", "strategy.bucket_cap_mb=50"]).recipe
    assert r.trainer.max_steps == 20 and r.strategy.bucket_cap_mb == 50
    with pytest.raises(RecipeError) as err:
        resolve(recipe, ["trainer.max_stepz=20"])
    assert messages(err)[0].startswith("override 'trainer.max_stepz=20': trainer.max_stepz: unknown key 'max_stepz'; "
                                       "did you mean 'max_steps'?")
    with pytest.raises(RecipeError) as err:
        resolve(recipe, ["trainer.max_steps"])
    assert messages(err) == ["override 'trainer.max_steps': overrides are written key.path=value, +key.path=value "
                             "(a new key under a free-form mapping) or ~key.path (delete), e.g. trainer.max_steps=20"]


def test_switching_strategy_by_override_drops_the_old_strategys_options(tmp_path):
    recipe = write(tmp_path, "r.yaml", VALID.replace("{name: ddp}", "{name: ddp, bucket_cap_mb: 5}"))
    r = resolve(recipe, ["strategy.name=fsdp"]).recipe
    assert r.strategy.name == "fsdp" and r.strategy.reshard_after_forward is True


def test_interpolation_and_environment_variables(tmp_path, monkeypatch):
    recipe = write(tmp_path, "r.yaml", VALID + "tracking: {experiment: '${name}-${oc.env:TEAM,ml}'}\n")
    assert resolve(recipe).recipe.tracking.experiment == "demo-ml"
    monkeypatch.setenv("TEAM", "vision")
    assert resolve(recipe).recipe.tracking.experiment == "demo-vision"


def test_recipe_is_frozen_and_typed(tmp_path):
    r = resolve(write(tmp_path, "r.yaml", VALID)).recipe
    with pytest.raises(pydantic.ValidationError):
        r.trainer.max_steps = 3
    assert r.world_size == 2 and r.global_batch == 16
    assert [m.name for m in resolve(write(tmp_path, "m.yaml", VALID + "monitors: [system, {name: profiler, active: 2}]\n"))
            .recipe.monitors] == ["system", "profiler"]


def test_all_problems_of_a_recipe_are_reported_together(tmp_path):
    recipe = write(tmp_path, "r.yaml", VALID.replace("batch_size: 8", "batch_size: 0") + "precision: fp8\nseeed: 3\n")
    with pytest.raises(RecipeError) as err:
        resolve(recipe)
    paths = sorted(p.path for p in err.value.problems)
    assert paths == ["data.batch_size", "precision", "seeed"]


# --------------------------------------------------------------------------- hostile input
def test_huge_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("a: " + "x" * (MAX_BYTES + 1))
    with pytest.raises(RecipeError) as err:
        resolve(path)
    assert "recipes are limited to" in messages(err)[0]


def test_binary_file_is_refused(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(RecipeError) as err:
        resolve(path)
    assert messages(err) == [f"{path}:1:1: file is binary, not YAML text"]


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 5000])
def test_deep_nesting_is_bounded(tmp_path, depth):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * depth + "]" * depth)
    with pytest.raises(RecipeError) as err:
        resolve(path)
    assert "nested deeper than" in messages(err)[0]


def test_alias_bomb_is_stopped_quickly(tmp_path):
    import time

    start = time.monotonic()
    with pytest.raises(RecipeError):
        resolve(REPO / "tests/recipes/broken/alias-bomb.yaml")
    assert time.monotonic() - start < 2.0


# --------------------------------------------------------------------------- plugins
def test_third_party_dataset_plugin_is_validated_by_its_own_options_model(tmp_path):
    pytest.importorskip("trainkit_example_plugin", reason="pip install -e plugins/example")
    recipe = write(tmp_path, "r.yaml", VALID.replace("{name: synthetic, batch_size: 8}",
                                                     "{name: blobs, batch_size: 8, dim: 16}"))
    assert resolve(recipe).recipe.data.dim == 16
    with pytest.raises(RecipeError) as err:
        resolve(recipe, ["data.dims=3"])
    assert "unknown key 'dims'; did you mean 'dim'?" in messages(err)[0]


@pytest.mark.slow
def test_only_the_named_plugins_are_imported(tmp_path):
    code = ("import sys; from trainkit.recipe import resolve; resolve(sys.argv[1]);"
            "print('trainkit_example_plugin.data' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(write(tmp_path, "r.yaml", VALID))],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --------------------------------------------------------------------------- CLI
@pytest.mark.slow
def test_validate_exit_codes_and_summary(tmp_path):
    good = write(tmp_path, "good.yaml", VALID)
    bad = write(tmp_path, "bad.yaml", VALID.replace("ddp", "dpp"))
    ok = cli("validate", str(good))
    assert ok.returncode == 0 and "1 of 1 recipe(s) valid" in ok.stdout
    res = cli("validate", str(good), str(bad))
    assert res.returncode == 2
    assert "1 of 2 recipe(s) valid" in res.stdout
    assert f"{bad}:4:18: strategy.name: unknown strategy \"dpp\"; did you mean 'ddp'?" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_validate_folder_skips_composition_fragments_and_reports_missing_paths(tmp_path):
    write(tmp_path, "recipes/base/fragment.yaml", "seed: 1\n")
    write(tmp_path, "recipes/a.yaml", VALID)
    res = cli("validate", str(tmp_path / "recipes"), str(tmp_path / "nope.yaml"))
    assert res.returncode == 2
    assert "1 of 2 recipe(s) valid" in res.stdout
    assert "nope.yaml:1:1: no such file, folder or matching recipe" in res.stderr


@pytest.mark.slow
def test_validate_json_format_for_ci(tmp_path):
    bad = write(tmp_path, "bad.yaml", VALID.replace("max_steps: 10", "max_steps: -1"))
    res = cli("validate", "--format", "json", str(bad))
    assert res.returncode == 2
    assert json.loads(res.stdout) == [{
        "file": str(bad), "line": 5, "col": 22, "override": None, "path": "trainer.max_steps",
        "message": "Input should be greater than 0 (got -1)", "severity": "error"}]
    gh = cli("validate", "--format", "github", str(bad))
    assert gh.stdout.strip() == f"::error file={bad},line=5,col=22::trainer.max_steps: Input should be greater than 0 (got -1)"


@pytest.mark.slow
def test_validate_and_help_do_not_import_torch_deepspeed_or_mlflow():
    code = ("import sys; from trainkit.cli import main\n"
            "try:\n    main(['validate', *sys.argv[1:]])\nexcept SystemExit: pass\n"
            "try:\n    main(['--help'])\nexcept SystemExit: pass\n"
            "heavy = [m for m in ('torch', 'deepspeed', 'mlflow') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    res = subprocess.run([sys.executable, "-c", code, *map(str, sorted((REPO / "recipes").glob("*.yaml")))],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "HEAVY []" in res.stdout, res.stdout + res.stderr


@pytest.mark.slow
def test_every_shipped_recipe_validates():
    res = cli("validate", "recipes")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_schema_is_json_schema_with_every_plugin():
    jsonschema = pytest.importorskip("jsonschema")
    res = cli("schema")
    assert res.returncode == 0
    schema = json.loads(res.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    text = res.stdout
    for name in ("ddp", "fsdp", "pipeline", "deepspeed", "imagefolder", "profiler", "stragglers"):
        assert f'"{name}"' in text
    # a recipe, as data, conforms to the schema an editor would use
    import yaml

    data = yaml.safe_load(VALID + "monitors: [system, {name: profiler, active: 2}]\n")
    jsonschema.validate(data, schema)


@pytest.mark.slow
def test_bad_user_input_never_prints_a_traceback(tmp_path):
    for args in (["validate"], ["plan", str(tmp_path / "missing.yaml")], ["run", str(tmp_path / "x.yaml"), "a.b"],
                 ["nonsense"]):
        res = cli(*args)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert "Traceback" not in res.stderr, args


@pytest.mark.slow
def test_reference_docs_are_generated_from_the_schema():
    """docs/reference.md must equal `trainkit schema --markdown` (regenerate it when the schema changes)."""
    res = cli("schema", "--markdown")
    assert res.returncode == 0
    assert (REPO / "docs" / "reference.md").read_text() == res.stdout, \
        "docs/reference.md is stale: run `trainkit schema --markdown > docs/reference.md`"


@pytest.mark.slow
def test_plan_shows_the_resolved_recipe_what_it_implies_and_the_exact_torchrun_command(tmp_path):
    recipe = write(tmp_path, "r.yaml", VALID.replace("max_steps: 10", "max_steps: 10, grad_accum_steps: 2"))
    res = cli("plan", str(recipe), "data.batch_size=4")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "batch_size: 4" in out  # the override, resolved
    assert "world size:      2  (2 per node x 1 node(s))" in out
    assert "global batch:    16  (batch_size 4 x data-parallel 2 x grad_accum_steps 2)" in out
    assert "steps per epoch: 64  (1024 samples)" in out
    command = out.strip().splitlines()[-1]
    assert command.startswith("torchrun ") and "--nproc-per-node=2" in command
    assert command.endswith("-m trainkit.runtime.worker '<run dir>'")


@pytest.mark.slow
def test_an_unwritable_output_folder_is_a_message_not_a_traceback(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    res = cli("data", "make-imagefolder", str(blocker / "images"), "--classes", "2", "--per-class", "1")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert str(blocker) in res.stderr


def test_min_max_node_ranges_stay_text_in_files_and_overrides(tmp_path):
    """Guards against YAML 1.1's base-60 integers: `nnodes: 2:4` (file) and `launch.nnodes=2:4`
    (override) must mean the elastic range '2:4', not the number 124."""
    recipe = tmp_path / "elastic.yaml"
    recipe.write_text("name: elastic\nmodel: {name: mlp}\ndata: {name: synthetic, batch_size: 4}\n"
                      "strategy: {name: ddp}\noptimizer: {name: sgd, lr: 0.1}\ntrainer: {max_steps: 2}\n"
                      "launch: {nnodes: 2:4, rdzv_endpoint: 'h:1'}\n")
    assert resolve(recipe).recipe.launch.nnodes == "2:4"
    assert resolve(recipe, ["launch.nnodes=1:3"]).recipe.launch.nnodes == "1:3"
