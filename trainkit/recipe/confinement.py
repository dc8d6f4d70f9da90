"""Where a recipe may read other recipe files from: its repository.

`trainkit validate` runs on recipes from untrusted pull requests, on machines that hold secrets. A
`defaults:` entry is a path the recipe chooses, so without a boundary a recipe could compose any
readable YAML/JSON file (a runner's key, a kubeconfig) and have its values echoed in an error. The
boundary is the recipe's repository: the nearest folder above the top recipe holding `.git`, else the
top recipe's own folder; `TRAINKIT_RECIPE_ROOT` names another. Paths are resolved (symlinks
followed) before the check, so a link inside the repository cannot point out of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ROOT_VAR = "TRAINKIT_RECIPE_ROOT"


class UnreadablePath(Exception):
    """A path that cannot be resolved (a symlink loop, a permission error on the way)."""


def real_path(path: Path) -> Path:
    """`path` with every symlink followed.

    Raises:
        UnreadablePath: a symlink loop or an OS error while following links.
    """
    try:
        return path.resolve()
    except (RuntimeError, OSError) as exc:  # pathlib raises RuntimeError for a symlink loop
        reason = "a symlink loop" if "loop" in str(exc).lower() or getattr(exc, "errno", 0) == 40 else str(exc)
        raise UnreadablePath(f"cannot resolve {path}: {reason}") from None


def recipe_root(top_recipe: Path, environ: Optional[dict] = None) -> Path:
    """The folder every file a recipe composes must lie in."""
    env = os.environ if environ is None else environ
    if env.get(ROOT_VAR):
        return real_path(Path(env[ROOT_VAR]).expanduser())
    start = top_recipe.parent
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return start


def outside(target: Path, root: Path) -> bool:
    """Whether a resolved path lies outside the resolved root."""
    return not target.is_relative_to(root)
