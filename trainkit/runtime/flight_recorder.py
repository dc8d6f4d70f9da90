"""torch's Flight Recorder on every process group of a watched rank, readable by the launcher while
the rank is blocked inside a collective (the hang report's "Flight Recorder" section).

Why a hook: `FlightRecorderHook.attach(group)` records each collective of a group (op, sequence
number, sizes, dtypes) whatever its backend, gloo included, into the process's Flight Recorder, the
same record NCCL keeps natively: so the CPU tests run the code a GPU run uses. Every group is
hooked as it is registered (the world here; later the device mesh's, the checkpoint writer's), as
`runtime.process_groups` tells of it.

Why a server: a rank blocked in a collective runs no Python code of its own (a Python signal
handler would wait for it), so the record is served by torch's C++ worker server
(`_WorkerServer`, its `fr_trace_json` and `dump_nccl_trace_pickle` handlers answer from a C++
thread, without the GIL) on a Unix socket in the directory the launcher names in SOCKETS_ENV
(private to the launch; `trainkit.launch.flight_recorder_dumps` asks it).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

from . import process_groups

SOCKETS_ENV = "TRAINKIT_FLIGHT_RECORDER_DIR"  # set by the launcher's hang watch: the rank's sockets go there
SOCKET = "rank{rank}.sock"

_hooks: list = []  # the attached hooks: a hook dropped is a hook removed
_server = None


def socket_path(directory: Path, rank: int) -> Path:
    return Path(directory) / SOCKET.format(rank=rank)


def start(rank: int) -> None:
    """When the launcher watches for hangs: record every process group's collectives and serve the
    record on this rank's socket. Needs the default group (after init_process_group)."""
    global _server
    directory = os.environ.get(SOCKETS_ENV)
    if not directory or _server is not None:
        return
    import torch.distributed as dist
    try:  # torch 2.14's hook and server; an older torch trains on without the record
        from torch._C._distributed_c10d import FlightRecorderHook, _WorkerServer  # noqa: F401
    except ImportError as exc:
        print(f"trainkit: warning: rank {dist.get_rank()}: no Flight Recorder in this torch ({exc}); a hang report "
              "will have the stacks and trainkit's own collective record only", file=sys.stderr)
        return
    if not process_groups.each_group(_attach):  # every group now, and each one made later
        print(f"trainkit: warning: rank {dist.get_rank()}: this torch does not say when a process group is made; "
              "the Flight Recorder records only the groups that exist now", file=sys.stderr)
    path = socket_path(Path(directory), rank)
    path.unlink(missing_ok=True)  # a previous attempt's rank (restarts reuse the launch's directory)
    try:
        with _without_stderr():
            _server = _WorkerServer(str(path))
    except RuntimeError as exc:  # the record still helps a dump on timeout; the report says no answer
        print(f"trainkit: warning: rank {dist.get_rank()}: flight recorder server: {exc}", file=sys.stderr)


def _attach(group) -> None:
    from torch._C._distributed_c10d import FlightRecorderHook

    try:
        _hooks.append(FlightRecorderHook.attach(group))
    except (RuntimeError, TypeError) as exc:  # e.g. a group this rank is not a member of
        print(f"trainkit: warning: flight recorder not attached to a process group: {exc}", file=sys.stderr)


@contextmanager
def _without_stderr():
    """File descriptor 2 to /dev/null for a moment: the server's constructor logs a C++ warning
    ("Server listening to UNIX ...") that every rank 0 would print on the console of every launch."""
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
