"""Deliver spooled records to MLflow, in order, exactly once.

Batched (`log_batch`: up to 1000 metric points or 100 params/tags per call) and off the training
thread (`BackgroundDelivery`). A call that fails may or may not have reached the server; the next
attempt then drops the points the run already has, so a flaky server never duplicates a point.
"""

from __future__ import annotations

import os
import threading
from functools import lru_cache
import time
from pathlib import Path
from typing import Any, Optional

from ..recipe.secrets import mask_uri_credentials
from . import credentials
from .spool import Spool, note_tear
from .store import embedded_uri

# Fail fast instead of MLflow's default minutes of retries: the spool keeps what fails.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

MAX_METRICS, MAX_PARAMS_TAGS = 1000, 100


def default_uri(recipe_file: Optional[Path] = None) -> str:
    """MLFLOW_TRACKING_URI (its credentials in use: credentials.py), else the project's embedded SQLite
    store (store.py: the repository holding the recipe, or the current folder)."""
    return credentials.from_environment() or embedded_uri(recipe_file)


def artifact_root_for(uri: str) -> Optional[str]:
    """A local SQLite store keeps artifacts beside the database, wherever the job was started."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri[len("sqlite:///"):]).parent / "mlartifacts")
    return None


@lru_cache(maxsize=8)
def client_for(uri: str):
    """One client per store per process: building a SQLite store checks its schema (~100 ms)."""
    import logging

    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # store creation chatter is not for the training console
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


# The experiment's kind, as MLflow's own UI sets it when a user picks one (the UI's ExperimentKind enum;
# no Python constant). MLflow 3.17's UI does not read it to choose the view (a per-browser switch or the
# link's workflowType does: browse.ui_link); it is kept for MLflow versions and tools that do.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def ensure_experiment(client, name: str, uri: str) -> str:
    """The experiment's id, created with the model-training kind; an existing experiment without a
    kind gets it (one chosen by its owner is left alone)."""
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            try:
                client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            except Exception:  # read-only permissions on a shared experiment: not worth failing a run
                pass
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root_for(uri),
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
    except Exception:
        exp = client.get_experiment_by_name(name)  # another process created it meanwhile
        if exp is None:
            raise
        return exp.experiment_id


def deliver(run_dir: Path) -> tuple[int, Optional[str]]:
    """Send what is pending. Returns (records still pending, error text or None)."""
    spool = Spool(run_dir)
    with spool.delivery_lock() as mine:
        if not mine:
            return spool.pending_count(), None  # another process is delivering right now
        state = spool.state()
        cut = spool.realign(state)  # the spool was cut before what was delivered: resume after the cut
        if cut:
            note_tear(state, cut)
            spool.save_state(state)
        records, ends = spool.pending(state)
        if not records:
            return 0, None
        uri = state.get("uri") or next((r["uri"] for r in spool.records() if r["op"] == "create"), default_uri())
        # the environment's credentials only if they belong to this server (a spool written before
        # credentials were split off brings its own)
        uri = credentials.use(uri)
        try:
            client = client_for(uri)
        except Exception as exc:  # pragma: no cover - bad URI scheme
            return len(records), mask_uri_credentials(f"{type(exc).__name__}: {exc}")
        i = 0
        while i < len(records):
            n = _chunk_length(records, i)
            try:
                _send(client, uri, state, records[i:i + n])
            except Exception as exc:
                state["uncertain"] = True
                spool.save_state(state)
                return len(records) - i, mask_uri_credentials(
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            state["delivered"] = state.get("delivered", 0) + n
            state["offset"] = ends[i + n - 1]
            state["uncertain"] = False
            i += n
            spool.save_state(state)
        return 0, None


def _chunk_length(records: list[dict], i: int) -> int:
    """How many consecutive records of the same kind go in one call."""
    op = records[i]["op"]
    if op == "metric":
        n = 1
        while i + n < len(records) and records[i + n]["op"] == "metric" and n < MAX_METRICS:
            n += 1
        return n
    if op in ("params", "tags"):
        n, entries = 1, len(records[i][op])
        while i + n < len(records) and records[i + n]["op"] in ("params", "tags") \
                and entries + len(records[i + n][records[i + n]["op"]]) <= MAX_PARAMS_TAGS:
            entries += len(records[i + n][records[i + n]["op"]])
            n += 1
        return n
    return 1


def _send(client, uri: str, state: dict, chunk: list[dict[str, Any]]) -> None:
    from mlflow.entities import Metric, Param, RunTag

    op = chunk[0]["op"]
    if op == "torn":
        return
    if op == "create":
        if not state.get("run_id"):
            r = chunk[0]
            exp_id = ensure_experiment(client, r["experiment"], uri)
            key = r.get("key")
            found = []
            if key and (state.get("uncertain") or r.get("join")):  # created server-side already (an earlier
                found = find_run(client, exp_id, key, bool(r.get("join")))  # attempt, or another node of the same job)
            if found:
                run = found[0]
            else:
                tags = dict(r.get("tags") or {}, **({"trainkit.run_key": key} if key else {}))
                run = client.create_run(exp_id, run_name=r["run_name"], tags=tags, start_time=r.get("ts"))
            state.update(run_id=run.info.run_id, experiment_id=exp_id, uri=uri)
        return
    run_id = state["run_id"]
    if op == "rewind":
        state["run_id"] = _supersede(client, run_id, chunk[0], uncertain=bool(state.get("uncertain")))
        state["continues"] = {"run_id": run_id, "step": int(chunk[0]["step"])}  # for the run's description
        return
    if op == "metric":
        points = [Metric(r["key"], float(r["value"]), int(r["ts"]), int(r["step"])) for r in chunk]
        if state.get("uncertain"):
            points = _not_yet_logged(client, run_id, points)
        if points:
            client.log_batch(run_id, metrics=points, synchronous=True)
    elif op in ("params", "tags"):
        params = [Param(k, v) for r in chunk if r["op"] == "params" for k, v in r["params"].items()]
        tags = [RunTag(k, v) for r in chunk if r["op"] == "tags" for k, v in r["tags"].items()]
        client.log_batch(run_id, params=params, tags=tags, synchronous=True)
    elif op == "artifact":
        path = Path(chunk[0]["path"])
        if path.is_dir():
            client.log_artifacts(run_id, str(path), chunk[0].get("dir"))
        elif path.is_file():
            client.log_artifact(run_id, str(path), chunk[0].get("dir"))
    elif op == "recover":  # points a torn spool lost, read back from metrics.jsonl: the steps the run lacks
        points = [Metric(k, float(v), int(ts), int(s)) for k, v, ts, s in chunk[0]["points"]]
        sent = _missing_steps(client, run_id, points)
        for i in range(0, len(sent), MAX_METRICS):
            client.log_batch(run_id, metrics=sent[i:i + MAX_METRICS], synchronous=True)
        state["recovered"] = sorted(set(state.get("recovered", [])) | {p.step for p in sent})
        state["recovered_points"] = state.get("recovered_points", 0) + len(sent)
    elif op == "link":  # a tag naming another spooled run (a tune trial's parent): known once that one exists
        client.set_tag(run_id, chunk[0]["tag"], _linked_run_id(Path(chunk[0]["run_dir"])))
    elif op == "status":
        if chunk[0]["status"] == "RUNNING":
            client.update_run(run_id, status="RUNNING")
        else:
            client.set_terminated(run_id, chunk[0]["status"], end_time=chunk[0].get("ts"))


class LinkPending(Exception):
    """The run a `link` record names is not in MLflow yet; the record waits in the spool."""


def _linked_run_id(run_dir: Path) -> str:
    """The MLflow id of the run spooled in `run_dir`, delivering that spool first if it has none yet,
    so a child is never linked to a parent that does not exist (and waits for it instead)."""
    linked = Spool(run_dir).state().get("run_id")
    if not linked:
        deliver(run_dir)
        linked = Spool(run_dir).state().get("run_id")
    if not linked:
        raise LinkPending(f"the run spooled in {run_dir} is not in MLflow yet (`trainkit sync {run_dir}`)")
    return linked


def find_run(client, exp_id: str, key: str, join: bool) -> list:
    """The run with this key; for a job's nodes (`join`) only a RUNNING one (a later node waited for
    the first node's before it spooled its creation: tracking.run.open_run)."""
    query = f"tags.`trainkit.run_key` = '{key}'" + (" and attributes.status = 'RUNNING'" if join else "")
    return client.search_runs([exp_id], filter_string=query)


NOTE_TAG = "mlflow.note.content"  # the run's description on its MLflow page (markdown)
NOT_COPIED_TAGS = ("mlflow.runName", NOTE_TAG, "trainkit.run_key", "trainkit.superseded_by",
                   "trainkit.status_reason", "trainkit.previous_run")


def _supersede(client, old_id: str, record: dict, uncertain: bool) -> str:
    """A rewind: open the run that continues the job, holding the old run's params, tags and one
    value per (key, step) up to the resumed step; end the old run KILLED, linked both ways. Every
    part is idempotent (found by its key, points filtered), so a retry after a failure is safe."""
    from mlflow.entities import Metric, Param, RunTag

    step, key = int(record["step"]), record["key"]
    old = client.get_run(old_id)
    found = []
    if uncertain:
        found = client.search_runs([old.info.experiment_id], filter_string=f"tags.`trainkit.run_key` = '{key}'")
    tags = {k: v for k, v in old.data.tags.items() if k not in NOT_COPIED_TAGS}
    tags.update({"trainkit.run_key": key, "trainkit.previous_run": old_id, "trainkit.resumed_at_step": str(step)})
    new = found[0] if found else client.create_run(old.info.experiment_id, run_name=old.info.run_name, tags=tags,
                                                   start_time=record.get("ts"))
    new_id = new.info.run_id
    params = [Param(k, v) for k, v in (record.get("params") or old.data.params).items()]
    for i in range(0, len(params), MAX_PARAMS_TAGS):
        client.log_batch(new_id, params=params[i:i + MAX_PARAMS_TAGS], synchronous=True)
    points = []
    for name in old.data.metrics:
        last: dict[int, Any] = {}
        for m in client.get_metric_history(old_id, name):
            if m.step <= step:
                last[m.step] = m  # the history is in logging order: the newest value of a step wins
        points += [Metric(name, m.value, m.timestamp, m.step) for _, m in sorted(last.items())]
    if found:
        points = _not_yet_logged(client, new_id, points)
    for i in range(0, len(points), MAX_METRICS):
        client.log_batch(new_id, metrics=points[i:i + MAX_METRICS], synchronous=True)
    why = record.get("reason") or f"training resumed from step {step}, before points this run already holds"
    # the link where the UI shows it: each run's description (mlflow.note.content) names the other
    client.log_batch(new_id, tags=[RunTag(NOTE_TAG, (
        f"Continues run {old_id} ({old.info.run_name}) from step {step}: {why}. That run holds the attempt "
        f"before and ended KILLED, superseded by this one; its points up to step {step} are copied here.")[:5000])],
        synchronous=True)
    client.log_batch(old_id, tags=[RunTag("trainkit.superseded_by", new_id),
                                   RunTag("trainkit.status_reason", f"superseded by run {new_id}: {why}"[:5000]),
                                   RunTag(NOTE_TAG, (
                                       f"Superseded by run {new_id}, which continues this job from step {step}: "
                                       f"{why}. Look there for the whole curve.")[:5000])],
                     synchronous=True)
    client.set_terminated(old_id, "KILLED", end_time=record.get("ts"))
    return new_id


def _missing_steps(client, run_id: str, points: list) -> list:
    """The points whose (key, step) the run holds no value for: one value per (key, step), whatever
    the timestamp of a point re-sent from another record of it."""
    held = {key: {m.step for m in client.get_metric_history(run_id, key)} for key in {p.key for p in points}}
    return [p for p in points if p.step not in held[p.key]]


def server_status(run_dir: Path) -> Optional[str]:
    """The status the tracking server holds for the spool's run (None: no run yet, or unreachable)."""
    state = Spool(run_dir).state()
    if not state.get("run_id"):
        return None
    try:
        return client_for(credentials.use(state["uri"])).get_run(state["run_id"]).info.status
    except Exception:
        return None


def _not_yet_logged(client, run_id: str, points: list) -> list:
    seen: dict[str, set] = {}
    for key in {p.key for p in points}:
        seen[key] = {(m.step, m.timestamp, m.value) for m in client.get_metric_history(run_id, key)}
    return [p for p in points if (p.step, p.timestamp, p.value) not in seen[p.key]]


class BackgroundDelivery:
    """A daemon thread that delivers the spool every `interval` seconds (and when kicked)."""

    def __init__(self, run_dir: Path, interval: float = 5.0, announce: bool = False):
        self.run_dir, self.interval, self.announce = Path(run_dir), interval, announce
        self.last_error: Optional[str] = None
        self._announced_run = Spool(self.run_dir).state().get("run_id")  # the launcher printed it at start
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="trainkit-mlflow", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        announced_error = False
        while not self._stop.is_set():
            try:
                pending, self.last_error = deliver(self.run_dir)
            except Exception as exc:  # never let tracking take the launcher down; the spool keeps all
                pending, self.last_error = Spool(self.run_dir).pending_count(), f"{type(exc).__name__}: {exc}"
            if self.announce:
                self._announce_run()
                if self.last_error and not announced_error:
                    print(f"trainkit: tracking: server unreachable ({self.last_error}); training goes on, "
                          f"{pending} record(s) kept in {Spool(self.run_dir).path} until it is back", flush=True)
                    announced_error = True
                elif not self.last_error and announced_error:
                    print("trainkit: tracking: server reachable again; spooled records delivered", flush=True)
                    announced_error = False
            self._wake.wait(self.interval)
            self._wake.clear()

    def _announce_run(self) -> None:
        """Say when the run is created, and when the job moves on to a run that continues it (a rewind)."""
        state = Spool(self.run_dir).state()
        run_id = state.get("run_id")
        if run_id and not self._announced_run:
            print(f"trainkit: tracking: run {run_id} created in {state.get('uri')}", flush=True)
        elif run_id and run_id != self._announced_run:
            print(f"trainkit: tracking: run {run_id} continues run {self._announced_run} (which ends KILLED, "
                  f"superseded: a resume rewound steps it already held; each run's description names the "
                  f"other)", flush=True)
        self._announced_run = run_id or self._announced_run

    def close(self, timeout: float = 10.0) -> int:
        """Stop the thread after one last attempt; returns the records still pending."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        pending, self.last_error = deliver(self.run_dir)
        while pending and self.last_error is None and time.monotonic() < deadline:
            time.sleep(0.2)  # the thread was mid-delivery; wait for it
            pending, self.last_error = deliver(self.run_dir)
        if self.announce:
            self._announce_run()
        return pending
