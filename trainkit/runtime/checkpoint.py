"""Atomic, verifiable checkpoints (which one a run resumes from is decided in runtime/resume.py).

Layout: RUN_DIR/checkpoints/step-00000008/ holding the strategy's model/optimizer files,
`trainer.pt` (step, epoch, position in the epoch, scheduler, scaler, recipe hash), one
`rng-rankNNNNN.pt` per rank, and `meta.json` (sha256 of every file). Everything is written into
`.tmp-step-...`, fsynced, and renamed; `meta.json` is written last, so a folder without it — or
whose files do not match its hashes — is incomplete and never resumed from.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..run_dir import (CHECKPOINT_ABANDONED, CHECKPOINT_META, CHECKPOINT_RECIPE, CHECKPOINT_RNG, CHECKPOINT_TRAINER,
                       checkpoint_meta_path, checkpoint_name)
from . import checkpoint_async
from .checkpoint_layout import TMP, disk_full_message, disk_too_full, folder_bytes, step_folders, step_of
from .files import fsync_dir, fsync_save, sha256_file


# --------------------------------------------------------------------------- files
def recipe_hash(data: dict) -> str:
    """Hash of the resolved recipe, stored in each checkpoint to notice a changed recipe on resume."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


RECIPE_FILE = CHECKPOINT_RECIPE  # the resolved recipe that trained up to this checkpoint (for drift checks)
STOP_SAVE_WAIT_S = 20.0  # on a stop, how long a background checkpoint write may take to finish (torchrun's
# grace before its SIGKILL is 30 s: the rank still leaves in time)


def write_recipe(folder: Path, data: dict) -> None:
    with open(folder / RECIPE_FILE, "w") as fh:
        json.dump(data, fh, indent=1, sort_keys=True, default=str)
        fh.flush()
        os.fsync(fh.fileno())


def saved_recipe(folder: Path) -> Optional[dict]:
    """The recipe a checkpoint was trained with (None for checkpoints older than this record)."""
    try:
        return json.loads((folder / RECIPE_FILE).read_text())
    except (OSError, ValueError):
        return None


def saved_step(folder: Path) -> int:
    return int(json.loads(checkpoint_meta_path(folder).read_text())["step"])


# --------------------------------------------------------------------------- RNG
def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # this rank's own device only: a resumed rank may see fewer GPUs than the saver (one per process)
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if isinstance(saved, (list, tuple)):  # checkpoints before this rule held every visible device's state
            index = torch.cuda.current_device()
            saved = saved[index] if index < len(saved) else None
        if saved is not None:
            torch.cuda.set_rng_state(saved)  # the current device: the one this rank computes on
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------- validity
def problem_with(folder: Path) -> Optional[str]:
    """Why a checkpoint folder cannot be resumed from, or None if it is complete and intact."""
    meta_path = checkpoint_meta_path(folder)
    if not meta_path.is_file():
        return f"incomplete (no {CHECKPOINT_META}: the write was interrupted)"
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (ValueError, KeyError) as exc:
        return f"{CHECKPOINT_META} is unreadable ({exc})"
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256_file(path) != digest:
            return f"{name} is corrupt (sha256 does not match {CHECKPOINT_META})"
    return None


def newest_valid(ckpt_dir: Path, warn: bool = True) -> Optional[Path]:
    """The newest complete, intact checkpoint; skipped ones are named in a warning."""
    for folder in step_folders(ckpt_dir):
        why = problem_with(folder)
        if why is None:
            return folder
        if warn:
            print(f"trainkit: warning: skipping checkpoint {folder}: {why}", file=sys.stderr, flush=True)
    return None


# --------------------------------------------------------------------------- a full disk
class DiskFullError(OSError):
    """A checkpoint could not be written for lack of space (a restart would fail the same way)."""


DISK_FULL_SIGNS = ("No space left on device", "unexpected pos", "file write failed")  # torch's writer wraps ENOSPC


def _is_disk_full(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if isinstance(exc, (OSError, RuntimeError)) and any(sign in str(exc) for sign in DISK_FULL_SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _vanished(exc: BaseException, tmp: Path) -> bool:
    """A file of this save could not be opened because another rank emptied the folder (disk full)."""
    return isinstance(exc, FileNotFoundError) and str(tmp) in str(getattr(exc, "filename", "") or "")


def _empty(folder: Path) -> None:
    for f in folder.glob("*"):
        if f.is_dir():
            shutil.rmtree(f, ignore_errors=True)
        else:
            f.unlink(missing_ok=True)


class WorldSizeChanged(RuntimeError):
    """A checkpoint saved by N ranks cannot be loaded by M ranks with this strategy."""


# --------------------------------------------------------------------------- save / load
class Checkpointer:
    """Saves and restores full training state through a Strategy (which owns model/optimizer files)."""

    def __init__(self, ckpt_dir: Path, strategy, keep: int, recipe_data: dict):
        self.dir, self.strategy, self.keep = ckpt_dir, strategy, keep
        self.recipe_data, self.recipe_sha256 = recipe_data, recipe_hash(recipe_data)
        trainer = recipe_data.get("trainer", {})
        self.in_background = bool(trainer.get("checkpoint", {}).get("async_save", False))
        self.final_step = trainer.get("max_steps")  # its save is waited for: the run ends with it sealed
        self.pending: Optional[tuple[checkpoint_async.BackgroundWrite, Path, Path, int]] = None
        self._sealed: list[tuple[int, Path]] = []  # (step, folder) sealed since `take_sealed` was last asked

    def save(self, step: int, model, optimizer, trainer_state: dict) -> Path:
        self.wait()  # at most one save in flight: the previous one is written and sealed first
        s = self.strategy
        final = self.dir / checkpoint_name(step)
        tmp = self.dir / f"{TMP}{final.name}"
        if s.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        s.barrier()
        try:
            if not self.in_background:
                s.save_checkpoint(tmp, model, optimizer)
            fsync_save(rng_state(), tmp / CHECKPOINT_RNG.format(rank=s.rank))
            if s.rank == 0:
                fsync_save(dict(trainer_state, recipe_sha256=self.recipe_sha256, world_size=s.world_size,
                                data_parallel_size=s.data_parallel_size),
                           tmp / CHECKPOINT_TRAINER)
                write_recipe(tmp, self.recipe_data)
            if self.in_background and disk_too_full(self.dir):
                # refused here, as a synchronous save would fail: in the background the write would fill
                # the disk under the loop's own writes (metrics, logs), which would fail first, unexplained
                raise OSError(errno.ENOSPC, "no room for a checkpoint the size of the previous one")
            if self.in_background:  # every other file is written: the seal waits only for DCP's write
                seal = (lambda: self._seal(tmp, final, step)) if s.rank == 0 else None
                free_if_full = lambda exc: _empty(tmp) if _is_disk_full(exc) else None  # noqa: E731
                self.pending = (checkpoint_async.start(tmp, model, optimizer, seal, free_if_full), tmp, final, step)
            else:
                s.barrier()
                if s.rank == 0:
                    self._seal(tmp, final, step)
                s.barrier()
                self._sealed.append((step, final))
        except BaseException as exc:
            self._failed(exc, tmp, final)
        if step == self.final_step:
            self.wait()  # the run's last checkpoint is complete when the run ends
        return final

    def take_sealed(self) -> list[tuple[int, Path]]:
        """The checkpoints sealed (complete, renamed to their final folder) since the last call, oldest
        first: a background save is sealed only when a later `save` or the run's last one waits for it, so
        what `save` returns may not exist yet (monitors' `on_checkpoint` is called with these)."""
        sealed, self._sealed = self._sealed, []
        return sealed

    def finish_on_stop(self) -> None:
        """A stop (SIGTERM/SIGINT: a preemption) with a save in flight: its write gets up to STOP_SAVE_WAIT_S to
        finish and be sealed, so the newest checkpoint is not lost to the stop; one still writing after that
        is left unsealed (never complete-looking), as a synchronous save the stop interrupts."""
        if self.pending is None:
            return
        write = self.pending[0]
        try:
            if write.wait(STOP_SAVE_WAIT_S):
                self.pending = None
        except BaseException:  # noqa: BLE001 -- it failed: the previous checkpoint stays the resume point
            self.pending = None

    def wait(self) -> None:
        """Finish the save in flight, if any (`trainer.checkpoint.async_save`): its errors are raised here,
        a full disk as DiskFullError like a synchronous save's."""
        if self.pending is None:
            return
        write, tmp, final, step = self.pending
        self.pending = None
        try:
            write.wait()
        except KeyboardInterrupt:  # a stop arrived while waiting: the write goes on, finish_on_stop decides
            self.pending = (write, tmp, final, step)
            raise
        except BaseException as exc:
            self._failed(exc, tmp, final)
        self.strategy.barrier()  # rank 0 seals in its writer thread: the folder is renamed on every rank's return
        self._sealed.append((step, final))

    def _failed(self, exc: BaseException, tmp: Path, final: Path) -> None:
        full = _is_disk_full(exc) or (_vanished(exc, tmp) and disk_too_full(self.dir))
        if full:
            # every rank frees what it can at once, so the error reports (torchelastic's error.json,
            # the fatal marker) can still be written; the emptied folder stays as the sign of which
            # save failed, for the launcher's report and a restart's check (`failed_save`)
            written = folder_bytes(tmp)
            _empty(tmp)
            raise DiskFullError(disk_full_message(self.dir, final.name, written)) from exc
        if self.strategy.rank == 0:  # interrupted or failed: never leave a half-written checkpoint behind
            shutil.rmtree(tmp, ignore_errors=True)
        raise exc

    def _seal(self, tmp: Path, final: Path, step: int) -> None:
        files = {str(p.relative_to(tmp)): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        meta = {"step": step, "files": files, "recipe_sha256": self.recipe_sha256, "created": time.time()}
        with open(checkpoint_meta_path(tmp), "w") as fh:
            json.dump(meta, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():  # a step redone after resuming from an older checkpoint
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        kept = [f for f in step_folders(self.dir) if step_of(f) <= step]  # newest first, this one included
        for old in kept[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, folder: Path, model, optimizer) -> dict:
        """Restore model, optimizer and this rank's RNG; return the trainer state.

        Checkpoints newer than `folder` belong to an abandoned timeline (resuming from an older or
        explicit checkpoint, or past a corrupt one): rank 0 moves them aside so that neither
        rotation nor a later `resume: auto` mistakes them for this run's progress.
        """
        s = self.strategy
        if s.rank == 0 and folder.resolve().parent == self.dir.resolve():
            for newer in step_folders(self.dir):
                if step_of(newer) > step_of(folder):
                    aside = self.dir / f"{CHECKPOINT_ABANDONED}{newer.name}-{int(time.time())}"
                    newer.rename(aside)
                    print(f"trainkit: note: {newer} is newer than the resumed checkpoint; moved to {aside}",
                          file=sys.stderr, flush=True)
        state = torch.load(folder / CHECKPOINT_TRAINER, map_location="cpu", weights_only=False)
        saved_world = state.get("world_size", s.world_size)
        if saved_world != s.world_size and not s.reshards_on_load:
            raise WorldSizeChanged(f"{folder} was saved by {saved_world} ranks and this launch has {s.world_size}: "
                                   f"{type(s).__name__} checkpoints cannot be resharded on load; resume with "
                                   f"{saved_world} ranks, or start a new run (name=...)")
        if checkpoint_async.written_in_background(folder, s):
            checkpoint_async.load_written_in_background(folder, model, optimizer)
        else:
            s.load_checkpoint(folder, model, optimizer)
        rng = folder / CHECKPOINT_RNG.format(rank=s.rank)
        if rng.is_file():
            set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
        elif s.rank == 0:
            print(f"trainkit: warning: {folder} has no RNG state for rank {s.rank} "
                  f"(saved with world size {state.get('world_size')}); continuing with fresh seeds", file=sys.stderr)
        if state.get("recipe_sha256") != self.recipe_sha256 and s.rank == 0:
            print(f"trainkit: note: resuming from {folder}, which was written by a different version of the "
                  f"recipe (hash changed)", file=sys.stderr)
        return state
