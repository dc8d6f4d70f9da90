"""Checkpoints written in the background (`trainer.checkpoint.async_save: true`).

Why: a synchronous save stops training for the whole write. DCP's `async_save` (torchtitan's
`async_mode: async`) copies the model and optimizer state into host memory on the training thread
(the only part that blocks) and writes the files from a thread of its own, over a gloo group of its
own so that its collectives never interleave with the training loop's.

The folder is written as `.tmp-step-N` like any other; the completion marker (`meta.json`) and the
rename to `step-N` come only after the write has finished on every rank (DCP's coordinator, rank 0,
finishes after gathering every rank's write result), so a process killed mid-write leaves an
unsealed folder that is never resumed from. The layout is DCP's `{"model", "optim"}` from
`get_state_dict`, the one the FSDP strategy writes itself; a strategy with another layout of its own
(DDP's `model.pt`) loads such a folder through DCP (`load_written_in_background`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Optional

from .dcp_state import load_dcp, state_for_dcp

DCP_METADATA = ".metadata"  # the file DCP's coordinator writes last


class BackgroundWrite:
    """One save in flight: DCP's write future, then (rank 0) the seal once it has succeeded."""

    def __init__(self, future: Future, seal: Optional[Callable[[], None]],
                 on_error: Callable[[BaseException], None]):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._seal, self._on_error = seal, on_error
        future.add_done_callback(self._finish)

    def _finish(self, future: Future) -> None:
        try:
            future.result()
            if self._seal is not None:
                self._seal()
        except BaseException as exc:  # re-raised on the training thread by `wait`
            self._error = exc
            try:
                self._on_error(exc)  # at once: a full disk is freed before the loop's next write meets it
            except Exception:  # noqa: BLE001 -- the write's own error is the one to report
                pass
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Block until the write (and its seal) has finished, or `timeout_s` passed (then False); raise
        what went wrong in the background."""
        if not self._done.wait(timeout_s):
            return False
        if self._error is not None:
            raise self._error
        return True


_GROUP = None  # the checkpoint writer's own gloo group, made once per process (a collective: every rank)
_PINNED_STAGER = None  # a GPU rank's staging buffers, kept for every later save of the run


def _stager(model):
    """Where a GPU rank's state is copied to before the write: page-locked host buffers that DCP's
    stager allocates at the first save and reuses for every later one (torchtitan stages into pinned
    memory the same way). Without it DCP makes a fresh pageable copy per save, which is slower to fill
    from the GPU and re-allocated each time. At most one save is in flight (`Checkpointer.save` waits
    for the previous write), so no write still reads a buffer when the next save refills it. None on
    the CPU: DCP's default (a fresh copy per save; pinning needs a GPU)."""
    global _PINNED_STAGER
    import torch

    on_gpu = any(p.device.type == "cuda" for p in model.parameters())
    if not on_gpu:
        return None
    if _PINNED_STAGER is None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        _PINNED_STAGER = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                      use_async_staging=False,
                                                      use_non_blocking_copy=torch.cuda.is_available()))
    return _PINNED_STAGER


def _writer_group():
    global _GROUP
    import torch.distributed as dist

    if _GROUP is None and dist.is_available() and dist.is_initialized():
        _GROUP = dist.new_group(backend="gloo")
    return _GROUP


def start(folder: Path, model, optimizer, seal: Optional[Callable[[], None]],
          on_error: Callable[[BaseException], None]) -> BackgroundWrite:
    """Stage this rank's state (blocking: a host copy) and start writing it into `folder`; `seal` runs
    when the write has finished, `on_error` (in the writer's thread) when it failed."""
    import torch.distributed.checkpoint as dcp

    future = dcp.async_save(state_for_dcp(model, optimizer)[0], checkpoint_id=str(folder),
                            process_group=_writer_group(), async_stager=_stager(model))
    return BackgroundWrite(future, seal, on_error)


def written_in_background(folder: Path, strategy) -> bool:
    """A DCP folder the strategy did not write in a layout of its own (DDP after `async_save`)."""
    return (folder / DCP_METADATA).is_file() and not type(strategy).owns_checkpoint(folder)


def load_written_in_background(folder: Path, model, optimizer) -> None:
    """Load a `start`-written folder into any strategy's model and optimizer, through DCP."""
    load_dcp(folder, model, optimizer)
