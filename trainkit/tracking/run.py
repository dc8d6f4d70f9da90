"""One MLflow run per job: opened by the launcher, fed by rank 0, closed by the launcher.

The launcher spools the run's creation, params and tags and delivers them before any worker starts
(which also creates a fresh SQLite store once, before several processes could race on it). Rank 0
spools metric points (`MlflowSink`); the launcher alone sets the final status. After an elastic
restart or a `resume: auto` launch, the same run continues (its id lives in RUN_DIR/tracking) —
unless training rewinds past points the run already holds: then a new run takes over the job, with
the history up to the resumed step copied in and `trainkit.previous_run` / `trainkit.superseded_by`
tags linking the two (see `MlflowSink.rewind` and delivery's `rewind`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Sequence

from .. import __version__
from ..recipe import flat
from ..run_dir import (BOTTLENECK, COMMAND, ENVIRONMENT, FAILURE, PROFILER, RECIPE, REPORTS, RESOLVED_RECIPE, VERDICT,
                       report_path, summary_path)
from . import credentials
from .delivery import NOTE_TAG, default_uri, deliver, find_run
from .metric_names import mlflow_key
from .spool import Spool

MAX_PARAM = 6000  # MLflow's limit on a param value
MAX_NOTE = 8000  # MLflow's limit on a tag value


def _now_ms() -> int:
    return int(time.time() * 1000)


def flatten(data: Any) -> dict[str, str]:
    """Resolved recipe -> MLflow params under stable dotted keys (`trainer.checkpoint.every`)."""
    return {key: _param_text(value) for key, value in flat.flatten(data).items()}


def _param_text(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    if len(text) > MAX_PARAM:  # kept, visibly cut; the whole recipe is an artifact
        suffix = " ...[truncated: see recipe.yaml artifact]"
        text = text[: MAX_PARAM - len(suffix)] + suffix
    return text


def _git_commit(folder: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_tags(recipe, environment: dict) -> dict[str, str]:
    tags = {
        "trainkit.version": __version__, "strategy": recipe.strategy.name, "precision": recipe.precision,
        "world_size": str(recipe.world_size), "nodes": str(recipe.launch.nnodes),
        "hostname": socket.gethostname(), "platform": platform.platform(),
        "torch": str(environment.get("torch")), "cuda": str(environment.get("cuda")),
        "gpu": ", ".join(environment.get("gpus") or []) or "none",
        "mlflow.source.name": "trainkit run", "mlflow.source.type": "JOB",
    }
    for extra in ("nccl", "deepspeed", "torchvision"):
        if environment.get(extra):
            tags[extra] = str(environment[extra])
    commit = _git_commit(os.getcwd())
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def tracking_uri(recipe, recipe_file: Optional[Path] = None) -> str:
    """Where the recipe's runs go: its `tracking.uri` (the environment holding only its credentials), else
    MLFLOW_TRACKING_URI or the embedded SQLite store of the project holding `recipe_file`."""
    return credentials.use(recipe.tracking.uri) if recipe.tracking.uri else default_uri(recipe_file)


def store_of(run_dir: Path) -> Optional[str]:
    """The store the run in RUN_DIR was created in (what its spool recorded), or None."""
    spool = Spool(run_dir)
    return spool.state().get("uri") or next((r["uri"] for r in spool.records() if r["op"] == "create"), None)


def open_run(resolved, run_dir: Path, launch_dir: Path, environment: dict, job: Optional[str] = None,
             wait_s: float = 0.0) -> Optional[str]:
    """Spool the run's creation (first launch) or its continuation and deliver it now, so the store
    and the run exist before any worker starts (and MLflow's one-off import and schema work do not
    compete with training). Workers only ever append to the spool.

    `job`: the scheduler job this launch belongs to (a PyTorchJob, a SLURM job). Each node's launcher
    then joins the one RUNNING run of that job (found by a key derived from it), so nodes without a
    shared run directory still make one run; `wait_s`: how long a non-first node waits for the first
    node to create it before creating it itself.

    Returns a one-line description of where tracking goes, or None when tracking is disabled.
    """
    recipe = resolved.recipe
    if not recipe.tracking.enabled:
        return None
    spool = Spool(run_dir)
    uri = tracking_uri(recipe, Path(resolved.files[0]))
    experiment = resolved.redact_text(recipe.tracking.experiment)
    key = hashlib.sha256(f"{job}\n{experiment}\n{recipe.name}".encode()).hexdigest()[:32] if job else uuid.uuid4().hex
    if job and wait_s > 0:
        _wait_for_the_first_node(spool, uri, experiment, key, wait_s)
    create = [{"op": "create", "uri": uri, "experiment": experiment, "key": key,
               **({"join": True} if job else {}),
               "run_name": resolved.redact_text(recipe.tracking.run_name or recipe.name), "ts": _now_ms(),
               "tags": run_tags(recipe, environment)},
              {"op": "params", "params": flatten(resolved.redacted())}]
    first = spool.append_unless_created(create)
    if not first:  # a later launch (resume: auto) or another node's launcher: the same run continues
        spool.append([{"op": "status", "status": "RUNNING", "ts": _now_ms()},
                      {"op": "tags", "tags": {"trainkit.last_launch": launch_dir.name}}])
    pending, error = deliver(run_dir)  # creates the store and the run now, before any worker runs
    state = spool.state()
    where = f"MLflow {state.get('uri', uri)}, experiment '{experiment}'" + credentials.withheld_note(uri)
    if state.get("run_id"):
        where += f", run {state['run_id']}" + ("" if first else " (continued)")
    if error:
        where += f" (unreachable now: {error}; {pending} record(s) kept in {spool.path}, delivered later)"
    return where


def _wait_for_the_first_node(spool: Spool, uri: str, experiment: str, key: str, wait_s: float) -> None:
    """A later node of a job waits (up to `wait_s`) until the first node's run exists: in MLflow (nodes
    with their own run directories), or as delivered from this spool (a run directory the nodes
    share). The wait holds no lock of the spool: a node that waited inside the delivery of a shared
    spool kept the first node from delivering the run it waited for (a 2-node job started a minute
    late whenever the later node reached the spool first)."""
    from .delivery import client_for

    deadline = time.monotonic() + wait_s
    client = None
    while time.monotonic() < deadline:
        if spool.state().get("run_id"):
            return
        try:
            client = client or client_for(credentials.use(uri))
            exp = client.get_experiment_by_name(experiment)
            if exp is not None and find_run(client, exp.experiment_id, key, join=True):
                return
        except Exception:  # the server not up yet: keep waiting, delivery reports what stays wrong
            pass
        time.sleep(1.0)


# --------------------------------------------------------------------------- runs that group other runs
def open_parent_run(run_dir: Path, resolved, run_name: str, tags: dict, params: dict) -> tuple[int, Optional[str]]:
    """Spool and deliver a run that is not a training run but groups some (`trainkit tune`'s), in the
    recipe's store and experiment; returns deliver()'s (pending, error): with the server down, it waits
    in RUN_DIR's spool like a training run's records."""
    Spool(run_dir).append([
        {"op": "create", "uri": tracking_uri(resolved.recipe, Path(resolved.files[0])), "key": uuid.uuid4().hex,
         "run_name": run_name,
         "experiment": resolved.redact_text(resolved.recipe.tracking.experiment), "ts": _now_ms(), "tags": tags},
        {"op": "params", "params": params}])
    return deliver(run_dir)


def link_to_parent(run_dir: Path, parent_dir: Path, tags: dict, metrics: dict[str, float]) -> None:
    """Spool, for the run in RUN_DIR, `mlflow.parentRunId` naming the run spooled in PARENT_DIR (sent
    only once that one exists in MLflow, see delivery's `link`), plus tags and step-0 metrics."""
    Spool(run_dir).append([{"op": "link", "tag": "mlflow.parentRunId", "run_dir": str(parent_dir)},
                           {"op": "tags", "tags": tags}] +
                          [{"op": "metric", "key": k, "value": float(v), "ts": _now_ms(), "step": 0}
                           for k, v in metrics.items()])


def close_parent_run(run_dir: Path, status: str, metrics: dict[str, float], tags: dict,
                     artifacts: Sequence[Path] = ()) -> None:
    """Spool the end of an open_parent_run run (the caller delivers)."""
    Spool(run_dir).append([{"op": "metric", "key": k, "value": float(v), "ts": _now_ms(), "step": 0}
                           for k, v in metrics.items()] +
                          ([{"op": "tags", "tags": tags}] if tags else []) +
                          [{"op": "artifact", "path": str(p)} for p in artifacts] +
                          [{"op": "status", "status": status, "ts": _now_ms()}])


def continue_in_new_run(run_dir: Path, step: int, recipe_data: dict, reason: Optional[str]) -> None:
    """Accepted recipe changes: params are immutable in MLflow, so the job continues in a new run with
    the new params and this run's history up to `step` (a rewind that always happens)."""
    Spool(run_dir).append([{"op": "rewind", "step": int(step), "key": uuid.uuid4().hex, "ts": _now_ms(),
                            "params": flatten(recipe_data), "reason": f"recipe changed: {reason}"}])


def verdict_tags(run_dir: Path) -> dict[str, str]:
    """The bottleneck verdict, its top advice and the step-time breakdown as run tags
    (`trainkit.bottleneck`, `trainkit.advice.1`, `trainkit.step_ms`, ...), from reports/verdict.json:
    tags, unlike artifacts, can be filtered and sorted on in the MLflow UI and `search_runs`. Plus the
    verdict and all its advice as the run's description (`mlflow.note.content`, markdown on the run
    page): among ~25 tags the verdict was hard to find and the UI cut its advice."""
    try:
        verdict = json.loads(report_path(run_dir, VERDICT).read_text())
        tags = {str(k): str(v) for k, v in verdict.get("tags", {}).items()}
    except (OSError, ValueError, AttributeError):
        return {}
    continues = Spool(run_dir).state().get("continues")
    return {**tags, NOTE_TAG: verdict_note(verdict, continues)} if verdict.get("kind") else tags


def verdict_note(verdict: dict, continues: Optional[dict] = None) -> str:
    """The run description: the verdict first, then each piece of advice, whole (the run page shows
    the first lines and 'Show more'); the report's tables and evidence are the reports/ artifacts.
    A run that continues another after a rewind says so first (the link stays visible where the
    rewind's delivery put it)."""
    advice = [str(a) for a in verdict.get("advice") or []]
    lines = [f"Continues run {continues['run_id']} from step {continues['step']} (that attempt ended KILLED, "
             f"superseded by this run).", ""] if continues else []
    lines += [f"**Bottleneck: {verdict['kind']}**: {verdict.get('headline', '')}", ""]
    lines += [f"{i}. {a}" for i, a in enumerate(advice, 1)] if advice else ["No change advised."]
    lines += ["", f"The whole report, with the step-time breakdown and its evidence: `{REPORTS}/{BOTTLENECK}` "
                  "in Artifacts (`trainkit report RUN_DIR` prints it)."]
    note = "\n".join(lines)
    if len(note) > MAX_NOTE:  # kept, visibly cut; the whole report is an artifact
        suffix = f" ...[cut: see {REPORTS}/{BOTTLENECK}]"
        note = note[: MAX_NOTE - len(suffix)] + suffix
    return note


def run_artifacts(run_dir: Path, launch_dir: Optional[Path]) -> list[dict[str, Any]]:
    """The artifact records of the files a run directory and its launch's folder hold at the end."""
    files = [(run_dir / RECIPE, None), (run_dir / RESOLVED_RECIPE, None), (summary_path(run_dir), None),
             (run_dir / REPORTS, "reports"), (run_dir / PROFILER, "profiler")]
    if launch_dir is not None:
        files += [(launch_dir / name, f"launches/{launch_dir.name}") for name in (COMMAND, ENVIRONMENT, FAILURE)]
    return [{"op": "artifact", "path": str(p), "dir": d} for p, d in files if p.exists()]


def close_run(run_dir: Path, launch_dir: Path, status: str, reason: str,
              extra_artifacts: Sequence[tuple[Path, Optional[str]]] = (), extra_tags: Optional[dict] = None,
              timeout: float = 30.0) -> str:
    """Spool the artifacts and the final status, deliver, and say what happened.

    `extra_artifacts` (path, artifact folder) come from the training side: the newest checkpoint
    and the saved MLflow model (`tracking.log_checkpoints` / `log_model`), so tracking never needs
    to rebuild a model itself."""
    spool = Spool(run_dir)
    if not spool.records():
        return ""
    records = run_artifacts(run_dir, launch_dir)
    records += [{"op": "artifact", "path": str(p), "dir": d} for p, d in extra_artifacts if Path(p).exists()]
    tags = {**verdict_tags(run_dir), **(extra_tags or {}), "trainkit.status_reason": reason[:5000]}
    records.append({"op": "tags", "tags": tags})
    records.append({"op": "status", "status": status, "ts": _now_ms()})
    spool.append(records)
    deadline = time.monotonic() + timeout
    pending, error = deliver(run_dir)
    while pending and time.monotonic() < deadline:
        time.sleep(1.0)
        pending, error = deliver(run_dir)
    state = spool.state()
    if pending:
        return (f"tracking: {pending} record(s) not yet delivered ({error}); they are kept in {spool.path}: "
                f"run `trainkit sync {run_dir}` when the server is back")
    return f"tracking: run {state.get('run_id')} {status} in {state.get('uri')}"


class MlflowSink:
    """Rank 0's metric sink: one fsynced append to the spool per logged step, nothing more.

    Delivery happens in the launcher process (`BackgroundDelivery`), so MLflow's imports, SQL
    and HTTP never take the training process's GIL or time.
    """

    def __init__(self, run_dir: Path):
        self.spool = Spool(run_dir)

    def log(self, metrics: dict, step: int) -> None:
        ts = _now_ms()
        self.spool.append([{"op": "metric", "key": mlflow_key(k), "value": float(v), "ts": ts, "step": int(step)}
                           for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)],
                          durable=False)

    def rewind(self, step: int) -> None:
        """Training continues from `step`: if the run already holds points after it (a restart or a
        resume from an older checkpoint), spool a rewind, which delivery turns into a new MLflow run
        holding this run's history up to `step` (MLflow cannot delete points; one value per step)."""
        self.spool.append_rewind(step, {"op": "rewind", "step": int(step), "key": uuid.uuid4().hex, "ts": _now_ms()})

    def close(self) -> None:
        pass




# --------------------------------------------------------------------------- a launch that died
DEAD_LAUNCH = "launcher died without closing the run"


def open_status(run_dir: Path) -> Optional[str]:
    """The run's status as the spool leaves it: None without a run; RUNNING when the last status
    change is a (re)opening — the launch that opened it never closed it."""
    status = None
    for record in Spool(run_dir).records():
        if record["op"] == "create":
            status = "RUNNING"
        elif record["op"] == "status":
            status = record["status"]
    return status


def close_dead_launch_run(run_dir: Path, launch_dir: Optional[Path], finished: bool) -> Optional[str]:
    """Spool the end of the MLflow run of a launch that died without closing it (SIGKILL, OOM killer,
    power loss): FINISHED when the run directory proves it completed (`finished`: summary.json written
    by that launch), else KILLED with the reason. Only spools the records; the caller delivers.
    Returns the status set, or None when the run was not left open."""
    if open_status(run_dir) != "RUNNING":
        return None
    status = "FINISHED" if finished else "KILLED"
    reason = ("completed; " if finished else "") + DEAD_LAUNCH
    records = [{"op": "artifact", "path": str(p), "dir": d} for p, d in (
        (summary_path(run_dir), None), (run_dir / REPORTS, "reports"),
    ) if finished and p.exists()]
    tags = {**(verdict_tags(run_dir) if finished else {}), "trainkit.status_reason": reason}
    if launch_dir is not None:
        tags["trainkit.dead_launch"] = launch_dir.name
    records += [{"op": "tags", "tags": tags}, {"op": "status", "status": status, "ts": _now_ms()}]
    Spool(run_dir).append(records)
    return status
