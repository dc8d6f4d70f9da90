"""`trainkit sync` on a spool cut mid-record (a crash while appending) after the tracking server went
away: it says what the cut lost, re-sends what the run directory still holds (metric points from
metrics.jsonl, the run's files), closes the run with a reason that says what happened, prints a
status only once the server holds it, and exits 3. Read back from a real `mlflow server`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
from mlflow.tracking import MlflowClient

from run_helpers import env_for, free_port, mlp_recipe, start_mlflow_server, trainkit
from trainkit.tracking.spool import Spool

pytestmark = pytest.mark.distributed

STEPS = 80
EXIT_LOST = 3


def crash(server) -> None:
    """The tracking server goes away at once (SIGKILL: its SQLite store stays consistent)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def delivered(run_dir) -> list[dict]:
    spool = Spool(run_dir)
    return spool.records()[:spool.state().get("delivered", 0)]


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    """One in-process run of 80 logged steps: the server takes the first points, then goes away; the
    run ends at once (close_wait_s: 0), leaving the rest, its artifacts and FINISHED in the spool."""
    tmp = tmp_path_factory.mktemp("torn")
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    server = start_mlflow_server(tmp, port)
    recipe = mlp_recipe(tmp, "torn", data={"sleep_ms": 12.0}, launch={"nproc_per_node": 1},
                        trainer={"max_steps": STEPS, "log_every": 1, "checkpoint": {"every": STEPS, "keep": 1}},
                        tracking={"experiment": "torn", "uri": uri, "enabled": True, "close_wait_s": 0})
    run_dir = tmp / "runs" / "torn"
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp, env=env_for(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any(r["op"] == "metric" for r in delivered(run_dir)):
            assert time.monotonic() < deadline and proc.poll() is None, "no metric point ever delivered"
            time.sleep(0.2)
        crash(server)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        crash(server)
    assert proc.returncode == 0, out
    spool = Spool(run_dir)
    last_delivered = max(r["step"] for r in delivered(run_dir) if r["op"] == "metric")
    assert last_delivered < STEPS - 10, "the server must go away well before the end"
    assert spool.pending_count() > 0 and spool.records()[-1]["status"] == "FINISHED"
    pristine = tmp / "pristine"
    pristine.mkdir()
    for f in (spool.path, spool.state_path, tmp / "server.db"):
        shutil.copy2(f, pristine / f.name)
    return tmp, port, run_dir, last_delivered


def restored(outage):
    """The outage's run directory and server store as the run left them."""
    tmp, port, run_dir, last_delivered = outage
    spool = Spool(run_dir)
    for f in (spool.path, spool.state_path, tmp / "server.db"):
        shutil.copy2(tmp / "pristine" / f.name, f)
    return spool


def cut_inside(spool, record_index: int) -> int:
    """Cut the spool in the middle of its record number `record_index`; returns the cut's byte offset."""
    data = spool.path.read_bytes()
    start = sum(len(line) for line in data.splitlines(keepends=True)[:record_index])
    at = start + 15
    with open(spool.path, "r+b") as fh:
        fh.truncate(at)
    return at


def the_run(uri: str, spool):
    client = MlflowClient(uri)
    run = client.get_run(spool.state()["run_id"])
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    return run, steps, artifacts


@contextmanager
def server_back(tmp, port):
    server = start_mlflow_server(tmp, port)
    try:
        yield
    finally:
        crash(server)


def synced(tmp, port, spool, run_dir):
    result = trainkit(tmp, "sync", str(run_dir))
    return (result, *the_run(f"http://127.0.0.1:{port}", spool))


def test_a_cut_after_what_was_delivered_is_reported_recovered_from_the_run_dir_and_exits_3(outage):
    tmp, port, run_dir, last_delivered = outage
    spool = restored(outage)
    records = spool.records()
    first_lost = (last_delivered + STEPS) // 2 + 1  # the cut loses steps first_lost..80, the artifacts and FINISHED
    index = next(i for i, r in enumerate(records) if r["op"] == "metric" and r["step"] == first_lost)
    at = cut_inside(spool, index)

    with server_back(tmp, port):
        result, run, steps, artifacts = synced(tmp, port, spool, run_dir)
        again, _, steps_again, _ = synced(tmp, port, spool, run_dir)
    assert result.returncode == EXIT_LOST, result.output
    assert "all tracking records delivered" not in result.output
    assert f"torn at byte {at}" in result.stderr
    assert f"steps {first_lost}-{STEPS}" in result.stderr  # what the spool lost, re-sent from metrics.jsonl
    assert steps == list(range(1, STEPS + 1))  # every step once, in order
    assert {"summary.json", "recipe.yaml", "recipe.resolved.yaml"} <= artifacts
    reason = run.data.tags["trainkit.status_reason"]
    assert run.info.status == "FINISHED" and "launcher died" not in reason
    assert f"torn at byte {at}" in reason and "completed (summary.json)" in reason
    assert "marked FINISHED" in result.stdout

    assert again.returncode == EXIT_LOST and f"torn at byte {at}" in again.stderr  # the loss stays reported
    assert steps_again == steps and "marked" not in again.stdout  # nothing sent twice, nothing closed twice


def test_a_cut_before_what_was_delivered_never_claims_a_status_the_server_does_not_hold(outage):
    tmp, port, run_dir, last_delivered = outage
    spool = restored(outage)
    at = cut_inside(spool, len(delivered(run_dir)) - 30)  # inside a record the server has, ~3 steps before its last

    down = trainkit(tmp, "sync", str(run_dir))  # the server is still down
    assert down.returncode == 1, down.output
    assert "marked" not in down.output and "all tracking records delivered" not in down.output
    assert f"torn at byte {at}" in down.stderr and "before what was already delivered" in down.stderr

    with server_back(tmp, port):
        result, run, steps, artifacts = synced(tmp, port, spool, run_dir)
    assert result.returncode == EXIT_LOST, result.output
    assert f"steps {last_delivered + 1}-{STEPS}" in result.stderr
    assert run.info.status == "FINISHED" and "marked FINISHED" in result.stdout
    assert steps == list(range(1, STEPS + 1))
    assert "summary.json" in artifacts
    assert "launcher died" not in run.data.tags["trainkit.status_reason"]


def test_a_later_run_of_a_torn_run_directory_closes_the_open_run_saying_the_spool_was_torn(outage, tmp_path):
    """Issue 25, case 8: `trainkit run` (not sync) in a run directory whose spool a crash cut after
    the server went away closed the run the cut left open as a dead launch's ("launcher died without
    closing the run"), a false reason. It reports the cut and closes the run saying the spool was
    torn. The server stays down (what the launch spools is what sync delivers, tested above)."""
    tmp, port, run_dir, last_delivered = outage
    spool = restored(outage)
    index = next(i for i, r in enumerate(spool.records()) if r["op"] == "metric" and r["step"] == last_delivered + 5)
    at = cut_inside(spool, index)
    again = tmp_path / "runs" / "torn"  # a copy: the other tests restore only the spool and the server
    shutil.copytree(run_dir, again)
    (tmp_path / "torn.yaml").write_text((tmp / "torn.yaml").read_text().replace(str(tmp / "runs"), str(tmp_path / "runs")))

    result = trainkit(tmp_path, "run", str(tmp_path / "torn.yaml"))
    assert result.returncode == 0, result.output  # training was complete: nothing to train
    assert f"the tracking spool was torn at byte {at}" in result.stderr, result.stderr  # what the cut lost
    assert "left open by a torn tracking spool" in result.stderr and "died without closing" not in result.stderr
    assert "marked FINISHED" not in result.stderr and "not delivered yet" in result.stderr  # the server is down
    spooled = Spool(again).records()
    reason = [r["tags"]["trainkit.status_reason"] for r in spooled if r["op"] == "tags"
              and "trainkit.status_reason" in r["tags"]][-1]
    assert f"torn at byte {at}" in reason and "completed (summary.json)" in reason and "launcher died" not in reason
    assert [r["status"] for r in spooled if r["op"] == "status"][-1] == "FINISHED"
    recovered = {p[3] for r in spooled if r["op"] == "recover" for p in r["points"]}
    assert recovered == set(range(last_delivered + 5, STEPS + 1))  # the steps the cut lost, from metrics.jsonl
    later = trainkit(tmp_path, "sync", str(again))  # the server is still down: pending, the cut still reported
    assert later.returncode == 1 and f"torn at byte {at}" in later.stderr, later.output
