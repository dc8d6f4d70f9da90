"""Turn torchelastic's ChildFailedError into a short report a person can act on, and announce
each restart as it happens (`RestartAnnouncer`).

torchrun prints only the last attempt's root cause, with full tracebacks. We print which rank failed
first, its exception (from the `error.json` its `@record`-decorated main wrote), and the last lines
of its log, plus where the full logs are.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

COLLATERAL = ("Connection closed by peer", "Connection reset", "Gloo", "NCCL", "Broken pipe", "timed out",
              "Timed out", "SIGTERM")


def _tail(path: Path, n: int = 12) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


def _exception(failure) -> tuple[str, list[str]]:
    """(one-line exception, traceback tail) from the failure's error.json, if it wrote one."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
        message = data["message"]
        if isinstance(message, dict):
            text = message.get("message", "")
            trace = message.get("extraInfo", {}).get("py_callstack", "")
        else:
            text, trace = str(message), ""
        return text.strip().splitlines()[-1] if text.strip() else "", trace.strip().splitlines()[-6:]
    except (OSError, ValueError, KeyError, TypeError):
        if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
            return f"killed by {failure.signal_name()}", []
        return f"exited with code {failure.exitcode} without a Python exception (e.g. os._exit or a crash)", []


def _rank_folder(log_dir: Path, local_rank: int):
    """LOG_DIR/<run id>_*/attempt_<last>/<local rank>/ of the newest launch (torchelastic's layout)."""
    launches = sorted((p for p in log_dir.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return None
    attempts = sorted(launches[-1].glob("attempt_*"), key=lambda p: int(p.name.split("_")[-1]))
    return attempts[-1] / str(local_rank) if attempts else None


def summarize(err, log_dir: Path, max_restarts: int) -> str:
    """The failure report printed when restarts are exhausted."""
    def order(item):
        rank, f = item
        text, _ = _exception(f)
        return (any(c in text for c in COLLATERAL), f.timestamp, rank)  # a peer-death error is a symptom

    rank, first = sorted(err.failures.items(), key=order)[0]
    text, trace = _exception(first)
    lines = [f"trainkit: training failed ({max_restarts} restart(s) allowed, all used): "
             f"rank {rank} (local rank {first.local_rank}, pid {first.pid}) failed first",
             f"  error: {text}"]
    folder = _rank_folder(log_dir, first.local_rank)
    log = None
    if folder is not None:
        for name in ("stderr.log", "stdout.log"):
            if (folder / name).is_file() and (folder / name).stat().st_size:
                log = folder / name
                break
    tail = _tail(log) if log else trace
    if tail:
        lines.append(f"  last lines of {log if log else 'its traceback'}:")
        lines += [f"    {line}" for line in tail]
    others = sorted(r for r in err.failures if r != rank)
    if others:
        lines.append(f"  also failed: rank(s) {', '.join(map(str, others))}")
    lines.append(f"  full logs: {log_dir}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- restarts, as they happen
class RestartAnnouncer(logging.Handler):
    """Says on the console, when torchrun restarts the worker group, which rank failed, on which
    host, why, and which checkpoint the new group resumes from.

    Why a logging handler on the agent (in this process) rather than polling the logs folder for a
    new attempt_N: only the agent knows a rank's exit code or signal (an `os._exit` or a SIGKILL
    leaves no error.json), and it already tells its loggers, in the launcher's main thread, in order:
      1. each worker's START event (torchelastic events, logger `torchelastic-events-<handler>`:
         JSON with global rank, hostname, pid and `agent_restarts`, the restarts used so far);
      2. on a failure, `failed (exitcode: %s) local_rank: %s (pid: %s)` for the first rank that
         failed (torch.distributed.elastic.multiprocessing.api), as structured log args;
      3. after a restart, the new workers' START events with agent_restarts >= 1: the cue to announce.
    If a later torch changes 2., the announcement still comes, without the rank's details.
    """

    EVENTS = "torchelastic-events-null"
    PROCESSES = "torch.distributed.elastic.multiprocessing.api"

    def __init__(self, log_dir: Path, resume_point):
        super().__init__(logging.INFO)
        self.log_dir, self.resume_point = log_dir, resume_point  # resume_point(): newest complete checkpoint
        self.workers: dict[int, dict] = {}  # pid -> START event metadata of the current attempt
        self.failed: Optional[tuple[int, int, int]] = None  # (exitcode, local rank, pid)
        self.announced: set[int] = set()

    def __enter__(self) -> "RestartAnnouncer":
        for name in (self.EVENTS, self.PROCESSES):
            logging.getLogger(name).addHandler(self)
        logging.getLogger(self.EVENTS).setLevel(logging.INFO)
        return self

    def __exit__(self, *exc) -> None:
        for name in (self.EVENTS, self.PROCESSES):
            logging.getLogger(name).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.name == self.PROCESSES and str(record.msg).startswith("failed (exitcode"):
                exitcode, local_rank, pid = record.args[:3]
                self.failed = (int(exitcode), int(local_rank), int(pid))
            elif record.name == self.EVENTS:
                self._event(json.loads(record.getMessage()))
        except Exception:  # never let a report take the launcher down
            pass

    def _event(self, event: dict) -> None:
        meta = event.get("metadata") or {}
        if not str(event.get("name", "")).endswith(".START") or event.get("source") != "WORKER":
            return
        attempt = int(meta.get("agent_restarts") or 0)
        pid = int(meta.get("worker_id") or 0)
        if attempt == 0 or attempt in self.announced:
            self.workers[pid] = meta
            return
        self.announced.add(attempt)
        print(self.announcement(attempt, meta), file=sys.stderr, flush=True)
        self.workers = {pid: meta}

    def announcement(self, attempt: int, now: dict) -> str:
        host = now.get("hostname") or "this host"
        what = "a worker failed"
        if self.failed is not None:
            exitcode, local_rank, pid = self.failed
            before = self.workers.get(pid, {})
            rank = before.get("global_rank", local_rank)
            host = before.get("hostname") or host
            folder = _attempt_folder(self.log_dir, attempt - 1)
            error_file = str(folder / str(local_rank) / "error.json") if folder else ""
            cause, _ = _exception(_Failure(exitcode, error_file))
            what = f"rank {rank} (local rank {local_rank}, pid {pid}) on {host} failed: {cause}"
        checkpoint = self.resume_point()
        where = f"resumes from {checkpoint}" if checkpoint else "starts from scratch (no complete checkpoint yet)"
        self.failed = None
        return f"trainkit: restart {attempt}: {what}; the worker group restarts and {where}"


class _Failure:
    """The two facts `_exception` needs from torch's ProcessFailure."""

    def __init__(self, exitcode: int, error_file: str):
        self.exitcode, self.error_file = exitcode, error_file

    def signal_name(self) -> str:
        import signal

        try:
            return signal.Signals(-self.exitcode).name if self.exitcode < 0 else "<N/A>"
        except ValueError:
            return "<N/A>"


def _attempt_folder(log_dir: Path, attempt: int) -> Optional[Path]:
    launches = sorted((p for p in log_dir.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return None
    folder = launches[-1] / f"attempt_{attempt}"
    return folder if folder.is_dir() else None
