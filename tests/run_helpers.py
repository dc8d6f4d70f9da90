"""Helpers for the `trainkit run` tests: write small recipes, launch `trainkit run` under a hard
timeout (killing the whole process group, torchrun workers included), read run outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

import fault_injection

LAUNCH_TIMEOUT_S = 240


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def env_for(tmp: Path, **extra: str) -> dict:
    """The environment of a `trainkit` subprocess: caches and temp files in `tmp` (inductor's: the test
    session's where conftest set one), one thread per process, and no fault injection unless `extra`
    asks for it (see fault_injection.env)."""
    env = {key: value for key, value in os.environ.items() if not fault_injection.owns(key)}
    for key in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "TORCH_EXTENSIONS_DIR"):
        if key == "TORCHINDUCTOR_CACHE_DIR" and env.get(key):  # the session's (conftest)
            continue
        (tmp / key.lower()).mkdir(parents=True, exist_ok=True)
        env[key] = str(tmp / key.lower())
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return fault_injection.env(env)


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


# --------------------------------------------------------------------------- recipes
# A test recipe is a preset (a whole recipe, as data: MLP, RESNET, strategy_runs.SEEDED_MLP,
# lm_runs.tiny_lm) updated by the test's own sections, and written by `write_recipe`. One merge rule
# (`merged`): a section given as a dict updates the preset's section key by key, unless it names
# another plugin, then it replaces it; any other value replaces. So strategy={"bucket_cap_mb": 1}
# keeps DDP and its keys, strategy={"name": "fsdp"} starts from FSDP's defaults, and
# trainer={"checkpoint": {"every": 2}} replaces the whole checkpoint block.


def merged(preset: dict, sections: dict) -> dict:
    """`preset` updated by `sections` under the one merge rule above; neither is modified."""
    out = dict(preset)
    for key, value in sections.items():
        base = out.get(key)
        if isinstance(base, dict) and isinstance(value, dict) and value.get("name") in (None, base.get("name")):
            out[key] = {**base, **value}
        else:
            out[key] = value
    return out


def write_recipe(tmp: Path, name: str, preset: dict, **sections) -> Path:
    """tmp/NAME.yaml: `preset` named NAME with its runs in tmp/runs, updated by `sections`."""
    recipe = merged(merged(preset, {"name": name, "launch": {"run_dir": str(tmp / "runs")}}), sections)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


MLP = {  # a small synthetic-data MLP (fast on 2 CPU cores)
    "name": "mlp",
    "seed": 7,
    "model": {"name": "mlp", "args": {"in_features": 48, "hidden": 64, "num_classes": 4}},
    "data": {"name": "synthetic", "batch_size": 8, "num_samples": 256, "shape": [3, 4, 4], "num_classes": 4},
    "strategy": {"name": "ddp"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "trainer": {"max_steps": 12, "log_every": 1, "checkpoint": {"every": 4, "keep": 3}},
    "launch": {"nproc_per_node": 2, "timeout_s": 60},
    "tracking": {"enabled": False},
}

RESNET = merged(MLP, {  # torchvision's ResNet-18 on 32x32 synthetic images, 4 steps, no checkpoint before the last
    "model": {"name": "torchvision.resnet18", "args": {"num_classes": 4}},
    "data": {"shape": [3, 32, 32]},
    "optimizer": {"lr": 0.005},
    "trainer": {"max_steps": 4, "checkpoint": {"every": 100}},
    "launch": {"timeout_s": 120},
})


def mlp_recipe(tmp: Path, name: str, **sections) -> Path:
    """The MLP preset updated by `sections` (most run tests start from it)."""
    return write_recipe(tmp, name, MLP, **sections)


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# --------------------------------------------------------------------------- a real MLflow server
def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the kernel's ephemeral range (32768-60999 on Linux): a port the kernel
    hands out itself (bind to 0) can be handed out again -- to a rank's gloo or store socket -- before
    the test's server binds it (an MLflow server started mid-run found its port taken). Ports below the
    range are only ever taken by explicit binds."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


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
        if proc.poll() is not None:  # it exited (its port taken, a bad store): no use waiting the 90 s
            raise AssertionError(f"mlflow server exited with {proc.returncode} before answering on port {port}")
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


def wait_for(predicate, timeout: float, what: str):
    """Poll `predicate` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def planned_per_rank(path, runtime: bool = True) -> int:
    """What `trainkit plan` predicts one CPU rank needs for the recipe at `path` (the memory plan);
    `runtime=False`: without its "runtime" line (the process before the model, which a measurement above
    the rank's own baseline leaves out)."""
    from trainkit.recipe import resolve
    from trainkit.recipe.memory_plan import plan, setting_of
    from trainkit.runtime.memory_trace import model_sizes

    recipe = resolve(path).recipe
    planned = plan(model_sizes(recipe), setting_of(recipe, "cpu"))
    return planned.per_rank - (0 if runtime else sum(p.bytes for p in planned.parts if p.name == "runtime"))


def planned_saving_against_ddp(path) -> int:
    """What the memory plan says the recipe at `path` saves per rank against the same recipe under DDP
    (what each rank would hold as a whole replica), without the runtime lines: the measured saving
    compares each run above its own baseline, which holds the strategy's libraries (DeepSpeed's 20 MiB)."""
    recipe = yaml.safe_load(Path(path).read_text())
    replica = Path(path).with_name(Path(path).stem + "-as-ddp.yaml")
    replica.write_text(yaml.safe_dump({**{k: v for k, v in recipe.items() if k != "parallel"},
                                       "strategy": {"name": "ddp"}}, sort_keys=False))
    return planned_per_rank(replica, runtime=False) - planned_per_rank(path, runtime=False)


def logged_transformers_pipeline(tmp: Path, experiment: str):
    """The model `tracking.log_model` logged for the one run of `experiment` in tmp's SQLite store,
    downloaded from the store and loaded with MLflow's transformers flavour (a pipeline); fails on the
    run's `trainkit.log_model_error` tag."""
    import mlflow.artifacts
    import mlflow.transformers
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert "trainkit.log_model_error" not in run.data.tags, run.data.tags["trainkit.log_model_error"]
    local = mlflow.artifacts.download_artifacts(run_id=run.info.run_id, artifact_path="model", tracking_uri=uri,
                                                dst_path=str(tmp / "logged"))
    return mlflow.transformers.load_model(local)
