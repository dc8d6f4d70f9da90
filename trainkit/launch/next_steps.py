"""What to look at once a run has finished: printed last, so the end of the console says where the
report and the MLflow view are (a new user otherwise finds neither)."""

from __future__ import annotations

from pathlib import Path

from ..tracking.run import store_of, tracking_uri


def next_steps(recipe, run_dir: Path, tracked: bool) -> str:
    """The commands that show this run: its bottleneck report, and its MLflow store in a browser.
    The `ui` line names the store the run went to (the project's mlflow.db, tracking/store.py), so it
    works from any folder."""
    lines = [f"trainkit: next: trainkit report {run_dir}    # where the time went, and what to change"]
    if tracked:
        uri = store_of(run_dir) or tracking_uri(recipe)
        lines.append(f"trainkit: next: trainkit ui --uri {uri}    # the run in MLflow" if not
                     uri.startswith(("http://", "https://", "databricks")) else
                     f"trainkit: next: open {uri}    # the run in MLflow")
    return "\n".join(lines)
