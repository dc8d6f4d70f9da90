"""Turn torchelastic's ChildFailedError into a short report a person can act on, and announce
each restart as it happens (`RestartAnnouncer`).

torchrun prints only the last attempt's root cause, with full tracebacks. We print which rank failed
first, its exception (from the `error.json` its `@record`-decorated main wrote), and the last lines
of its log, plus where the full logs are.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Optional

from ..run_dir import RANK_ERROR, RANK_STDERR, RANK_STDOUT
from ..runtime.checkpoint_layout import disk_full_message, disk_too_full, failed_save

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
        for name in (RANK_STDERR, RANK_STDOUT):
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


def disk_full_note(ckpt_dir: Path) -> Optional[str]:
    """The checkpoint disk ran full, said from what a full disk leaves behind: the ranks' own report
    (error.json, their console log) lives on that disk too and may not have fit. Evidence: a save
    abandoned mid-way (`.tmp-step-...`) and less free space than a checkpoint takes."""
    abandoned = failed_save(ckpt_dir)
    if abandoned is None or not disk_too_full(ckpt_dir):
        return None
    return f"trainkit: {disk_full_message(ckpt_dir, abandoned)}"


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

    def __init__(self, log_dir: Path, resume_point, fatal_marker=lambda: None, max_restarts: int = 0,
                 hang=lambda: None):
        super().__init__(logging.INFO)
        self.hang, self.hang_announced = hang, None  # hang(): the launch's hang watch's latest declared hang
        self.log_dir, self.resume_point = log_dir, resume_point  # resume_point(): newest complete checkpoint
        # fatal_marker(): the run directory's fatal marker (a NaN, a full disk) or None. When a rank left
        # one and restarts remain, the agent is stopped instead of restarting: every restart would only
        # repeat the failure (and on a full disk spend the restarts one by one).
        self.fatal_marker, self.max_restarts = fatal_marker, max_restarts
        self.fatal: Optional[dict] = None
        self.workers: dict[int, dict] = {}  # pid -> START event metadata of the current attempt
        self.failed: Optional[tuple[int, int, int]] = None  # torch's first failure: (exitcode, local rank, pid)
        self.terminated: set[int] = set()  # pids the agent stopped (collateral, not culprits)
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
        stop = False
        try:
            if record.name == self.PROCESSES and str(record.msg).startswith("failed (exitcode"):
                exitcode, local_rank, pid = record.args[:3]
                self.failed = (int(exitcode), int(local_rank), int(pid))
                restarts_left = self.max_restarts - max(self.announced, default=0)
                if restarts_left > 0:
                    self.fatal = self.fatal_marker()
                    stop = self.fatal is not None
            elif record.name == self.PROCESSES and str(record.msg).startswith("Sending process"):
                self.terminated.add(int(record.args[0]))
            elif record.name == self.EVENTS:
                self._event(json.loads(record.getMessage()))
        except Exception:  # never let a report take the launcher down
            pass
        if stop:  # raised in the agent's own loop (its thread): it shuts the workers down, as on a signal
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException("a rank left the fatal marker: not restarting", sigval=signal.SIGTERM)

    def _event(self, event: dict) -> None:
        meta = event.get("metadata") or {}
        if not str(event.get("name", "")).endswith(".START") or event.get("source") != "WORKER":
            return
        attempt = int(meta.get("agent_restarts") or 0)
        pid = int(meta.get("worker_id") or 0)
        if attempt not in self.announced:
            if attempt > 0:
                print(self.announcement(attempt), file=sys.stderr, flush=True)
            self.announced.add(attempt)
            self.workers, self.failed, self.terminated = {}, None, set()
        self.workers[pid] = meta

    def _culprit(self, attempt: int) -> Optional[str]:
        """The rank that failed first, as `summarize` judges it: a rank whose error is only a peer's
        death ("Connection reset by peer") is not blamed while another failed on its own."""
        folder = _attempt_folder(self.log_dir, attempt - 1)
        found = []
        for pid, meta in self.workers.items():
            if pid in self.terminated:
                continue
            local_rank = json.loads(meta.get("metadata") or "{}").get("local_rank", [None])[0]
            rank_dir = folder / str(local_rank) if folder is not None and local_rank is not None else None
            error_file = rank_dir / RANK_ERROR if rank_dir is not None else None
            exitcode = self.failed[0] if self.failed and self.failed[2] == pid else None
            if error_file is not None and error_file.is_file():
                cause, _ = _exception(_Failure(exitcode or 1, str(error_file)))
            else:
                cause = _exception(_Failure(exitcode, ""))[0] if exitcode is not None else \
                    "exited without a Python exception (no error.json: os._exit, a crash or a signal)"
                tail = _tail(rank_dir / RANK_STDERR, 1) if rank_dir is not None else []
                cause += f"; last line of its log: {tail[0].strip()}" if tail else ""
            collateral = any(c in cause for c in COLLATERAL)
            first = self.failed is not None and self.failed[2] == pid
            found.append(((collateral, not first, local_rank if local_rank is not None else 0),
                          f"rank {meta.get('global_rank', local_rank)} (local rank {local_rank}, pid {pid}) on "
                          f"{meta.get('hostname') or 'this host'} failed: {cause}"))
        return min(found)[1] if found else None

    def announcement(self, attempt: int) -> str:
        hang = self.hang()
        if hang is not None and hang is not self.hang_announced:  # the watch ended the group: a peer's wait is no cause
            self.hang_announced = hang
            what = f"rank {hang.behind.number} hung at {hang.behind.where} ({hang.report})"
        else:
            what = self._culprit(attempt) or "a worker failed"
        checkpoint = self.resume_point()
        where = f"resumes from {checkpoint}" if checkpoint else "starts from scratch (no complete checkpoint yet)"
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
