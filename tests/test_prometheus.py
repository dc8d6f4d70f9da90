"""The `prometheus` monitor serves live metrics while a run trains: scraped twice during training and
parsed with prometheus_client's own parser, the values move, and every metric the Grafana dashboard in
docs/ queries is in the scrape. A port already in use stops the launch with a message naming it."""

from __future__ import annotations

import pytest

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from run_helpers import env_for, mlp_recipe, trainkit

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict:
    """{metric family name: [(labels, value), ...]} or {} while nothing answers."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return {}
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def value(families: dict, name: str, **labels) -> float:
    return next(v for lab, v in families[name] if all(lab.get(k) == x for k, x in labels.items()))


def dashboard_metrics() -> set[str]:
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\b(trainkit_[a-z0-9_]+)", e)}


@pytest.mark.slow
def test_live_metrics_move_during_training_and_cover_the_dashboard(tmp_path):
    port = free_port()
    recipe = mlp_recipe(tmp_path, "live", launch={"nproc_per_node": 1},
                        data={"sleep_ms": 2.0},  # 16 ms per step: a few seconds of training to scrape
                        trainer={"max_steps": 400, "log_every": 5, "checkpoint": {"every": 400}},
                        monitors=["system", "breakdown", {"name": "prometheus", "port": port}])
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    scrapes = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and len(scrapes) < 2 and proc.poll() is None:
            families = scrape(port)
            if families.get("trainkit_loss") and families.get("trainkit_step_phase_seconds"):
                if not scrapes or value(families, "trainkit_step", rank="0") > value(scrapes[0], "trainkit_step", rank="0"):
                    scrapes.append(families)
                    time.sleep(0.5)
            time.sleep(0.2)
    finally:
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    assert proc.returncode == 0, out
    assert len(scrapes) == 2, f"never scraped two moving values on port {port}\n{out}"
    first, second = scrapes
    host = socket.gethostname()
    assert value(second, "trainkit_step", rank="0", host=host) > value(first, "trainkit_step", rank="0", host=host)
    assert value(second, "trainkit_samples_per_second", rank="0") > 0
    phases = {lab["phase"] for lab, _ in second["trainkit_step_phase_seconds"]}
    assert {"data_wait", "forward", "backward", "optimizer", "total"} <= phases
    assert value(second, "trainkit_system_cpu_percent", node="0") >= 0
    missing = dashboard_metrics() - set(second)
    assert not missing, f"the dashboard queries metrics the monitor does not serve: {sorted(missing)}"
    assert scrape(port) == {}  # the server stops with the run


@pytest.mark.slow
def test_a_busy_port_stops_the_launch_naming_the_process(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        recipe = mlp_recipe(tmp_path, "busy", launch={"nproc_per_node": 1},
                            monitors=[{"name": "prometheus", "port": port}])
        result = trainkit(tmp_path, "run", str(recipe), timeout=120)
    assert result.returncode == 2, result.output
    assert f"the prometheus monitor's port {port} is in use by pid {os.getpid()}" in result.stderr
    assert "not started" in result.stderr
    assert not (tmp_path / "runs" / "busy" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_binding_beyond_loopback_warns(tmp_path):
    port = free_port()
    recipe = mlp_recipe(tmp_path, "exposed", launch={"nproc_per_node": 1}, trainer={"max_steps": 3},
                        monitors=[{"name": "prometheus", "port": port, "host": "0.0.0.0"}])
    result = trainkit(tmp_path, "run", str(recipe), timeout=120)
    assert result.returncode == 0, result.output
    assert f"prometheus monitor binds 0.0.0.0:{port}: anyone who can reach this machine" in result.stderr
