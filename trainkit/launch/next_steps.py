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
                     f"trainkit: next: open {_run_page(uri, run_dir)}    # the run in MLflow")
    return "\n".join(lines)


def _run_page(uri: str, run_dir: Path) -> str:
    """The run's own page on an MLflow server, in the model-training view (MLflow 3 opens the GenAI
    view unless the link asks otherwise: tracking.browse.ui_link); the server's root when the run's
    ids are not known yet (its records still in the spool). Credentials never go into a printed link."""
    from urllib.parse import urlsplit, urlunsplit

    from ..tracking.browse import ui_link
    from ..tracking.spool import Spool

    if uri.startswith("databricks"):
        return uri
    state = Spool(run_dir).state()
    parts = urlsplit(uri)
    base = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])).rstrip("/")
    if state.get("run_id") and state.get("experiment_id"):
        return ui_link(base, f"/experiments/{state['experiment_id']}/runs/{state['run_id']}")
    return ui_link(base)
