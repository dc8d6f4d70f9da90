"""Where the embedded MLflow store lives: one per project, so the runs of a project land in one store
whichever folder they were started from, and `trainkit ui`, `runs` and `compare` started anywhere in the
project read that store.

The project is the git repository holding the recipe (`TRAINKIT_RECIPE_ROOT` names another, as it does
for `defaults:`); a command without a recipe (`ui`, `runs`, `compare`) uses the repository holding the
current folder. Outside any repository there is no project to find: the store is the current folder's
`mlflow.db`, MLflow's own default. An explicit `tracking.uri` or MLFLOW_TRACKING_URI is used as given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ..recipe.confinement import ROOT_VAR

STORE_FILE = "mlflow.db"


def project_folder(start: Path) -> Optional[Path]:
    """The project holding `start` (a folder): TRAINKIT_RECIPE_ROOT, else the nearest folder at or above
    it holding `.git`; None outside any repository."""
    if os.environ.get(ROOT_VAR):
        return Path(os.environ[ROOT_VAR]).expanduser().resolve()
    start = start.resolve()
    return next((folder for folder in (start, *start.parents) if (folder / ".git").exists()), None)


def embedded_store(recipe_file: Optional[Path] = None) -> Path:
    """The SQLite file of the embedded store: in the project of the recipe, else of the current folder,
    else in the current folder."""
    starts = ([Path(recipe_file).parent] if recipe_file is not None else []) + [Path.cwd()]
    project = next((p for p in map(project_folder, starts) if p is not None), None)
    return (project or Path.cwd()) / STORE_FILE


def embedded_uri(recipe_file: Optional[Path] = None) -> str:
    return f"sqlite:///{embedded_store(recipe_file)}"
