"""`trainkit runs`, `trainkit compare`, `trainkit ui`: reading runs back from the MLflow store."""

from __future__ import annotations

import datetime as dt
import functools
import sys
from pathlib import Path
from typing import Optional, Sequence

from . import credentials
from .delivery import client_for, default_uri
from .metric_names import mlflow_key

SUMMARY_METRICS = ("loss", "eval_loss", "eval_accuracy", "samples_per_s", "step_time_s")
LOWER_IS_BETTER = ("loss", "eval_loss", "step_time_s")

# MLflow 3.x picks the GenAI or the model-training view from the browser's own switch (stored in
# its localStorage), defaulting to GenAI; the experiment's `mlflow.experimentKind` tag is not read.
# A link carrying this query opens the training view.
TRAINING_VIEW = "workflowType=machine_learning"


def ui_link(ui_url: str, route: str = "/experiments") -> str:
    """A link into the MLflow UI that opens in the model-training view."""
    return f"{ui_url}/#{route}{'&' if '?' in route else '?'}{TRAINING_VIEW}"


class TrackingError(LookupError):
    """The store cannot be read, or a run is not in it: a message for the user, not a traceback."""


def _client(uri: str):
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise TrackingError(f"no MLflow store at {uri[len('sqlite:///'):]} (`trainkit run` creates it; "
                            "or pass --uri / set MLFLOW_TRACKING_URI)")
    return client_for(uri)


def _store_errors(fn):
    """Unreachable servers and broken stores become one-line TrackingErrors."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LookupError:
            raise
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise TrackingError(f"cannot read the tracking store: {type(exc).__name__}: {first}") from None
    return wrapped


def _fmt_time(ms: Optional[int]) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M") if ms else "-"


def _duration(run) -> str:
    if not run.info.end_time:
        return "-"
    return f"{(run.info.end_time - run.info.start_time) / 1000:.0f}s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _all_experiment_ids(client) -> list[str]:
    return [e.experiment_id for e in client.search_experiments()]


def chain(client, run, known: Optional[dict] = None) -> list[str]:
    """The earlier attempts a job's run continues (newest first), from `trainkit.previous_run` tags:
    a rewind or accepted recipe change continues a job in a new run (docs/tracking.md)."""
    known, out, seen = known or {}, [], {run.info.run_id}
    previous = run.data.tags.get("trainkit.previous_run")
    while previous and previous not in seen and len(out) < 50:
        out.append(previous)
        seen.add(previous)
        try:
            earlier = known.get(previous) or client.get_run(previous)
        except Exception:  # deleted, or in a store we cannot read: the chain ends here
            break
        previous = earlier.data.tags.get("trainkit.previous_run")
    return out


def _attempts(client, run, known: dict) -> str:
    later = run.data.tags.get("trainkit.superseded_by")
    if later:
        return f"superseded by {later[:8]}"
    earlier = chain(client, run, known)
    return ("continues " + " <- ".join(r[:8] for r in earlier)) if earlier else "-"


@_store_errors
def list_runs(uri: Optional[str] = None, experiment: Optional[str] = None, limit: int = 20,
              include_superseded: bool = False) -> str:
    """The newest runs; a job that continued in a new run shows its current run with the chain of
    earlier attempts (superseded runs are listed too with `include_superseded`)."""
    uri = credentials.use(uri) if uri else default_uri()
    client = _client(uri)
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return f"no experiment named '{experiment}' in {uri}"
        ids = [exp.experiment_id]
    else:
        ids = _all_experiment_ids(client)
    runs = client.search_runs(ids, max_results=limit, order_by=["attributes.start_time DESC"]) if ids else []
    known = {r.info.run_id: r for r in runs}
    hidden = [r for r in runs if "trainkit.superseded_by" in r.data.tags and not include_superseded]
    runs = [r for r in runs if r not in hidden]
    if not runs:
        return f"no runs in {uri}"
    rows = [["run id", "name", "status", "started", "wall", "strategy", "final loss", "samples/s", "attempts"]]
    for r in runs:
        loss, rate = r.data.metrics.get(mlflow_key("loss")), r.data.metrics.get(mlflow_key("samples_per_s"))
        rows.append([r.info.run_id[:12], r.info.run_name or "", r.info.status, _fmt_time(r.info.start_time),
                     _duration(r), r.data.tags.get("strategy", "-"), "-" if loss is None else f"{loss:.4f}",
                     "-" if rate is None else f"{rate:.1f}", _attempts(client, r, known)])
    note = f"\n({len(hidden)} superseded attempt(s) hidden: --all shows them)" if hidden else ""
    return f"{uri}\n" + _table(rows) + note


def _find_run(client, ids: list[str], prefix: str):
    for run in client.search_runs(ids, max_results=5000):
        if run.info.run_id.startswith(prefix) or run.info.run_name == prefix:
            return run
    raise TrackingError(f"no run matches '{prefix}'")


# the verdict and step-time breakdown tags a run gets at its end (tracking.run.verdict_tags)
BREAKDOWN_TAGS = (("step ms", "trainkit.step_ms", "ms"), ("data wait", "trainkit.data_wait_share", "%"),
                  ("forward ms", "trainkit.forward_ms", "ms"), ("backward ms", "trainkit.backward_ms", "ms"),
                  ("optimizer ms", "trainkit.optimizer_ms", "ms"),
                  ("exposed comm", "trainkit.comm_exposed_share", "%"), ("GPU busy", "trainkit.gpu_busy_percent", "pct"),
                  ("wall: train", "trainkit.time.train_share", "%"), ("wall: eval", "trainkit.time.eval_share", "%"),
                  ("wall: checkpoint", "trainkit.time.checkpoint_share", "%"),
                  ("wall: logging", "trainkit.time.logging_share", "%"),
                  ("wall: start-up", "trainkit.time.startup_share", "%"),
                  ("wall: shutdown", "trainkit.time.shutdown_share", "%"))


def _tag_value(text: Optional[str], unit: str) -> str:
    if text is None:
        return "-"
    try:
        value = float(text)
    except ValueError:
        return text
    return f"{value:.0%}" if unit == "%" else f"{value:.0f}%" if unit == "pct" else f"{value:.1f}"


def verdict_rows(runs) -> list[list[str]]:
    """Bottleneck verdict, top advice and step-time breakdown of each run, side by side."""
    if not any("trainkit.bottleneck" in r.data.tags for r in runs):
        return []
    rows = [["bottleneck", *[r.data.tags.get("trainkit.bottleneck", "-") for r in runs]],
            ["top advice", *[(r.data.tags.get("trainkit.advice.1", "-")[:60]) for r in runs]]]
    for label, tag, unit in BREAKDOWN_TAGS:
        if any(tag in r.data.tags for r in runs):
            rows.append([label, *[_tag_value(r.data.tags.get(tag), unit) for r in runs]])
    return rows


@_store_errors
def compare(run_refs: Sequence[str], uri: Optional[str] = None, ui_url: str = "http://127.0.0.1:5000") -> str:
    """Side by side: params that differ, the bottleneck verdicts and step-time breakdowns, final and best
    metrics, throughput, wall time."""
    uri = credentials.use(uri) if uri else default_uri()
    client = _client(uri)
    ids = _all_experiment_ids(client)
    runs = [_find_run(client, ids, ref) for ref in run_refs]
    header = ["", *[f"{r.info.run_name} ({r.info.run_id[:8]})" for r in runs]]
    rows = [header, ["status", *[r.info.status for r in runs]], ["wall", *[_duration(r) for r in runs]],
            ["attempts", *[_attempts(client, r, {}) for r in runs]]]
    keys = sorted(set().union(*(r.data.params for r in runs)))
    differing = [k for k in keys if len({r.data.params.get(k) for r in runs}) > 1]
    for k in differing:
        rows.append([k, *[r.data.params.get(k, "-") for r in runs]])
    rows += verdict_rows(runs)
    metric_keys = [k for k in SUMMARY_METRICS if any(mlflow_key(k) in r.data.metrics for r in runs)]
    for k in metric_keys:
        key = mlflow_key(k)
        rows.append([f"{k} (final)", *[f"{r.data.metrics[key]:.4g}" if key in r.data.metrics else "-" for r in runs]])
        best = []
        for r in runs:
            hist = client.get_metric_history(r.info.run_id, key) if key in r.data.metrics else []
            vals = [m.value for m in hist]
            best.append(f"{(min(vals) if k in LOWER_IS_BETTER else max(vals)):.4g}" if vals else "-")
        rows.append([f"{k} (best)", *best])
    experiments = list(dict.fromkeys(r.info.experiment_id for r in runs))  # the UI finds runs only in these
    link = ui_link(ui_url, f"/compare-runs?runs=[{','.join(repr(r.info.run_id) for r in runs)}]"
                           f"&experiments=[{','.join(repr(e) for e in experiments)}]")
    note = "" if differing else "\n(no params differ)"
    return _table(rows) + note + f"\n\nMLflow UI (start it with `trainkit ui`): {link.replace(chr(39), chr(34))}"


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def ui(uri: Optional[str] = None, host: str = "127.0.0.1", port: int = 5000) -> int:
    """The MLflow UI, on loopback unless `host` says otherwise (it has no authentication)."""
    from .ui_server import bind_problem, serve

    uri = credentials.use(uri) if uri else default_uri()
    problem = bind_problem(host, port)  # before starting: a URL on a port another process serves shows its store
    if problem:
        print(f"trainkit: {problem}", file=sys.stderr, flush=True)
        return 1
    if host not in LOOPBACK_HOSTS:
        print(f"trainkit: warning: the MLflow UI has no authentication: binding {host} lets anyone who can "
              f"reach this machine on port {port} read every run and artifact (default: 127.0.0.1)",
              file=sys.stderr, flush=True)
    # one uvicorn worker: a UI for one person answers in a quarter of the time 4 workers take to start on 2 cores
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port),
           "--workers", "1"]
    local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # where this machine reaches it
    local = f"[{local}]" if ":" in local else local
    return serve(cmd, f"http://{local}:{port}/health",
                 f"MLflow UI for {uri}: {ui_link(f'http://{host}:{port}')}  (Ctrl-C to stop)")
