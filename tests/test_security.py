"""Recipes are data (docs/security.md): nothing a recipe names runs unless it is a model factory,
secrets from the environment are never printed or stored, and recipe-made paths stay inside the
run directory. Every hostile recipe goes through real `python -m trainkit.cli` subprocesses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from run_helpers import Result, free_port, mlp_recipe, start_mlflow_server, stop_mlflow_server, trainkit

SECRET = "s3cr3t-Value-91c7"  # planted in MY_API_TOKEN
TORCH_SECRET = "torch-s3cr3t-5d02"  # planted in TORCH_SECRET_TOKEN (environment.json's TORCH_ prefix)
USER, PASSWORD = "tk-user-77", "tk-pass-Zq81"  # planted in the tracking URI
PLANTED = (SECRET, TORCH_SECRET, PASSWORD, USER)

EVIL_MODULE = '''
import os
import torch.nn as nn
import trainkit

MARK = os.environ["HOSTILE_MARK"]


def pwn(**kwargs):
    open(MARK, "w").write("pwn")
    return nn.Linear(2, 2)


lam = lambda **kwargs: open(MARK, "w")


class NotAModule:
    def __init__(self, **kwargs):
        open(MARK, "w").write("class")


class Net(nn.Module):
    def __init__(self, in_features=48, num_classes=4):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, num_classes))

    def forward(self, x):
        return self.body(x)


@trainkit.model_factory
def marked(in_features=48, num_classes=4):
    return Net(in_features, num_classes)
'''
SIDE_EFFECT_MODULE = 'import os\nopen(os.environ["HOSTILE_MARK"] + ".imported", "w").write("imported")\n'

# name -> (model name, refused already by plain validate)
HOSTILE = {
    "os-system": ("os:system", True),
    "subprocess-call": ("subprocess:call", True),
    "builtins-eval": ("builtins:eval", True),
    "this-zen": ("this:s", True),
    "shutil-rmtree": ("shutil:rmtree", True),
    "function": ("evilmod:pwn", False),
    "lambda": ("evilmod:lam", False),
    "plain-class": ("evilmod:NotAModule", False),
    "torch-hub-load": ("torch.hub:load", False),
}
ACCEPTED = {"module-subclass": "evilmod:Net", "marked-factory": "evilmod:marked",
            "torchvision-builder": "torchvision.models:resnet18"}


def _cmd(tmp: Path, *args: str, **env: str) -> Result:
    return trainkit(tmp, *args, timeout=180, PYTHONPATH=_pythonpath(tmp), HOSTILE_MARK=str(tmp / "pwned"), **env)


def _pythonpath(tmp: Path) -> str:
    return os.pathsep.join([str(tmp / "plugins"), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "plugins").mkdir()
    (tmp / "plugins" / "evilmod.py").write_text(EVIL_MODULE)
    (tmp / "plugins" / "sideeffect.py").write_text(SIDE_EFFECT_MODULE + "def f(**kw):\n    pass\n")
    models = {case: (model, {"command": f"touch {tmp / 'pwned'}"}) for case, (model, _) in HOSTILE.items()}
    models["torch-hub-load"] = (HOSTILE["torch-hub-load"][0], {})
    models.update({case: (model, {"num_classes": 4} if model.startswith("torchvision") else
                          {"in_features": 48, "num_classes": 4}) for case, model in ACCEPTED.items()})
    files = {case: mlp_recipe(tmp, case, model={"name": model, "args": args},
                              launch={"nproc_per_node": 1, "run_dir": str(tmp / "runs"), "timeout_s": 60})
             for case, (model, args) in models.items()}
    return tmp, files


def _model_line(path: Path) -> str:
    """`file:line:col: model.name:` of the recipe's model name, as errors print it."""
    lines = path.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip().startswith("name:") and i > 2)
    return f"{path.name}:{line}:"


def _nothing_ran(tmp: Path, result: Result) -> None:
    assert not (tmp / "pwned").exists(), "a recipe-named callable ran"
    assert "Beautiful is better than ugly" not in result.output, "`this` was imported"
    assert "Traceback" not in result.output, result.output


# --------------------------------------------------------------------------- only model factories run
@pytest.mark.slow
def test_plain_validate_refuses_stdlib_paths_and_imports_nothing(corpus):
    tmp, files = corpus
    for case, (model, refused_early) in HOSTILE.items():
        result = _cmd(tmp, "validate", str(files[case]))
        _nothing_ran(tmp, result)
        if refused_early:
            assert result.returncode == 2, result.output
            assert f"model.name: '{model}' names the standard-library module" in result.stderr
            assert _model_line(files[case]) in result.stderr
        else:  # cannot know without importing: valid, and it says what --deep adds
            assert result.returncode == 0, result.output
            assert "not checked without --deep, which imports the model's module" in result.stdout
            assert "is a model factory" in result.stdout


@pytest.mark.slow
def test_plain_validate_does_not_import_a_named_module(corpus):
    tmp, _ = corpus
    recipe = mlp_recipe(tmp, "side", model={"name": "sideeffect:f"})
    result = _cmd(tmp, "validate", str(recipe))
    assert result.returncode == 0, result.output
    assert not (tmp / "pwned.imported").exists()


@pytest.mark.slow
def test_validate_deep_refuses_every_non_factory_and_accepts_real_factories(corpus):
    tmp, files = corpus
    paths = [str(files[c]) for c in (*HOSTILE, *ACCEPTED)]
    result = _cmd(tmp, "validate", "--deep", "--format", "json", *paths)
    _nothing_ran(tmp, result)
    assert result.returncode == 2
    problems = json.loads(result.stdout)
    by_file = {}
    for p in problems:
        by_file.setdefault(Path(p["file"]).stem, []).append(p)
    for case in HOSTILE:
        errors = [p for p in by_file.get(case, []) if p["severity"] == "error"]
        assert [p["path"] for p in errors] == ["model.name"], (case, errors)
        assert errors[0]["line"] > 1 and errors[0]["col"] > 1
        assert "model factory" in errors[0]["message"] or "standard-library" in errors[0]["message"]
    for case in ACCEPTED:
        assert not [p for p in by_file.get(case, []) if p["severity"] == "error"], by_file[case]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["os-system", "function", "lambda", "plain-class", "torch-hub-load"])
@pytest.mark.parametrize("command", ["plan", "doctor", "run"])
def test_plan_doctor_and_run_refuse_before_anything_starts(corpus, case, command):
    tmp, files = corpus
    result = _cmd(tmp, command, str(files[case]))
    _nothing_ran(tmp, result)
    assert result.returncode == 2, result.output
    assert _model_line(files[case]) in result.stderr and "model.name: " in result.stderr
    assert not (tmp / "runs" / case).exists(), "a run directory was created"


@pytest.mark.slow
def test_plan_and_doctor_build_a_module_subclass_only_on_the_meta_device(corpus):
    tmp, files = corpus
    for command in ("plan", "doctor"):
        result = _cmd(tmp, command, str(files["module-subclass"]))
        assert result.returncode == 0, result.output
    assert "params x 4 B" in result.stdout  # the disk estimate built it (on meta)


# --------------------------------------------------------------------------- paths stay inside
BAD_COMPONENTS = ["../../../escaped", "a/b", "..", "x\\y", "nul\x00byte", "line\nbreak", "tab\there"]


@pytest.mark.slow
def test_every_path_component_field_rejects_path_escapes(tmp_path):
    from trainkit.recipe.paths import PATH_COMPONENT_FIELDS

    assert ("name",) in PATH_COMPONENT_FIELDS and ("launch", "rdzv_id") in PATH_COMPONENT_FIELDS
    files = []
    for field in PATH_COMPONENT_FIELDS:
        for i, bad in enumerate(BAD_COMPONENTS):
            recipe = mlp_recipe(tmp_path, f"{'-'.join(field)}-{i}")
            data = yaml.safe_load(recipe.read_text())
            node = data
            for part in field[:-1]:
                node = node.setdefault(part, {})
            node[field[-1]] = bad
            recipe.write_text(yaml.safe_dump(data, sort_keys=False))
            files.append((recipe, field))
    result = _cmd(tmp_path, "validate", "--format", "json", *[str(f) for f, _ in files])
    assert result.returncode == 2 and "Traceback" not in result.output
    problems = json.loads(result.stdout)
    for recipe, field in files:
        mine = [p for p in problems if Path(p["file"]).name == recipe.name]
        assert [p["path"] for p in mine] == [".".join(field)], (recipe.name, mine)
        lines = recipe.read_text().splitlines()
        written = next(i for i, text in enumerate(lines, 1) if text.strip().startswith(f"{field[-1]}:"))
        assert mine[0]["line"] == written, (recipe.name, mine)


@pytest.mark.slow
def test_a_path_escaping_rdzv_id_is_refused_by_run_and_writes_nothing_outside(tmp_path):
    recipe = mlp_recipe(tmp_path, "escape", launch={"rdzv_id": "../../../escaped"})
    for command in ("validate", "plan", "run"):
        result = _cmd(tmp_path, command, str(recipe))
        assert result.returncode == 2 and f"{recipe.name}:" in result.stderr and "launch.rdzv_id:" in result.stderr
    assert not list(tmp_path.rglob("escaped*")) and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_path_component_cannot_come_from_a_secret_variable(tmp_path):
    recipe = mlp_recipe(tmp_path, "named")
    recipe.write_text(recipe.read_text().replace("name: named", "name: ${oc.env:MY_API_TOKEN}", 1))
    for command in ("validate", "plan"):
        result = _cmd(tmp_path, command, str(recipe), MY_API_TOKEN=SECRET)
        assert result.returncode == 2 and "name: comes from a secret environment variable" in result.stderr
        assert SECRET not in result.output


# --------------------------------------------------------------------------- secret names and URIs
def test_secret_names_split_on_underscores_and_are_extendable(monkeypatch):
    from trainkit.recipe.secrets import looks_secret

    monkeypatch.delenv("TRAINKIT_SECRET_VARS", raising=False)
    for name in ("MY_API_TOKEN", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "hf_token", "GH_PASS", "X_AUTH",
                 "SESSION_COOKIE", "PRIVATE_REPO", "GCP_CREDENTIALS", "SMTP_PASSWD", "TORCH_SECRET_TOKEN"):
        assert looks_secret(name), name
    for name in ("TOKENIZERS_PARALLELISM", "TOKENIZER_PATH", "KEYBOARD", "PASSAGE_DIR", "HOME", "MONKEY"):
        assert not looks_secret(name), name
    monkeypatch.setenv("TRAINKIT_SECRET_VARS", "HOME, wandb_entity")
    assert looks_secret("HOME") and looks_secret("WANDB_ENTITY")


def test_uri_credentials_are_masked_and_split_off():
    from trainkit.recipe.secrets import mask_uri_credentials
    from trainkit.tracking.credentials import split

    assert mask_uri_credentials("see http://u:p@host:5000/x and https://tok@h") == \
        "see http://***@host:5000/x and https://***@h"
    assert split("http://a%40b:p%3Aw@h:1/p") == ("http://h:1/p", "a@b", "p:w")
    assert split("sqlite:////tmp/x.db") == ("sqlite:////tmp/x.db", None, None)


def test_ui_binds_loopback_by_default_and_warns_elsewhere(monkeypatch, capsys):
    from trainkit.cli import build_parser
    from trainkit.tracking import browse, ui_server

    assert build_parser().parse_args(["ui"]).host == "127.0.0.1"
    calls = []
    monkeypatch.setattr(ui_server, "serve", lambda cmd, health_url, announce: calls.append(cmd) or 0)
    monkeypatch.setattr(ui_server, "bind_problem", lambda host, port: None)  # whether port 5000 is free here
    browse.ui("sqlite:///x.db")
    assert calls[-1][calls[-1].index("--host") + 1] == "127.0.0.1"
    assert "no authentication" not in capsys.readouterr().err
    browse.ui("sqlite:///x.db", host="0.0.0.0")
    assert calls[-1][calls[-1].index("--host") + 1] == "0.0.0.0"
    assert "the MLflow UI has no authentication" in capsys.readouterr().err


# --------------------------------------------------------------------------- one real tracked run
@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """validate, validate --deep, plan, doctor and one short run of a recipe that reads MY_API_TOKEN,
    tracked on a real MLflow server whose URI carries a user and password."""
    tmp = tmp_path_factory.mktemp("secrets")
    port = free_port()
    server = start_mlflow_server(tmp / "server", port)
    try:
        recipe = mlp_recipe(tmp, "secretive", trainer={"max_steps": 3, "log_every": 1, "checkpoint": {"every": 2}},
                            launch={"nproc_per_node": 1, "run_dir": str(tmp / "runs"), "timeout_s": 60},
                            tracking={"enabled": True, "experiment": "exp-${oc.env:MY_API_TOKEN}"})
        env = {"MY_API_TOKEN": SECRET, "TORCH_SECRET_TOKEN": TORCH_SECRET, "TRAINKIT_TOKENIZER_PATH": "/tok/path",
               "MLFLOW_TRACKING_URI": f"http://{USER}:{PASSWORD}@127.0.0.1:{port}"}
        override = ["tracking.run_name=run-${oc.env:MY_API_TOKEN}"]
        results = {c: trainkit(tmp, *c.split(), str(recipe), *([] if c.startswith("validate") else override),
                               timeout=180, **env)
                   for c in ("validate", "validate --deep", "plan", "doctor", "run")}
        yield tmp, port, results
    finally:
        stop_mlflow_server(server)


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_secrets_occur_nowhere_on_disk_or_on_the_console(secret_run):
    tmp, _, results = secret_run
    assert all(r.returncode == 0 for r in results.values()), {c: r.output for c, r in results.items()}
    for command, result in results.items():
        for planted in PLANTED:
            assert planted not in result.output, (command, planted, result.output)
    stored = _files(tmp / "runs") + _files(tmp / "server")
    assert any(p.name == "server.db" for p in stored) and any("artifacts" in p.parts for p in stored)
    for path in stored:
        data = path.read_bytes()
        for planted in PLANTED:
            assert planted.encode() not in data, (path, planted)
        assert str(path).find(SECRET) < 0


def test_the_secret_is_used_at_run_time_and_shown_as_stars(secret_run):
    from mlflow.tracking import MlflowClient

    tmp, port, results = secret_run
    assert "exp-***" in results["plan"].stdout and "run-***" in results["plan"].stdout
    client = MlflowClient(f"http://127.0.0.1:{port}")
    exp = client.get_experiment_by_name("exp-***")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run-***" and run.info.status == "FINISHED"
    assert run.data.params["tracking.experiment"] == "exp-***" and "train/loss" in run.data.metrics
    run_dir = tmp / "runs" / "secretive"
    assert "${oc.env:MY_API_TOKEN}" in (run_dir / "recipe.yaml").read_text()  # workers resolve it themselves
    assert "exp-***" in (run_dir / "recipe.resolved.yaml").read_text()
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"recipe.yaml", "recipe.resolved.yaml", "summary.json"} <= artifacts


def test_environment_json_drops_secret_values_and_the_spool_keeps_a_bare_uri(secret_run):
    tmp, port, _ = secret_run
    run_dir = tmp / "runs" / "secretive"
    (environment,) = run_dir.glob("launches/*/environment.json")
    env = json.loads(environment.read_text())["env"]
    assert env["TORCH_SECRET_TOKEN"] == "***" and env["TRAINKIT_TOKENIZER_PATH"] == "/tok/path"
    bare = f"http://127.0.0.1:{port}"
    state = json.loads((run_dir / "tracking" / "state.json").read_text())
    assert state["uri"] == bare and state["run_id"]
    create = json.loads((run_dir / "tracking" / "spool.jsonl").read_text().splitlines()[0])
    assert create["uri"] == bare


@pytest.mark.slow
def test_credentials_in_tracking_uri_are_masked_by_plan(tmp_path):
    uri = f"http://{USER}:{PASSWORD}@127.0.0.1:9"
    recipe = mlp_recipe(tmp_path, "creds", tracking={"enabled": True, "uri": uri})
    result = _cmd(tmp_path, "plan", str(recipe))
    assert result.returncode == 0, result.output
    assert "http://***@127.0.0.1:9" in result.stdout and PASSWORD not in result.output and USER not in result.output
