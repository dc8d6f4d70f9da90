"""The MLflow UI, rendered by a real browser (headless Chromium), shows a trainkit run as a training run:
the links trainkit prints open the model-training view (MLflow 3.x opens the GenAI view otherwise),
the run's first charts are its training curves (loss, learning rate), then its evaluation metrics, and the bottleneck
verdict with its whole advice is the run's description.

One real run (one process, eval and monitors on), one `trainkit ui`, one browser, a few pages."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from browser import CHROMIUM, Browser
from run_helpers import env_for, free_port, mlp_recipe, stop_mlflow_server, trainkit
from trainkit.tracking.browse import ui_link

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


def wait_until_serving(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"trainkit ui did not serve {base} in 120 s")


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    """A finished run with eval, monitors and a verdict in a SQLite store, and `trainkit ui` serving it
    (started beside the run: the store is created first, so the two never race to create it)."""
    assert CHROMIUM, "this test renders the MLflow UI in Debian's chromium: apt-get install chromium (.ci/run does)"
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("ui")
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    client.search_experiments()  # creates the store
    port = free_port()
    with open(tmp / "ui.log", "w") as log:
        server = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "ui", "--uri", uri, "--port", str(port)],
                                  cwd=tmp, env=env_for(tmp, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        recipe = mlp_recipe(tmp, "ui-demo", launch={"nproc_per_node": 1},
                            data={"sleep_ms": 2.0, "num_workers": 0},  # data-bound, with advice (test_bottleneck.py)
                            trainer={"max_steps": 30, "log_every": 5, "eval_every": 10},
                            tracking={"experiment": "ui-demo", "uri": uri, "enabled": True},
                            monitors=["system", "throughput", "breakdown"])
        result = trainkit(tmp, "run", str(recipe))
        assert result.returncode == 0, result.output
        experiment = client.get_experiment_by_name("ui-demo")
        (run,) = client.search_runs([experiment.experiment_id])
        base = f"http://127.0.0.1:{port}"
        wait_until_serving(base, server)
        yield {"tmp": tmp, "base": base, "uri": uri, "experiment": experiment.experiment_id, "run": run,
               "run_dir": tmp / "runs" / "ui-demo"}
    finally:
        stop_mlflow_server(server)


GENAI_VIEW = ("Observability", "Detect Issues")  # the GenAI overview's side navigation and its call to action


@pytest.fixture(scope="module")
def browser(ui):
    browser = Browser(ui["tmp"] / "browser-profile")
    yield browser
    browser.close()


def test_the_experiment_opens_in_the_training_view_from_the_link_trainkit_prints(ui, browser):
    deadline = time.monotonic() + 15  # trainkit ui announces its URL once the server answers
    while "MLflow UI for" not in (ui["tmp"] / "ui.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    announced = (ui["tmp"] / "ui.log").read_text()
    assert f"MLflow UI for {ui['uri']}: {ui_link(ui['base'])}  (Ctrl-C to stop)" in announced, announced
    run_name = ui["run"].info.run_name
    text = browser.open(ui_link(ui["base"], f"/experiments/{ui['experiment']}"), lambda t: run_name in t)
    lines = text.splitlines()
    assert run_name in lines and "Runs" in lines, text  # the runs table, with this run
    assert not [word for word in GENAI_VIEW if word in text], text


def test_the_compare_link_opens_the_runs_side_by_side(ui, browser):
    from trainkit.tracking.browse import compare

    run = ui["run"].info
    link = compare([run.run_id, run.run_id], uri=ui["uri"], ui_url=ui["base"]).splitlines()[-1].split(": ", 1)[1]
    assert link.startswith(f"{ui['base']}/#/compare-runs?") and link.endswith("workflowType=machine_learning"), link
    text = browser.open(link, lambda t: "Parameters" in t and run.run_name in t)
    assert run.run_name in text and "Parameters" in text, (link, text)
    assert not [word for word in GENAI_VIEW if word in text], text


def test_the_run_page_shows_the_learning_curves_first(ui, browser):
    route = f"/experiments/{ui['experiment']}/runs/{ui['run'].info.run_id}/model-metrics"
    text = browser.open(ui_link(ui["base"], route), lambda t: "lr" in t.splitlines())
    lines = text.splitlines()
    sections = [lines[i] for i in range(len(lines) - 1) if re.fullmatch(r"\(\d+\)", lines[i + 1])]
    assert sections[:3] == ["train", "train/eval", sections[2]] and sections[2].startswith("train/"), sections
    first = lines[lines.index("train"):lines.index("train/eval")]
    charts = [line for line in first if line in ("accuracy", "loss", "loss_max", "lr")]
    assert charts == ["loss", "loss_max", "lr"], first  # the training curves first
    second = lines[lines.index("train/eval"):lines.index(sections[2])]
    charts = [line for line in second if line in ("accuracy", "loss", "loss_max", "lr")]
    assert charts == ["accuracy", "loss"], second  # then evaluation, named as such


def test_the_run_description_is_the_bottleneck_verdict_with_its_whole_advice(ui, browser):
    verdict = json.loads((ui["run_dir"] / "reports" / "verdict.json").read_text())
    route = f"/experiments/{ui['experiment']}/runs/{ui['run'].info.run_id}"
    text = browser.open(ui_link(ui["base"], route), lambda t: "Bottleneck: " in t)
    description = text[text.index("Description"):]
    first_line = [line for line in description.splitlines() if line.strip()][1]
    assert first_line == f"Bottleneck: {verdict['kind']}: {verdict['headline']}", description
    assert verdict["advice"], verdict
    for advice in verdict["advice"]:  # whole, not cut (markdown shows `code` as plain text)
        assert advice.replace("`", "") in description, description
