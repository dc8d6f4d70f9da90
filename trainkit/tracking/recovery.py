"""A torn tracking spool: where a crash cut it, what that lost, and what the run directory still
holds to send again, so `trainkit sync` never calls a run complete that is not.

A crash while appending leaves a record cut mid-line. Every record written after a cut at the end is
gone (at the end of a run: the launch's closing status, tags and artifacts), and a cut before what
was already delivered would make delivery skip whatever is appended next (`Spool.realign`). What can
honestly come back does: the metric points of metrics.jsonl (rank 0 writes every logged step there as
well) that the spool lacks, sent only for the (key, step) pairs the MLflow run has no value for, and
the run's files. A run the cut left open is closed from what the run directory proves, as for a dead
launch, with a reason that says the spool was torn. Each cut is kept in state.json (`tears`), so
every later `trainkit sync` reports it again.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Optional

from ..run_dir import METRICS, metrics_path
from .delivery import server_status
from .metric_names import mlflow_key
from .run import open_status, run_artifacts, verdict_tags
from .spool import Spool, note_tear

SPOOL_TORN = "trainkit.spool_torn"  # run tag: the byte where the spool was cut


def repair(run_dir: Path) -> list[dict[str, Any]]:
    """Make a torn spool deliverable again and spool what the run directory can give back; only with
    no live launch writing it (`trainkit sync` checks the lock). Returns the cuts found now."""
    spool = Spool(run_dir)
    with spool.delivery_lock() as mine:
        if not mine:  # another process is delivering: not ours to touch now
            return []
        state = spool.state()
        found = []
        end = spool.end_torn_tail()
        if end is not None:
            found.append({"at": end, "end": True})
        cut = spool.realign(state)
        if cut:
            found.append(cut)
        found += [{"at": at, "record": _op_of(rest)} for at, rest in spool.torn_lines(state.get("checked", 0))]
        for tear in found:
            note_tear(state, tear)
        if state.get("tears"):
            missing = _missing_points(run_dir, spool)
            if missing:
                spool.append([{"op": "recover", "source": METRICS, "points": missing}])
                state["missing"] = sorted(set(state.get("missing", [])) | {p[3] for p in missing})
        state["checked"] = spool.path.stat().st_size
        spool.save_state(state)
        return found


def close_left_open(run_dir: Path, launch_dir: Optional[Path], finished: bool) -> str:
    """Spool the end of a run a torn spool left RUNNING: the run's files, the status the run directory
    proves (FINISHED when `finished`: summary.json of the last launch, else KILLED) and a reason that
    says what happened. Returns the status; the caller delivers and confirms it (`closed`)."""
    spool = Spool(run_dir)
    state = spool.state()
    at = max(t["at"] for t in state["tears"])
    status = "FINISHED" if finished else "KILLED"
    reason = (f"tracking spool torn at byte {at} (a record cut mid-line: a crash while appending): what was "
              f"spooled after it is lost, the launch's closing status with it if it got that far; "
              + ("training completed (summary.json)" if finished else
                 "training did not complete (no summary.json of the last launch)"))
    if state.get("missing"):
        reason += (f"; the spool lacked steps {steps_text(state['missing'])}: what the run lacked of them "
                   f"came from {METRICS}")
    tags = {**(verdict_tags(run_dir) if finished else {}), "trainkit.status_reason": reason, SPOOL_TORN: str(at)}
    end = [{"op": "tags", "tags": tags}, {"op": "status", "status": status, "ts": int(time.time() * 1000)}]
    spool.append(run_artifacts(run_dir, launch_dir) + end)
    expect_status(run_dir, status, "the run was left open by a torn tracking spool")
    return status


def expect_status(run_dir: Path, status: str, why: str) -> None:
    """Remember that this sync spooled `status` (why), to be announced once the server holds it."""
    spool = Spool(run_dir)
    state = spool.state()
    state["closing"] = {"status": status, "why": why}
    spool.save_state(state)


def closed(run_dir: Path) -> Optional[tuple[str, str, Optional[str]]]:
    """(status spooled, why, status the server holds) for a status a sync spooled and has not yet
    announced; forgotten once the server holds it (None when there is none)."""
    spool = Spool(run_dir)
    state = spool.state()
    closing = state.get("closing")
    if not closing:
        return None
    seen = server_status(run_dir)
    reopened = open_status(run_dir) != closing["status"]  # a later launch continued the run: not ours to announce
    if seen == closing["status"] or reopened:
        state.pop("closing")
        spool.save_state(state)
    return None if reopened else (closing["status"], closing["why"], seen)


def report(run_dir: Path) -> tuple[list[str], bool]:
    """What the spool's cuts lost and what came back, one sentence a line; and whether records were
    lost (any cut: what the run directory gives back cannot be proven to be all of it)."""
    state = Spool(run_dir).state()
    tears = state.get("tears", [])
    lines = []
    for tear in tears:
        text = f"the tracking spool was torn at byte {tear['at']} (a record cut mid-line: a crash while appending)"
        if tear.get("before_delivered"):
            text += (f", {tear['before_delivered']} byte(s) before what was already delivered: delivery "
                     f"resumes after the cut")
        if tear.get("end"):
            text += "; whatever was spooled after it is lost"
        elif tear.get("record"):
            text += f"; one {tear['record']} record in it is lost"
        lines.append(text)
    missing = state.get("missing")
    if "recovered_points" in state:
        sent = state.get("recovered", [])
        lines.append(f"steps {steps_text(sent)} ({state['recovered_points']} metric point(s)) re-sent from "
                     f"{METRICS}" if sent else f"the run already held every point of {METRICS} the spool lacked")
    elif missing:
        lines.append(f"steps {steps_text(missing)} of {METRICS} are not in the spool: re-sent once the server "
                     f"is reachable (points the run already holds are skipped)")
    if any(t.get("end") for t in tears):
        lines.append("lost for good: the records spooled after the cut that the run directory does not hold "
                     "(a launch's closing status, reason and tags, model and checkpoint artifacts); the run's "
                     "files are re-sent from the run directory")
    return lines, bool(tears)


def steps_text(steps: list[int]) -> str:
    """[3, 5, 6, 7] -> '3, 5-7'."""
    out: list[list[int]] = []
    for step in sorted(steps):
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)


def _missing_points(run_dir: Path, spool: Spool) -> list[list]:
    """[key, value, ts, step] of every metric point metrics.jsonl holds and no spool record does."""
    path = metrics_path(run_dir)
    if not path.is_file():
        return []
    held = set()
    for r in spool.records():
        if r["op"] == "metric":
            held.add((r["key"], r["step"]))
        elif r["op"] == "recover":
            held.update((key, step) for key, _, _, step in r["points"])
    points = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            step, ts = int(row["step"]), int(float(row["time"]) * 1000)
        except (ValueError, KeyError, TypeError):
            continue  # a line torn by the same crash
        points += [[mlflow_key(key), float(value), ts, step] for key, value in row.items()
                   if key not in ("step", "time") and isinstance(value, (int, float)) and not isinstance(value, bool)
                   and (mlflow_key(key), step) not in held]
    return points


def _op_of(fragment: bytes) -> Optional[str]:
    """The kind of record a torn line was ('metric', 'artifact', ...), if its start survived."""
    match = re.search(rb'"op":"(\w+)"', fragment)
    return match.group(1).decode() if match else None
