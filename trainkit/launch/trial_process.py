"""The body of one `trainkit tune` trial process (forked from tune's forkserver, `tune_trials`).

Imported first by the forkserver, so its warnings filter holds in every trial: multiprocessing
re-runs the tune's main module in each child (`python -m trainkit.cli` there), and runpy warns that
`trainkit.cli` is already imported -- true, harmless (the trial calls `main` of the imported one),
and a line of noise on the tune's console per trial.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing
import os
import sys
import warnings

from ..processes import CLI

warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning,
                        module="runpy")


def main(arguments: list[str], log: str) -> None:
    """A session of its own (stopped as a group), output to its log, then `trainkit <arguments>`."""
    os.setsid()
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    # as in a fresh `trainkit run`: the platform's default start method, not the "forkserver" that
    # multiprocessing sets in its children (the DataLoader's workers would start from a forkserver of
    # their own and, not children of their rank, kill themselves: runtime.parent_watch)
    multiprocessing.set_start_method(None, force=True)
    # the `trainkit` command (processes.CLI) as `python -m` would run it: a process boundary, not an import
    trainkit = importlib.import_module(CLI).main
    try:
        code = trainkit(arguments)
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child skips them; `trainkit run`'s own process runs them
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def ready() -> None:
    """Nothing: started once before the first trial, so the forkserver's imports are not timed as a trial."""
