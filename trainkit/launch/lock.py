"""One launch per run directory: RUN_DIR/launch.lock, taken before anything is written there.

The lock is a small JSON file naming its holder: host, pid, the process's start time, the boot
time of its machine, when it was taken, a heartbeat (refreshed every HEARTBEAT_S by a daemon
thread) and the launch's job identity. It works across processes and across nodes that share the
folder, because it relies only on atomic file operations: the first holder creates it with
os.link of a complete temporary file (fails if it exists, never shows a half-written lock), a
takeover replaces it with os.rename under a short-lived `launch.lock.break` guard (created with
O_CREAT|O_EXCL) so two launches cannot both take over the same stale lock.

A lock is stale — taken over with a warning — when
  - its holder ran on this host and that process is gone: the pid is dead, or now belongs to a
    process started at another time (pids are reused, in containers quickly), or the machine was
    rebooted since. A holder that is alive is never stale, even when its heartbeat is old (a launcher
    stopped with Ctrl-Z: its workers may still train, and it may be resumed); or
  - its heartbeat is older than STALE_AFTER_S (the only test possible for a holder on another node).
A launch's workers stop on their own when its heartbeat is older than 3 beats (runtime/parent_watch.py),
so by the time another node may take over (six missed beats) no worker of the old launch still trains.

Job identity (`job_identity`): launches that belong to the same scheduler job are one launch.
A single-node job has one launcher, so a same-job holder found alive is a previous incarnation
(SLURM --requeue, a PyTorchJob OnFailure restart): the new launcher takes the lock over at once.
A multi-node job has one launcher per node: the first node to arrive holds the lock, the others
*join* it (they run, and adopt the lock if its holder goes stale while they still run).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..run_dir import LOCK, LOCK_HEARTBEAT_S

LOCK_NAME = LOCK
HEARTBEAT_S = LOCK_HEARTBEAT_S
STALE_AFTER_S = 60.0  # six missed heartbeats: a frozen NFS client or a stopped (SIGSTOP) launcher


class LockHeld(Exception):
    """Another live launch of a different job holds the run directory."""

    def __init__(self, path: Path, holder: dict):
        self.path, self.holder = path, holder
        super().__init__(describe(holder))


def job_identity(nnodes, rdzv_id: Optional[str], rdzv_endpoint: Optional[str]) -> Optional[str]:
    """Who this launch belongs to, from the scheduler's environment; None for a plain launch.

    TRAINKIT_JOB_ID (set it yourself, e.g. from a Kubernetes label through the downward API) wins,
    then SLURM_JOB_ID (plus the array task), then JOBSET_NAME (Kubeflow TrainJob / JobSet pods),
    then, for a multi-node launch, the rendezvous id and endpoint every node was started with."""
    env = os.environ
    if env.get("TRAINKIT_JOB_ID"):
        return f"job:{env['TRAINKIT_JOB_ID']}"
    if env.get("SLURM_JOB_ID"):
        array = env.get("SLURM_ARRAY_TASK_ID")
        return f"slurm:{env['SLURM_JOB_ID']}" + (f"_{array}" if array else "")
    if env.get("JOBSET_NAME"):
        return f"k8s:{env['JOBSET_NAME']}"
    if str(nnodes) not in ("1", "1:1") and rdzv_endpoint:
        return f"rdzv:{rdzv_id}@{rdzv_endpoint}"
    return None


def _start_time(pid: int) -> Optional[float]:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _boot_time() -> float:
    import psutil

    return psutil.boot_time()


def me(job: Optional[str]) -> dict:
    now = time.time()
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
            "boot_time": _boot_time(), "since": now, "heartbeat": now, "job": job, "launch": uuid.uuid4().hex,
            "argv": " ".join(sys.argv)[:500]}


def describe(holder: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    beat = max(0, int(time.time() - holder.get("heartbeat", 0)))
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, since {since} (heartbeat {beat} s ago)"
            + (f", job {holder['job']}" if holder.get("job") else "") + _stopped_note(holder))


def _stopped_note(holder: dict) -> str:
    """Say so when the holder is a stopped process on this host (Ctrl-Z / SIGSTOP): it holds the run
    directory until it is resumed or ended."""
    import psutil

    if holder.get("host") != socket.gethostname():
        return ""
    try:
        if psutil.Process(int(holder.get("pid", -1))).status() == psutil.STATUS_STOPPED:
            pid = holder.get("pid")
            return f"; it is stopped (Ctrl-Z / SIGSTOP): resume it (kill -CONT {pid}) or end it (kill {pid})"
    except (psutil.Error, ValueError, TypeError):
        pass
    return ""


def stale_reason(holder: dict) -> Optional[str]:
    """Why this holder can no longer be running, or None if it may be."""
    age = time.time() - float(holder.get("heartbeat", 0))
    if holder.get("host") == socket.gethostname():
        if holder.get("boot_time") and abs(float(holder["boot_time"]) - _boot_time()) > 2.0:
            return "its machine was rebooted since"
        started = _start_time(int(holder.get("pid", -1)))
        if started is None:
            return f"process {holder.get('pid')} is gone"
        if holder.get("start_time") is None or abs(started - float(holder["start_time"])) > 1.0:
            return f"pid {holder.get('pid')} now belongs to another process (started at another time)"
        # alive, even if silent (stopped with Ctrl-Z / SIGSTOP, or a hung heartbeat): not stale. Its workers
        # may still be training, and a resumed launcher would go on: taking over would put two trainings
        # in one run directory. Its workers stop on their own once the heartbeat is old (parent_watch).
        return None
    if age > STALE_AFTER_S:
        return f"its heartbeat is {int(age)} s old (limit {int(STALE_AFTER_S)} s)"
    return None


def read(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as a lock with no live holder


def _write_temp(folder: Path, data: dict) -> Path:
    tmp = folder / f".{LOCK_NAME}.{data['launch']}.tmp"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return tmp


@dataclass
class Acquired:
    """How this launch got the run directory."""
    how: str                       # "created" | "took over" | "joined"
    previous: Optional[dict] = None  # the holder found there (took over / joined)
    reason: str = ""                 # why it was taken over


class LaunchLock:
    """Hold RUN_DIR/launch.lock for the life of a launch; `release()` (also on exceptions) removes it."""

    def __init__(self, run_dir: Path, job: Optional[str], single_node: bool):
        self.folder = Path(run_dir)
        self.path = self.folder / LOCK_NAME
        self.job, self.single_node = job, single_node
        self.data = me(job)
        self.owner = False
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ---- taking it
    def acquire(self) -> Acquired:
        """Create, take over or join the lock; raises LockHeld when another live job holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(20):  # each turn either decides or saw the lock change under it
            if self._create():
                self.owner = True
                self._start_heartbeat()
                return Acquired("created")
            holder = read(self.path)
            if holder is None:
                continue  # released meanwhile: try again
            same_job = bool(self.job) and holder.get("job") == self.job
            why = stale_reason(holder) if holder else "it is unreadable"
            if why is None and not same_job:
                raise LockHeld(self.path, holder)
            if why is None and not self.single_node:  # another node of this multi-node job
                self._start_heartbeat()
                return Acquired("joined", holder)
            if why is None:
                why = f"it belongs to the same job ({self.job}): a restarted or requeued launch"
            if self._take_over(holder):
                self.owner = True
                self._start_heartbeat()
                return Acquired("took over", holder, why)
        raise LockHeld(self.path, read(self.path) or {})

    def _create(self) -> bool:
        tmp = _write_temp(self.folder, self.data)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _take_over(self, seen: dict) -> bool:
        """Replace the lock we judged stale, unless it changed meanwhile (another launch was faster)."""
        guard = self.folder / f"{LOCK_NAME}.break"
        try:
            fd = os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:  # a breaker that died mid-takeover leaves its guard: old ones are ignored
                if time.time() - guard.stat().st_mtime > STALE_AFTER_S:
                    guard.unlink(missing_ok=True)
            except FileNotFoundError:
                pass
            time.sleep(0.2)
            return False
        os.close(fd)
        try:
            now = read(self.path)
            if now is None or (now or {}).get("launch") != (seen or {}).get("launch"):
                return False  # released or taken meanwhile: decide again
            os.rename(_write_temp(self.folder, self.data), self.path)
            return True
        finally:
            guard.unlink(missing_ok=True)

    # ---- holding it
    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="trainkit-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(HEARTBEAT_S):
            try:
                current = read(self.path)
                if self.owner and current and current.get("launch") == self.data["launch"]:
                    self.data["heartbeat"] = time.time()
                    os.replace(_write_temp(self.folder, self.data), self.path)
                elif self.owner and not warned:
                    print(f"trainkit: warning: {self.path} was taken over by another launch "
                          f"({describe(current) if current else 'removed'})", file=sys.stderr, flush=True)
                    warned = True
                elif not self.owner and (current is None or (current.get("job") == self.job and stale_reason(current))):
                    # a joined node whose lock holder ended or died first: hold it for the job from now on
                    if (current is None and self._create()) or (current and self._take_over(current)):
                        self.owner = True
            except OSError:
                pass  # a shared filesystem hiccup: the next beat tries again

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if this launch still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.owner:
            current = read(self.path)
            if current and current.get("launch") == self.data["launch"]:
                self.path.unlink(missing_ok=True)
            self.owner = False


def holder_alive(run_dir: Path) -> Optional[dict]:
    """The live holder of RUN_DIR's lock, or None (no lock, or a stale one)."""
    holder = read(Path(run_dir) / LOCK_NAME)
    if holder and stale_reason(holder) is None:
        return holder
    return None
