"""Helpers for the `trainkit run` tests: write small recipes, launch `trainkit run` under a hard
timeout (killing the whole process group, torchrun workers included), read run outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

LAUNCH_TIMEOUT_S = 240
TESTS = Path(__file__).resolve().parent


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for(tmp: Path, **extra: str) -> dict:
    env = dict(os.environ)
    for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        (tmp / key.lower()).mkdir(parents=True, exist_ok=True)
        env[key] = str(tmp / key.lower())
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TRAINKIT_FAULT_INJECT", None)
    env.pop("TRAINKIT_FAULT_DELAY", None)
    env.pop("TRAINKIT_FAULT_NAN", None)
    env.pop("TRAINKIT_FAULT_COUNT_COLLECTIVES", None)
    env.pop("TRAINKIT_FAULT_DIVERGE", None)
    env.pop("TRAINKIT_FAULT_PROBE_FSDP", None)
    env.pop("TRAINKIT_FAULT_PROBE_PERF", None)
    env.pop("TRAINKIT_TEST_HOOKS", None)
    if any(key.startswith("TRAINKIT_FAULT_") for key in extra):  # only then: the workers' fault injection
        env["TRAINKIT_TEST_HOOKS"] = "fault_injection"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def trainkit(tmp: Path, *args: str, timeout: float = LAUNCH_TIMEOUT_S, **env: str) -> Result:
    """Run `trainkit ARGS` in `tmp`; on timeout kill every process it started and fail."""
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", *args], cwd=tmp, env=env_for(tmp, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"trainkit {' '.join(args)} did not finish in {timeout}s\n{out}\n{err}")
    return Result(proc.returncode, out, err)


def mlp_recipe(tmp: Path, name: str, **sections) -> Path:
    """A small synthetic-data MLP recipe (fast on 2 CPU cores); `sections` deep-update it."""
    recipe = {
        "name": name,
        "seed": 7,
        "model": {"name": "mlp", "args": {"in_features": 48, "hidden": 64, "num_classes": 4}},
        "data": {"name": "synthetic", "batch_size": 8, "num_samples": 256, "shape": [3, 4, 4], "num_classes": 4},
        "strategy": {"name": "ddp"},
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "trainer": {"max_steps": 12, "log_every": 1, "checkpoint": {"every": 4, "keep": 3}},
        "launch": {"nproc_per_node": 2, "run_dir": str(tmp / "runs"), "timeout_s": 60},
        "tracking": {"enabled": False},
    }
    for key, value in sections.items():
        base = recipe.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and value.get("name", base.get("name")) == base.get("name"):
            recipe[key] = {**base, **value}
        else:
            recipe[key] = value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# --------------------------------------------------------------------------- a real MLflow server
def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_mlflow_server(folder: Path, port: int, host: str = "127.0.0.1") -> subprocess.Popen:
    """`mlflow server` with a SQLite store in `folder`, up (its /health answers) or an AssertionError."""
    import time
    import urllib.request

    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{folder}/server.db", "--default-artifact-root", str(folder / "artifacts"),
                             "--host", host, "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2).status == 200:
                return proc
        except OSError:
            time.sleep(0.5)
    stop_mlflow_server(proc)
    raise AssertionError("mlflow server did not start in 90 s")


def stop_mlflow_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
