"""Before a launch writes anything: is this a resume, of what, and may it continue?

- the run already finished at `trainer.max_steps` -> "already complete", exit 0, nothing touched;
- the recipe changed in a key that alters what is trained -> refused (exit 2) with a key-by-key diff,
  unless `--accept-changes`;
- otherwise the launch goes on (safe changes are listed on the console).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..recipe import drift
from ..run_dir import CHECKPOINTS, has_summary
from ..runtime.checkpoint import newest_valid, saved_recipe, saved_step


@dataclass
class ResumeDecision:
    exit_code: Optional[int] = None  # set: stop the launch with this code
    checkpoint: Optional[Path] = None
    step: int = 0
    accepted: list = field(default_factory=list)  # drift.Change the user accepted (a new MLflow run)


def decide(resolved, run_dir: Path, accept_changes: bool) -> ResumeDecision:
    recipe = resolved.recipe
    resume = recipe.trainer.resume
    if resume == "never":
        return ResumeDecision()
    if resume == "auto":
        checkpoint = newest_valid(run_dir / CHECKPOINTS, warn=False)
    else:
        checkpoint = Path(resume).expanduser()  # checked (and reported) by the workers
        if not (checkpoint / "meta.json").is_file():
            return ResumeDecision()
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
