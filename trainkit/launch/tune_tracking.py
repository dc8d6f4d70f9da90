"""`trainkit tune` in MLflow: one parent run for the tune, a child run per trial.

The parent is spooled like a training run (WORKDIR/parent/tracking/spool.jsonl): with the server down,
it and every link to it wait there for `trainkit sync`. A trial's or the parent's folder is removed once
its records are delivered, and kept (and named) while they are not.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Optional

from ..run_dir import REPORTS, TRACKING
from ..tracking.delivery import deliver
from ..tracking.run import close_parent_run, link_to_parent, open_parent_run


def deliver_or_keep(run_dir: Path) -> bool:
    """Deliver a finished folder's tracking records and remove it; False (kept, and said so) when some
    records could not be delivered."""
    if not run_dir.exists():
        return True
    if (run_dir / TRACKING).is_dir():
        pending, error = deliver(run_dir)
        if pending:
            print(f"trainkit: tune: kept {run_dir}: {pending} tracking record(s) undelivered ({error})",
                  file=sys.stderr)
            return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


class ParentRun:
    """The tune's own MLflow run (None of it happens when the recipe's tracking is off)."""

    def __init__(self, folder: Path):
        self.folder = folder

    @classmethod
    def open(cls, workdir: Path, resolved, recipe_path: str, tags_params: dict) -> Optional["ParentRun"]:
        if not resolved.recipe.tracking.enabled:
            return None
        parent = cls(workdir / "parent")
        pending, error = open_parent_run(parent.folder, resolved, f"{resolved.recipe.name}-tune",
                                         tags={"trainkit.tune": "parent", "trainkit.recipe": recipe_path},
                                         params=tags_params)
        if pending:
            print(f"trainkit: tune: MLflow unreachable now ({error}): the tune run and its trials' runs are kept "
                  f"in their spools and delivered later", file=sys.stderr)
        return parent

    def link(self, run_dir: Path, change: str, samples_per_s: Optional[float]) -> None:
        """Spool a trial run's link to the tune run (delivered with the trial's records)."""
        if (run_dir / TRACKING).is_dir():
            link_to_parent(run_dir, self.folder, {"trainkit.tune.change": change},
                           {} if samples_per_s is None else {"tune/samples_per_s": samples_per_s})

    def close(self, status: str, metrics: dict, tags: dict, report: Optional[Path] = None) -> bool:
        """End the tune run (the report as its artifact); False when its records stay spooled."""
        artifacts = []
        if report is not None:  # a copy beside the spool: delivered later, it is still there
            kept = self.folder / REPORTS / report.name
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(report, kept)
            artifacts.append(kept)
        close_parent_run(self.folder, status, metrics, tags, artifacts)
        return deliver_or_keep(self.folder)
