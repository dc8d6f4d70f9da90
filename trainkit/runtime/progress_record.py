"""Where each rank is in training (step and phase), kept in RUN_DIR/live/progress-rank<R>.json for the
launcher's hang watch (`trainkit.launch.hang_watch`), and its Python stacks on request.

Why a file rewritten in place: the launcher must see that no rank makes progress without asking the
ranks anything (a hung rank cannot answer) and without a device sync or a collective on the hot path.
Each phase change (data, forward, backward, optimizer, eval, checkpoint) is one `pwrite` of a
fixed-size record to a file opened once: a few microseconds, no fsync.

Stacks: `faulthandler` dumps every thread's Python stack into RUN_DIR/live/stacks-rank<R>.txt on
SIGUSR1, from its C signal handler, so a rank blocked inside a collective (no GIL, no Python
running) still answers. A rank stopped by SIGSTOP cannot: the hang report says so. Its DataLoader
workers (other processes) each dump into RUN_DIR/live/stacks-rank<R>-loader-<pid>.txt
(`loader_worker_started`, from the loader's worker_init_fn), so a rank waiting for its data shows
where its worker is stuck.

Collectives: torch's Flight Recorder on every process group, served on a socket for the launcher
(`trainkit.runtime.flight_recorder`), started with the record.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Optional

from ..run_dir import loader_stacks_path, rank_progress_path, rank_stacks_path
from . import flight_recorder

RECORD_BYTES = 256
STACKS_SIGNAL = signal.SIGUSR1
PHASES = ("data", "forward", "backward", "optimizer", "eval", "checkpoint")  # in the order a step runs them
END = "end"  # the loop is over: the summary, reports and shutdown are not watched
FAILED = "failed"  # the rank is leaving on an exception: its exit is the launcher's failure report, not a hang
STOPPING = "stopping"  # a SIGTERM/SIGINT: the rank finishes a background checkpoint write (bounded) and leaves


class _Record:
    def __init__(self, run_dir: Path, rank: int):
        path = rank_progress_path(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.run_dir, self.rank, self.pid = run_dir, rank, os.getpid()
        # the JSON record, formatted without json.dumps on the hot path (phase names are plain words)
        self.template = (f'{{"rank": {rank}, "pid": {self.pid}, "host": {json.dumps(socket.gethostname())}, '
                         f'"step": %d, "phase": "%s", "at": %.3f, "slowest_step_s": %.4f}}')
        self.step, self.step_started, self.slowest_step_s = 0, time.monotonic(), 0.0
        self.stacks = open(rank_stacks_path(run_dir, rank), "w")  # kept open: faulthandler writes to its fd
        faulthandler.register(STACKS_SIGNAL, file=self.stacks, all_threads=True, chain=False)

    def phase(self, step: int, name: str) -> None:
        now = time.monotonic()
        if step != self.step:  # a new step: the previous one's duration sizes the default hang timeout
            if self.step:
                self.slowest_step_s = max(self.slowest_step_s, now - self.step_started)
            self.step, self.step_started = step, now
        data = (self.template % (step, name, time.time(), self.slowest_step_s)).encode()[:RECORD_BYTES]
        try:
            os.pwrite(self.fd, data + b" " * (RECORD_BYTES - len(data)), 0)  # JSON then spaces: one JSON value
        except OSError:  # a full disk: the hang watch is the lesser loss
            pass


_record: Optional[_Record] = None


def start(run_dir: Path, rank: int) -> None:
    """Begin this rank's record, answer SIGUSR1 with its stacks, and record its collectives."""
    global _record
    _record = _Record(run_dir, rank)
    flight_recorder.start(rank)


def loader_worker_started() -> None:
    """In a DataLoader worker of a recording rank: answer SIGUSR1 with this worker's stacks in its own
    file (the fork inherited the rank's handler, which would write into the rank's file)."""
    if _record is None:
        return
    _remove_dead_loader_files(_record.run_dir, _record.rank)  # each epoch and evaluation starts new workers
    stacks = open(loader_stacks_path(_record.run_dir, _record.rank, os.getpid()), "w")
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=False)
    _record.loader_stacks = stacks  # kept open for faulthandler's fd


def _remove_dead_loader_files(run_dir: Path, rank: int) -> None:
    """The stacks files of this rank's earlier, finished loader workers (one per worker per epoch and
    per evaluation otherwise piles up in live/)."""
    pattern = loader_stacks_path(run_dir, rank, "*")
    for path in pattern.parent.glob(pattern.name):
        try:
            os.kill(int(path.stem.rsplit("-", 1)[1]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, OSError):
            pass


def phase(step: int, name: str) -> None:
    """This rank is now in `name` (one of PHASES) of optimizer step `step`; nothing when not started."""
    if _record is not None:
        _record.phase(step, name)


def failed() -> None:
    """This rank is leaving on an exception (its error file written, the process group and the
    interpreter shutting down: seconds on a loaded machine): not a hang."""
    if _record is not None:
        _record.phase(_record.step, FAILED)


def stopping() -> None:
    """This rank was asked to stop and is finishing (a checkpoint write gets a bounded wait): not a hang."""
    if _record is not None:
        _record.phase(_record.step, STOPPING)


def watch_backward(model) -> None:
    """Mark the backward phase when the training forward returns (the strategy runs forward and
    backward in one call): a forward hook, no sync."""
    def forward_done(module, args, output):
        if module.training and _record is not None:
            _record.phase(_record.step, "backward")

    model.register_forward_hook(forward_done)


def read(path: Path) -> Optional[dict]:
    """A rank's record, or None when it is missing or being rewritten."""
    try:
        found = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None
