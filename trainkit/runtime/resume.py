"""Resume: the one place that decides whether a run continues, and from which checkpoint.

Two moments ask, knowing different things, and both answers come from here:

- `decide_at_launch`: `trainkit run`, before it writes anything. Is there a checkpoint to continue
  from, did the recipe change since (`recipe/drift.py` says which changes are safe), is the run
  already complete? The launcher acts on its `ResumeDecision`: stop with its exit code, set the
  previous checkpoints aside for a fresh start, continue the MLflow run in a new one for accepted
  changes (`tracking.run.continue_in_new_run`).
- `decide_on_ranks`: every rank, at start and after each torchrun restart (which the launcher never
  sees). May this attempt run at all (`fatal`), and which intact checkpoint do all ranks load? The
  worker restores it, and `accepted_changes` makes accepted hyperparameter changes take effect.

Both follow `checkpoint_to_resume`'s rule, except that at launch an explicit PATH needs only its
meta.json: the ranks check its files before loading and report what is wrong.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..recipe import drift
from ..run_dir import CHECKPOINTS, checkpoint_meta_path, has_summary
from . import fatal
from .checkpoint import newest_valid, problem_with, saved_recipe, saved_step
from .checkpoint_layout import step_folders, step_of


# --------------------------------------------------------------------------- the rule
def checkpoint_to_resume(resume: str, ckpt_dir: Path, restart_count: int, warn: bool) -> Optional[Path]:
    """Where to resume from (`trainer.resume`: auto, never or a PATH), checked file by file. After a
    torchrun restart, always this run's own newest intact checkpoint."""
    if restart_count > 0 or resume == "auto":
        own = newest_valid(ckpt_dir, warn=warn)
        if own is not None or resume in ("auto", "never"):
            return own
    if resume == "never":
        return None
    path = Path(resume).expanduser()
    why = problem_with(path) if path.is_dir() else "no such folder"
    if why:
        raise FileNotFoundError(f"trainer.resume: cannot resume from {path}: {why}")
    return path


# --------------------------------------------------------------------------- at launch
@dataclass
class ResumeDecision:
    exit_code: Optional[int] = None  # set: stop the launch with this code
    checkpoint: Optional[Path] = None
    step: int = 0
    accepted: list = field(default_factory=list)  # drift.Change the user accepted (a new MLflow run)
    start_fresh: bool = False  # resume: never: the previous checkpoints and MLflow spool are set aside


def decide_at_launch(resolved, run_dir: Path, accept_changes: bool) -> ResumeDecision:
    """Before a launch writes anything: is this a resume, of what, and may it continue?

    - the run already finished at `trainer.max_steps` -> "already complete", exit 0, nothing touched;
    - the recipe changed in a key that alters what is trained -> refused (exit 2) with a key-by-key
      diff, unless `--accept-changes`;
    - otherwise the launch goes on (safe changes are listed on the console)."""
    recipe = resolved.recipe
    resume = recipe.trainer.resume
    if resume == "never":
        return ResumeDecision(start_fresh=True)
    checkpoint = _checkpoint_at_launch(resume, run_dir / CHECKPOINTS)
    if checkpoint is None:
        return ResumeDecision()
    step = saved_step(checkpoint)
    saved = saved_recipe(checkpoint)
    found = drift.compare(saved, resolved.redacted(), drift.plugin_safe_options(recipe)) if saved is not None else None
    if found is not None and found.refused and resume != "auto":
        # an explicit trainer.resume: PATH deliberately starts this recipe from that checkpoint (fine-tuning,
        # resharding to another world size): the differences are shown, not refused
        print("trainkit: starting from " + str(checkpoint) + ", trained with a different recipe:\n"
              + "\n".join(c.line() for c in found.refused), flush=True)
        return ResumeDecision(checkpoint=checkpoint, step=step)
    if found is not None and found.refused and not accept_changes:
        print(f"trainkit: not started: {found.message(str(checkpoint), recipe.name)}", file=sys.stderr)
        return ResumeDecision(exit_code=2, checkpoint=checkpoint, step=step)
    if step >= recipe.trainer.max_steps and has_summary(run_dir) and not (found and found.refused):
        print(f"trainkit: run {recipe.name} is already complete: step {step} of trainer.max_steps "
              f"{recipe.trainer.max_steps}, checkpoint {checkpoint}; nothing to do (raise trainer.max_steps to "
              f"train longer, or give it another name= to start over)", flush=True)
        return ResumeDecision(exit_code=0, checkpoint=checkpoint, step=step)
    if found is not None and found.accepted:
        print("trainkit: resuming with changes that do not alter training: "
              + "; ".join(c.line().strip() for c in found.accepted), flush=True)
    accepted = list(found.refused) if found is not None else []
    if accepted:
        print("trainkit: --accept-changes: continuing with\n" + "\n".join(c.line() for c in accepted), flush=True)
    return ResumeDecision(checkpoint=checkpoint, step=step, accepted=accepted)


def _checkpoint_at_launch(resume: str, ckpt_dir: Path) -> Optional[Path]:
    """`checkpoint_to_resume` for a launch's first attempt, except that a PATH needs only its
    meta.json here: its files are checked, and reported, by the ranks."""
    if resume == "auto":
        return newest_valid(ckpt_dir, warn=False)
    checkpoint = Path(resume).expanduser()
    return checkpoint if checkpoint_meta_path(checkpoint).is_file() else None


# --------------------------------------------------------------------------- on the ranks
def decide_on_ranks(strategy, run_dir: Path, ckpt_dir: Path, resume: str, restart_count: int) -> Optional[Path]:
    """Where every rank resumes from, decided ONCE: rank 0 hashes the checkpoints and picks, then
    broadcasts its choice (or its error), so no two ranks can pick differently and nothing is
    renamed while another rank is still reading. A skipped corrupt newest checkpoint is announced.
    A restart first checks that it would not just repeat the failure that ended the last attempt."""
    if restart_count:
        fatal.raise_if_restart_would_repeat(run_dir, ckpt_dir)  # restarting cannot fix it
    decision: list = [None]
    if strategy.rank == 0:
        try:
            source = checkpoint_to_resume(resume, ckpt_dir, restart_count, warn=True)
            skipped = [f for f in step_folders(ckpt_dir) if source is None or step_of(f) > step_of(source)]
            if skipped and (restart_count > 0 or resume == "auto"):
                where = f"from {source.name}" if source is not None else "from step 0 (no intact checkpoint)"
                print(f"trainkit: resuming {where}: the newer checkpoint(s) {', '.join(f.name for f in skipped)} "
                      f"cannot be used (see the warning above)", file=sys.stderr, flush=True)
            decision[0] = ("ok", str(source) if source is not None else None)
        except Exception as exc:
            decision[0] = ("error", f"{type(exc).__name__}: {exc}")
    if strategy.world_size > 1:
        dist.broadcast_object_list(decision, src=0)
    kind, value = decision[0]
    if kind == "error":
        raise FileNotFoundError(value)
    return Path(value) if value is not None else None
