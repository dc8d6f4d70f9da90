"""What a new user meets first (issue 27, "Newcomer friction"): the commands the docs show work as
written after the README's set-up, installed names that do not collide, and clear answers to the
first mistakes."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from conftest import REPO, TRAINKIT
from run_helpers import env_for, trainkit

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


BARE = re.compile(r"^(trainkit|pip|pytest)\b")  # found on PATH only once the venv is activated


def shell_blocks(page: str) -> list[list[str]]:
    text = (REPO / page).read_text()
    return [block.splitlines() for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S)]


def test_docs_commands_run_after_the_readme_set_up_without_an_activated_venv():
    """The README's set-up never activates .venv: a bare `trainkit`/`pip` line is `command not found`
    unless its block activates the venv first."""
    for page in ("README.md", "docs/plugins.md"):
        for block in shell_blocks(page):
            activated = False
            for line in block:
                activated = activated or line.startswith(". .venv/bin/activate")
                assert activated or not BARE.match(line), f"{page}: {line!r} needs `. .venv/bin/activate` first"


def test_plugins_new_says_how_to_install_into_the_environment_that_runs_trainkit(tmp_path):
    made = trainkit(tmp_path, "plugins", "new", "monitor", "step_alarm")  # --dir defaults to here
    assert made.returncode == 0, made.output
    # the local folder as a path (issue 38 f): a bare `pip install trainkit-step-alarm` asks the package index
    assert f"install: {sys.executable} -m pip install ./trainkit-step-alarm\n" in made.stdout, made.stdout
    assert f"test:    {sys.executable} -m pytest " in made.stdout
    readme = (tmp_path / "trainkit-step-alarm" / "README.md").read_text()
    assert "`pip install" not in readme and "-m pip install ." in readme


def declared_name(pyproject) -> tuple[str, list[str]]:
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    return project["name"], project.get("dependencies", [])


def test_the_distribution_has_its_own_name_on_the_package_index_and_plugins_depend_on_it(tmp_path):
    """`trainkit` on the package index is an unrelated project: a plugin depending on it would pull
    that in wherever this checkout is not installed. The import name and the command stay `trainkit`."""
    from importlib.metadata import distribution

    from trainkit.registry import DISTRIBUTION, names

    name, _ = declared_name(REPO / "pyproject.toml")
    assert name == DISTRIBUTION and name != "trainkit"
    assert declared_name(REPO / "plugins/example/pyproject.toml")[1] == [DISTRIBUTION]
    made = trainkit(tmp_path, "plugins", "new", "model", "tiny", "--dir", str(tmp_path))
    assert made.returncode == 0, made.output
    assert declared_name(tmp_path / "trainkit-tiny" / "pyproject.toml")[1] == [DISTRIBUTION]
    installed = distribution(DISTRIBUTION)  # the checkout installed under that name, its command still `trainkit`
    assert "trainkit = trainkit.cli:entry" in installed.read_text("entry_points.txt")
    assert set(names("strategies", builtin_only=True)) >= {"ddp", "fsdp", "pipeline", "deepspeed"}
    extras = [str(f) for f in [*REPO.glob("trainkit/**/*.py"), *REPO.glob("docs/*.md"), REPO / "README.md"]
              if "trainkit[" in f.read_text()]  # `pip install 'trainkit[hf]'` installs the unrelated project
    assert not extras, extras


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server binding it would
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def still_running(processes: list, timeout: float) -> list:
    """Those of `processes` still running after `timeout` (a zombie left for its reaper runs nothing)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in processes:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def wait_for_line(path, needle: str, proc: subprocess.Popen, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        text = path.read_text() if path.exists() else ""
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"no {needle!r} in {timeout}s (exit {proc.poll()}): {path.read_text()}")


def test_ui_prints_its_url_once_the_page_answers_and_sigterm_stops_the_whole_server(tmp_path):
    """`trainkit ui` SIGTERMed (a service manager, `kill`) left uvicorn, the job runner and huey
    consumers serving on the port; and it printed its URL 10-16 s before the page answered."""
    port, out = free_port(), tmp_path / "ui.out"
    with open(out, "w") as stdout, open(tmp_path / "ui.err", "w") as stderr:
        ui = subprocess.Popen([*TRAINKIT, "ui", "--uri", f"sqlite:///{tmp_path}/mlflow.db", "--port", str(port)],
                              cwd=tmp_path, env=env_for(tmp_path), stdout=stdout, stderr=stderr,
                              start_new_session=True)
    server = []
    try:
        wait_for_line(out, f"http://127.0.0.1:{port}", ui)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:  # answers when announced
            assert page.status == 200
        server = psutil.Process(ui.pid).children(recursive=True)
        assert len(server) >= 3, server  # mlflow ui, uvicorn, the job runner, ...
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=30) == 0
        assert not still_running(server, timeout=15)
        assert port_is_free(port)
    finally:
        try:
            os.killpg(ui.pid, signal.SIGKILL)  # its own group (and, before the fix, the server's)
        except ProcessLookupError:
            pass
        for proc in server:
            try:
                proc.kill()
            except psutil.Error:
                pass
        ui.wait(timeout=10)


def test_init_sizes_the_recipe_to_this_machine_and_doctor_warns_about_more_workers_than_cores(tmp_path):
    """On a 2-core CPU machine `init` wrote num_workers 8 and pin_memory, asked for "GPUs per node",
    and the doctor passed that recipe while torch warned about the workers."""
    import yaml

    from trainkit.doctor.registry import CHECKS
    from trainkit.machine import usable_cores, visible_gpus
    from trainkit.recipe import resolve
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    make_imagefolder(tmp_path / "imgs", classes=2, per_class=2, size=16)
    answers = "imgs\nsmall_cnn\n" + "\n" * 8  # the data folder, a model, then Enter: every default
    made = subprocess.run([*TRAINKIT, "init", "mine.yaml"], input=answers, cwd=tmp_path, env=env_for(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    recipe = yaml.safe_load((tmp_path / "mine.yaml").read_text())
    ranks, workers = recipe["launch"]["nproc_per_node"], recipe["data"]["num_workers"]
    assert ranks * workers <= usable_cores()
    if not visible_gpus():
        assert "GPUs per node" not in made.stderr and "no GPU here" in made.stderr
        assert ranks == 1 and "pin_memory" not in recipe["data"]

    recipe["data"]["num_workers"] = usable_cores() + 1
    (tmp_path / "busy.yaml").write_text(yaml.safe_dump(recipe))
    (row,) = [entry.run(resolve(tmp_path / "busy.yaml")) for entry in CHECKS if entry.name == "data workers"]
    assert row.status == "warn", row  # a row of `trainkit doctor RECIPE` (in-process: the doctor takes seconds)
    assert f"data.num_workers {usable_cores() + 1} = " in row.detail and f"{usable_cores()} usable core(s)" in row.detail
    assert row.fix.startswith(f"data.num_workers: {usable_cores() // ranks} (") and "busy.yaml:" in row.fix


def test_every_command_answers_an_override_written_apart_or_as_an_option_with_its_spelling(capsys):
    """`validate base.yaml trainer.max_steps 50` said trainer.max_steps was a missing file, `run` said
    "overrides are written key.path=value", and `--trainer.max_steps=50` was a bare argparse error."""
    from trainkit.cli import main

    recipe = str(REPO / "recipes" / "demo-cpu.yaml")
    for command in ("validate", "plan", "run", "doctor"):
        for written in (["trainer.max_steps", "50"], ["--trainer.max_steps=50"], ["--trainer.max_steps", "50"]):
            assert main([command, recipe, *written]) == 2
            err = capsys.readouterr().err
            assert f"trainkit {command}: overrides are written key.path=value" in err, err
            assert f"{' '.join(written)} -> trainer.max_steps=50" in err, err
            assert "no such file" not in err and "unrecognized arguments" not in err
    assert main(["validate", recipe, "trainer.max_steps=50"]) == 0  # the grammar itself is unchanged


def test_read_paths_resolve_from_the_working_directory_errors_show_where_and_name_the_recipe(tmp_path, monkeypatch,
                                                                                            capsys):
    """A recipe's relative data and weights paths resolve from the working directory (defaults: from
    the file naming them): an error shows the absolute path it looked at, and `validate` of several
    recipes names the recipe each problem of a shared fragment belongs to."""
    import yaml

    from trainkit.cli import main

    (tmp_path / "recipes" / "base").mkdir(parents=True)
    base = {"model": {"name": "mlp", "args": {"in_features": 8, "num_classes": 2}},
            "data": {"name": "imagefolder", "root": "imgs", "batch_size": 4, "image_size": 8},
            "optimizer": {"name": "sgd", "lr": 0.1}, "trainer": {"max_steps": 2}, "launch": {"nproc_per_node": 1},
            "tracking": {"enabled": False}, "precision": "fp32", "strategy": {"name": "ddp"}}
    (tmp_path / "recipes" / "base" / "common.yaml").write_text(yaml.safe_dump(base))
    for name in ("a", "b"):
        (tmp_path / "recipes" / f"{name}.yaml").write_text(
            f"defaults: [base/common.yaml]\nname: {name}\nmodel: {{weights: weights/{name}.pt}}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--deep", "recipes/"]) == 2
    err = capsys.readouterr().err
    for name in ("a", "b"):
        assert (f"weights file not found: weights/{name}.pt (from the working directory: "
                f"{tmp_path / 'weights' / f'{name}.pt'})") in err, err
        assert f"recipes/{name}.yaml:" in err
    assert f"data folder not found: imgs (from the working directory: {tmp_path / 'imgs'})" in err
    shared = [line for line in err.splitlines() if line.startswith("recipes/base/common.yaml")]
    assert shared and all(re.search(r"\(recipe recipes/[ab]\.yaml\)$", line) for line in shared), err


# --------------------------------------------------------------------------- after a run: one tracked run, shared
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 4-step tracked one-process run with the breakdown and system monitors, in its own folder."""
    from run_helpers import mlp_recipe

    tmp = tmp_path_factory.mktemp("finished")
    uri = f"sqlite:///{tmp}/mlflow.db"
    recipe = mlp_recipe(tmp, "newcomer", launch={"nproc_per_node": 1}, trainer={"max_steps": 4, "log_every": 2},
                        monitors=["breakdown", "system"], tracking={"enabled": True, "uri": uri})
    result = trainkit(tmp, "run", recipe.name)
    assert result.returncode == 0, result.output
    return tmp, uri, result


def test_the_end_of_a_run_says_how_to_see_it_and_report_and_top_take_its_name(finished_run):
    tmp, uri, result = finished_run
    tail = result.stdout.strip().splitlines()[-2:]
    assert tail[0].startswith(f"trainkit: next: trainkit report {tmp / 'runs' / 'newcomer'} ")
    assert tail[1].startswith(f"trainkit: next: trainkit ui --uri {uri} "), tail  # the store, from any folder
    by_path, by_name = trainkit(tmp, "report", "runs/newcomer"), trainkit(tmp, "report", "newcomer")
    assert by_name.returncode == 0 and by_name.stdout == by_path.stdout and "newcomer" in by_name.stdout
    top = trainkit(tmp, "top", "newcomer", "--once", COLUMNS="200")
    assert top.returncode == 0 and "finished" in top.stdout, top.output
    host_cells = [line.split("│")[2].strip() for line in top.stdout.splitlines()
                  if re.match(r"\s*│\s*0\s*│", line) and line.count("│") > 6]  # rank 0's row of the per-rank table
    assert host_cells == [socket.gethostname()], top.stdout  # the host column was empty


def test_summary_names_its_two_durations_apart(finished_run):
    import json

    summary = json.loads((finished_run[0] / "runs" / "newcomer" / "summary.json").read_text())
    assert "wall_s" not in summary  # the loop's seconds and the process's were both called wall_s
    assert 0 < summary["loop_s"] <= summary["wall_times"]["wall_s"]


def test_docs_have_no_empty_code_blocks_and_the_reference_keeps_whole_plugin_descriptions():
    empty = [page.name for page in (REPO / "docs").glob("*.md")
             if any(not body.strip() for body in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), re.M | re.S))]
    assert not empty, empty
    from trainkit import registry
    from trainkit.recipe.reference import reference_markdown
    from trainkit.recipe.schema import PLUGIN_FIELDS

    text = reference_markdown(builtin_only=False)  # `trainkit schema --markdown --all`
    for kind in PLUGIN_FIELDS.values():
        for name in registry.names(kind):
            doc = registry.load(kind, name).__doc__
            if doc:  # its first paragraph, whole (the first line alone stopped mid-sentence)
                assert " ".join(doc.strip().split("\n\n")[0].split()) in text, (kind, name)
