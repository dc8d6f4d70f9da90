"""The launcher's progress watchdog: when no rank of this node makes progress for
`launch.hang_timeout_s`, declare a hang before the collective timeout fires, write
RUN_DIR/reports/hang.md (where each rank is, the rank that is behind, every rank's stacks) and end
the workers so torchrun counts it as a failure (restarts apply).

Why in the launcher, from files: a hung rank cannot report itself, and the others are blocked in a
collective. Each rank rewrites its step and phase in place (`trainkit.runtime.progress_record`);
this thread reads those records, and on a hang asks each rank for its stacks with SIGUSR1
(faulthandler answers from its C signal handler). A SIGSTOPped rank cannot answer: its
/proc/<pid>/status State (T) and wchan are what the report shows. A rank waiting for its data
(phase data) is shown with its DataLoader workers' stacks (they answer SIGUSR1 too, into their own
files: `progress_record.loader_worker_started`). The same hang twice (the rank
behind at the same step and phase) leaves the fatal marker: restarts stop, as for a NaN.

Collectives: each rank records every process group's collectives in torch's Flight Recorder and
serves it on a socket in a directory private to this watch; on a hang each live rank's record is
fetched (a C++ thread answers while the rank is blocked in a collective) and torch's analysis of
them goes into the report (`flight_recorder_dumps`), on every backend.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..run_dir import (HANG, LIVE, NCCL_TRACE, RANK_PROGRESS, loader_stacks_path, rank_stacks_path, report_path,
                       write_fatal)
from ..runtime.progress_record import END, FAILED, PHASES, STACKS_SIGNAL, STOPPING, read
from . import flight_recorder_dumps, nccl_blame

POLL_S = 0.5
STACKS_WAIT_S = 3.0  # how long the ranks get to dump their stacks
STEP_MULTIPLE = 10  # the default timeout: this many times the slowest step seen ...
FLOOR_S = 120.0  # ... and at least this (or half the collective timeout, when that is shorter)
TORCH_PACKAGE = os.sep + "torch" + os.sep
LOADER_WORKER_LOOP = os.path.join("torch", "utils", "data", "_utils", "worker.py")  # a loader worker's main
DATA = "data"  # the phase of a rank waiting for its next batch
HANG_TAG = "trainkit.hang"


class HangDeclared(RuntimeError):
    """The same hang happened twice: a restart would repeat it (the fatal marker's message)."""


def default_timeout(timeout_s: float, slowest_step_s: float) -> float:
    """launch.hang_timeout_s: null — long enough for real GPU steps, short of the collective timeout."""
    return max(min(FLOOR_S, timeout_s / 2), STEP_MULTIPLE * slowest_step_s)


@dataclass
class Rank:
    """One rank's record at the hang, and what the launcher could learn about its process."""

    record: dict
    state: str = "?"
    wchan: str = ""
    stacks: str = ""
    innermost: str = ""  # the main thread's innermost frame
    loader_stacks: dict = field(default_factory=dict)  # its DataLoader workers' stacks, by pid

    @property
    def number(self) -> int:
        return int(self.record["rank"])

    @property
    def stopped(self) -> bool:
        return self.state.startswith(("T", "t"))

    @property
    def where(self) -> str:
        return f"step {self.record['step']}, {self.record['phase']}"

    def progress(self) -> tuple:
        phase = self.record.get("phase")
        return int(self.record.get("step", 0)), PHASES.index(phase) if phase in PHASES else len(PHASES)

    def waits_in_torch(self) -> bool:
        return TORCH_PACKAGE in self.innermost

    def waits_for_data(self) -> str:
        """Why, when this rank is in phase data: its loader worker's innermost frame, or ''."""
        if self.record.get("phase") != DATA:
            return ""
        frames = [_innermost_frame(stacks, LOADER_WORKER_LOOP) for stacks in self.loader_stacks.values()]
        stuck = next((f.strip() for f in frames if f and TORCH_PACKAGE not in f), "")
        return "it waits for its data loader" + (f": a loader worker is in {stuck}" if stuck else "")


@dataclass
class Hang:
    """A declared hang: the rank that is behind, every rank, and the report's summary line."""

    ranks: list[Rank]
    behind: Rank
    why_behind: str
    silent_s: float
    timeout_s: float
    repeated: bool = False
    report: Optional[Path] = None
    collectives: list[str] = field(default_factory=list)  # the Flight Recorder analysis's verdict lines

    def key(self) -> tuple:
        return self.behind.number, self.behind.record["step"], self.behind.record["phase"]

    def summary(self) -> str:
        return (f"hang: no rank made progress for {self.silent_s:.0f} s (launch.hang_timeout_s "
                f"{self.timeout_s:g}); rank {self.behind.number} is behind at {self.behind.where} "
                f"({self.why_behind})")

    def failure_report(self, max_restarts: int) -> str:
        others = ", ".join(f"rank {r.number} at {r.where}" for r in self.ranks if r is not self.behind)
        return "\n".join([
            f"trainkit: training failed ({max_restarts} restart(s) allowed, all used): rank {self.behind.number} "
            f"(pid {self.behind.record['pid']}) hung at {self.behind.where}",
            f"  {self.summary()}",
            *([f"  waiting for it: {others}"] if others else []),
            *[f"  Flight Recorder: {line}" for line in self.collectives],
            f"  report with every rank's stacks: {self.report}"])


@dataclass
class HangWatch:
    """Started by the launcher around torchrun's agent; `hang` is set once one is declared."""

    run_dir: Path
    timeout_s: Optional[float]  # launch.hang_timeout_s (None: `default_timeout`)
    collective_timeout_s: float
    backend: str = "gloo"  # the workers' (a label in the Flight Recorder analysis)
    hang: Optional[Hang] = None
    previous: Optional[tuple] = None
    started: float = field(default_factory=time.time)
    ended: set = field(default_factory=set)  # pids of the ranks this watch ended
    stop_event: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> "HangWatch":
        self.sockets = flight_recorder_dumps.sockets_directory()  # the workers' Flight Recorder sockets
        self.saved_env = {k: os.environ.get(k) for k in flight_recorder_dumps.workers_env(self.sockets)}
        os.environ.update(flight_recorder_dumps.workers_env(self.sockets))
        self.thread = threading.Thread(target=self._watch, name="trainkit-hang-watch", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        self.thread.join(timeout=STACKS_WAIT_S + flight_recorder_dumps.ANALYSIS_TIMEOUT_S + 5)
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        flight_recorder_dumps.remove(self.sockets)

    def hang_of(self, pids: set) -> Optional[Hang]:
        """The declared hang that ended these workers (torchrun's failed pids), if one did."""
        if self.hang is not None and pids & {r.record["pid"] for r in self.hang.ranks}:
            return self.hang
        return None

    # ------------------------------------------------------------------ watching
    def _records(self) -> list[dict]:
        found = []
        for path in (self.run_dir / LIVE).glob(RANK_PROGRESS.format(rank="*")):
            try:
                if path.stat().st_mtime < self.started:  # an earlier launch's record
                    continue
            except OSError:
                continue
            record = read(path)
            if not record or record.get("host") != socket.gethostname():  # another node's rank: its launcher's
                continue
            if record.get("phase") in (END, FAILED, STOPPING):  # past its loop, leaving on an exception or a stop
                continue
            if record.get("pid") not in self.ended and _alive(int(record.get("pid", 0))):
                found.append(record)
        return sorted(found, key=lambda r: r["rank"])

    def _watch(self) -> None:
        last_seen, changed_at = None, time.monotonic()
        while not self.stop_event.wait(POLL_S):
            try:
                records = self._records()
                seen = tuple((r["rank"], r["pid"], r["step"], r["phase"], r["at"]) for r in records)
                now = time.monotonic()
                if seen != last_seen:
                    last_seen, changed_at = seen, now
                    continue
                slowest = max(((r.get("slowest_step_s") or 0.0) for r in records), default=0.0)
                if self.timeout_s is None and not slowest:
                    continue  # the default needs a timed step (a first step may compile or autotune for long)
                limit = self.timeout_s or default_timeout(self.collective_timeout_s, slowest)
                if records and now - changed_at >= limit:
                    self._declare(records, now - changed_at, limit)
                    last_seen, changed_at = None, time.monotonic()
            except Exception as exc:  # the watch must never take the launch down
                print(f"trainkit: warning: hang watch: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ declaring
    def _declare(self, records: list[dict], silent_s: float, timeout_s: float) -> None:
        ranks = [Rank(record) for record in records]
        for rank in ranks:
            rank.state, rank.wchan = _process_state(int(rank.record["pid"]))
            rank_stacks_path(self.run_dir, rank.number).write_text("")  # this hang's stacks only
        workers = {rank.number: _loader_workers(self.run_dir, rank) for rank in ranks if not rank.stopped}
        for rank in ranks:
            if not rank.stopped:
                _signal(int(rank.record["pid"]), STACKS_SIGNAL)
                for pid in workers[rank.number]:
                    _signal(pid, STACKS_SIGNAL)
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and not all(_stacks(self.run_dir, r) for r in ranks if not r.stopped):
            time.sleep(0.1)
        time.sleep(0.2)  # let the last dump finish
        for rank in ranks:
            rank.stacks = "" if rank.stopped else _stacks(self.run_dir, rank)
            rank.innermost = _innermost_frame(rank.stacks)
            rank.loader_stacks = {pid: _read(path) for pid, path in workers.get(rank.number, {}).items()}
        section, collectives, natives = self._flight_recorder(ranks)
        behind, why = _behind(ranks, nccl_blame.blame(natives) if natives else None)
        if behind.waits_for_data():
            why = f"{why}; {behind.waits_for_data()}"
        hang = Hang(ranks, behind, why, silent_s, timeout_s)
        hang.repeated = hang.key() == self.previous
        self.previous = hang.key()
        hang.collectives = collectives
        hang.report = _write_report(self.run_dir, hang, section)
        print("\n".join([f"trainkit: {hang.summary()}; report: {hang.report}",
                         *[f"trainkit: Flight Recorder: {line}" for line in hang.collectives]]),
              file=sys.stderr, flush=True)
        if hang.repeated:  # stops torchrun's restarts (launch.failures.RestartAnnouncer reads the marker)
            write_fatal(self.run_dir, HangError(f"{hang.summary()}, the same hang as the previous attempt "
                                                f"(report: {hang.report})"))
        self.hang = hang
        for rank in ranks:  # SIGKILL: a stopped rank does not act on SIGTERM; checkpoints are written atomically
            self.ended.add(rank.record["pid"])
            _signal(int(rank.record["pid"]), signal.SIGKILL)


    def _flight_recorder(self, ranks: list[Rank]) -> tuple[list[str], list[str], dict]:
        """hang.md's Flight Recorder section, the analysis's verdict lines, and the backend's own
        records by rank (NCCL's; {} elsewhere). A failure there must not cost the rest of the report."""
        try:
            dumps = flight_recorder_dumps.collect(self.run_dir, self.sockets, {
                r.number: f"its process is stopped (State {r.state})" if r.stopped else "" for r in ranks}, self.backend)
            analysis = flight_recorder_dumps.analyse(dumps)
            return (flight_recorder_dumps.report_lines(dumps, analysis, self.run_dir),
                    flight_recorder_dumps.verdicts(analysis), dumps.native_records)
        except Exception as exc:
            return ["", "## Flight Recorder", "", f"Not collected: {type(exc).__name__}: {exc}"], [], {}


class HangError(RuntimeError):
    """The fatal marker's error name for a repeated hang."""


def _behind(ranks: list[Rank], nccl: Optional[nccl_blame.Blame] = None) -> tuple[Rank, str]:
    """The rank the others wait for: a stopped process; else, under NCCL, the rank its Flight Recorder
    record names (`nccl_blame`: there the host runs ahead of the GPU, so stacks and progress mislead);
    else the least progress; else, among ranks at the same step and phase, the one running its own
    code while the others wait inside torch."""
    stopped = [r for r in ranks if r.stopped]
    if stopped:
        return stopped[0], f"its process is stopped: State {stopped[0].state}"
    named = [r for r in ranks if nccl is not None and r.number == nccl.rank]
    if named:
        return named[0], nccl.why
    if nccl is not None:  # every rank inside the collective: no rank is behind, the collective hangs
        return min(ranks, key=lambda r: r.progress()), nccl.why
    least = min(r.progress() for r in ranks)
    candidates = [r for r in ranks if r.progress() == least]
    if len(candidates) < len(ranks):
        return candidates[0], "the least progress of all ranks"
    own_code = [r for r in candidates if r.innermost and not r.waits_in_torch()]
    if own_code and len(own_code) < len(candidates):
        return own_code[0], f"it runs its own code ({own_code[0].innermost.strip()}) while the others wait inside torch"
    return candidates[0], "every rank is at the same place: the stacks below tell which one is stuck"


def _write_report(run_dir: Path, hang: Hang, flight_recorder: list[str]) -> Path:
    lines = [f"# Hang: rank {hang.behind.number} is behind at {hang.behind.where}", "",
             f"trainkit: {hang.summary()}.", "",
             "| rank | pid | step | phase | process | main thread's innermost frame |", "|---|---|---|---|---|---|"]
    for r in hang.ranks:
        process = f"{r.state}" + (f", wchan {r.wchan}" if r.wchan else "")
        frame = r.innermost.strip() or ("cannot answer: its process is stopped" if r.stopped else "no stacks")
        lines.append(f"| {r.number} | {r.record['pid']} | {r.record['step']} | {r.record['phase']} | {process} | "
                     f"{frame.replace('|', '/')} |")
    if hang.repeated:
        lines += ["", "The same hang as the previous attempt: not restarting."]
    lines += flight_recorder
    for r in hang.ranks:
        lines += ["", f"## Rank {r.number} (pid {r.record['pid']}): {r.where}", ""]
        if r.stopped:
            lines.append(f"No stacks: the process is stopped (State {r.state}; e.g. SIGSTOP, a debugger) and "
                         f"cannot answer SIGUSR1.")
        else:
            lines += ["```", r.stacks.rstrip() or "(no answer to SIGUSR1 within the wait)", "```"]
        for pid, stacks in r.loader_stacks.items():
            lines += ["", f"### Rank {r.number}'s DataLoader worker (pid {pid})", "",
                      "```", stacks.rstrip() or "(no answer to SIGUSR1 within the wait)", "```"]
    path = report_path(run_dir, HANG)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def flight_recorder_env(run_dir: Path, environ, backend: str) -> dict:
    """torch's Flight Recorder for the workers (torchtitan's docs/debugging.md): a ring of the last
    2000 records, on every backend (the hang watch reads it). Under NCCL also its own dump when a
    collective times out, into RUN_DIR/reports/nccl-trace-rank<R> (analyse the dumps with `python -m
    torch.distributed.flight_recorder.fr_trace`), and a start event per collective
    (TORCH_NCCL_ENABLE_TIMING): without it NCCL's record never says a collective `started` on a GPU,
    which `nccl_blame` needs to tell a busy GPU from a hanging collective. A value already in the
    environment wins."""
    wanted = {"TORCH_FR_BUFFER_SIZE": "2000"}
    if "nccl" in backend.split(",")[0]:
        report_path(run_dir, "").mkdir(parents=True, exist_ok=True)
        wanted.update({"TORCH_NCCL_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_ENABLE_TIMING": "1",
                       "TORCH_FR_DUMP_TEMP_FILE": str(report_path(run_dir, NCCL_TRACE))})
    return {k: v for k, v in wanted.items() if k not in environ}


def tags(run_dir: Path, since: float) -> dict:
    """The MLflow tag of a hang this launch declared (its report's summary line), else {}."""
    path = report_path(run_dir, HANG)
    try:
        if path.stat().st_mtime < since:
            return {}
        line = next(line for line in path.read_text().splitlines() if line.startswith("trainkit: hang"))
    except (OSError, StopIteration):
        return {}
    return {HANG_TAG: line.removeprefix("trainkit: ").rstrip(".")}


# --------------------------------------------------------------------------- processes
def _alive(pid: int) -> bool:
    return pid > 0 and os.path.exists(f"/proc/{pid}") and _process_state(pid)[0][:1] not in ("Z", "X", "?")


def _process_state(pid: int) -> tuple[str, str]:
    """(State line of /proc/<pid>/status, e.g. 'T (stopped)', and its wchan), or ('?', '')."""
    try:
        state = next(line.split(":", 1)[1].strip() for line in open(f"/proc/{pid}/status")
                     if line.startswith("State:"))
    except (OSError, StopIteration):
        return "?", ""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return state, "" if wchan == "0" else wchan


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _stacks(run_dir: Path, rank: Rank) -> str:
    return _read(rank_stacks_path(run_dir, rank.number))


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _loader_workers(run_dir: Path, rank: Rank) -> dict[int, Path]:
    """The rank's live DataLoader workers that answer SIGUSR1 (each made its stacks file), by pid."""
    found = {}
    for path in loader_stacks_path(run_dir, rank.number, "*").parent.glob(
            loader_stacks_path(run_dir, rank.number, "*").name):
        pid = int(path.stem.rsplit("-", 1)[1])
        if _alive(pid) and _parent(pid) == int(rank.record["pid"]):
            found[pid] = path
    return found


def _parent(pid: int) -> int:
    try:  # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _innermost_frame(stacks: str, main: str = "trainkit" + os.sep + "runtime" + os.sep + "worker.py") -> str:
    """The first frame of the thread whose stack holds `main` (faulthandler's dump): by default the
    thread that runs the worker's main."""
    for block in stacks.split("\n\n"):
        frames = [line for line in block.splitlines() if line.strip().startswith("File ")]
        if any(main in f for f in frames):
            return frames[0]
    return ""
