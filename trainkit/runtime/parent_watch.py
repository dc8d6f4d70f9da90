"""Processes that die with their parent: a rank with `trainkit run`, a DataLoader worker with its rank;
and ranks that stop when their launcher falls silent.

Why: a process left behind by a SIGKILLed parent keeps its GPU memory, its port and its data files,
and nothing would ever stop it. Linux can be asked to kill it instead (prctl PR_SET_PDEATHSIG). A
launcher that is alive but silent (stopped with Ctrl-Z / SIGSTOP, hung) sends no signal at all: its
ranks watch the run directory lock's heartbeat instead, and stop once it is 3 beats old, so no rank
trains on under a launcher that another launch may take over from (launch/lock.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..run_dir import LAUNCH_ID_VAR, LOCK_HEARTBEAT_S, lock_heartbeat

SILENT_AFTER_S = 3 * LOCK_HEARTBEAT_S


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG), then make
    sure the parent had not died already (before the request, the kernel would not know to send it).
    No-op elsewhere than Linux."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # re-parented: the parent is gone
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """A worker never outlives `trainkit run` (TRAINKIT_LAUNCHER_PID), even one SIGKILLed.

    torchrun's agent runs inside the launcher; its SubprocessHandler Popens each worker (in a new
    session: a signal to the launcher's process group misses them) from the thread that runs
    `agent.run()` — `_invoke_run` -> `_initialize_workers`/`_restart_workers` -> `_start_workers` ->
    `start_processes` -> `SubprocessContext._start`, all synchronous on the launcher's main thread.
    PR_SET_PDEATHSIG fires when the *forking thread* exits, and the main thread exits only with the
    process, so the signal means exactly "the launcher died"."""
    launcher = os.environ.get("TRAINKIT_LAUNCHER_PID")
    if launcher and int(launcher) != os.getpid():  # world size 1 runs main() inside the launcher itself
        die_with_parent(int(launcher))


def stop_when_launcher_falls_silent(run_dir: Path) -> None:
    """Watch the launch lock's heartbeat (a daemon thread); when this rank's launch has not beaten for
    SILENT_AFTER_S, stop this rank with SIGTERM (its normal, clean stop). Only for ranks started by a
    launcher that holds the lock (LAUNCH_ID_VAR); a world-size-1 run is the launcher itself."""
    launch = os.environ.get(LAUNCH_ID_VAR)
    launcher = os.environ.get("TRAINKIT_LAUNCHER_PID")
    if not launch or not launcher or int(launcher) == os.getpid():
        return

    def watch() -> None:
        while True:
            time.sleep(LOCK_HEARTBEAT_S / 2)
            beat = lock_heartbeat(run_dir)
            if beat is None or beat[0] != launch:
                continue  # released, or held by a later launch of the same job: not ours to judge
            silent = time.time() - beat[1]
            if silent > SILENT_AFTER_S:
                print(f"trainkit: rank {os.environ.get('RANK', '?')}: the launcher (pid {launcher}) has not "
                      f"refreshed its lock for {silent:.0f} s (stopped with Ctrl-Z / SIGSTOP, or hung): stopping, "
                      f"so that no training goes on under a launcher another launch may replace", file=sys.stderr,
                      flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="trainkit-launcher-heartbeat", daemon=True).start()
