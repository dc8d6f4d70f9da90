"""The fatal marker (RUN_DIR/fatal.json): the last attempt failed in a way a restart only repeats.

Why a file: torchrun's agent restarts the workers on its own, without asking the launcher, so the
restarted ranks must learn from the run directory that a NaN, a full disk, an out-of-memory
(docs/memory.md: the rank's own MemoryError / CUDA OOM, or the launcher's finding that the OOM killer
ended a rank) or a collective desync caught by torch's checks ended the previous attempt, and stop at
once instead of redoing the work (docs/running.md). A new `trainkit run` is a
deliberate retry and clears the marker.
"""

from __future__ import annotations

from pathlib import Path

from ..run_dir import FATAL, read_fatal, write_fatal
from .checkpoint_layout import disk_full_message, disk_too_full, failed_save


# what torch's collective checks (TORCH_DISTRIBUTED_DEBUG=DETAIL: launch.debug_collectives) raise on every
# rank when the ranks call different collectives; the same code on the same data desyncs again after a
# restart from the last checkpoint
COLLECTIVE_MISMATCH = "Detected mismatch between collectives on ranks"


def is_collective_desync(exc: BaseException) -> bool:
    """Whether `exc` is torch's report of ranks calling different collectives (a restart repeats it)."""
    return COLLECTIVE_MISMATCH in str(exc)


class NonRetryableError(RuntimeError):
    """The previous attempt of this launch failed in a way a restart repeats (see FATAL)."""


def record(run_dir: Path, exc: Exception) -> None:
    """Leave the marker for the restarted ranks (the worker calls this for NaN and full-disk failures)."""
    try:  # small; on a full disk it may not fit either, and then the restart redoes the failure
        write_fatal(run_dir, exc)
    except OSError:
        pass


def raise_if_restart_would_repeat(run_dir: Path, ckpt_dir: Path) -> None:
    """Before a restart redoes any work: did the last attempt fail in a way a restart repeats? The
    marker says so when it could be written; on a disk too full even for it, the save it abandoned
    (`.tmp-step-...`) and the free space say so."""
    fatal = read_fatal(run_dir)
    if fatal is not None:
        raise NonRetryableError(f"not restarting: {fatal['message']}")
    abandoned = failed_save(ckpt_dir)
    if abandoned is not None and disk_too_full(ckpt_dir):
        raise NonRetryableError(f"not restarting: {disk_full_message(ckpt_dir, abandoned)}")
