"""Processes that die with their parent: a rank with `trainkit run`, a DataLoader worker with its rank.

Why: a process left behind by a SIGKILLed parent keeps its GPU memory, its port and its data files,
and nothing would ever stop it. Linux can be asked to kill it instead (prctl PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import sys


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
