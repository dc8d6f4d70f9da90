"""Turn `trainkit validate` arguments (files, folders, globs) into recipe files."""

from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Sequence

SUFFIXES = (".yaml", ".yml")


def is_partial(path: Path) -> bool:
    """Composition fragments (under a `base/` folder, or named `_*.yaml`) are not whole recipes."""
    return path.name.startswith("_") or "base" in path.parts[:-1]


def expand_recipe_paths(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(recipe files to validate, arguments that matched nothing).

    Files named explicitly are always validated; folders are searched recursively and skip
    composition fragments; globs are expanded here too, for shells (and CI YAML) that don't.
    """
    files: list[str] = []
    missing: list[str] = []
    for arg in args:
        path = Path(arg)
        exists = path_exists(path)
        if exists and path.is_dir():
            found = sorted(str(p) for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file()
                           and not is_partial(p.relative_to(path)))
        elif exists:
            found = [arg]
        elif glob.has_magic(arg):
            found = sorted(p for p in glob.glob(arg, recursive=True) if Path(p).is_file())
        else:
            found = []
        if not found:
            missing.append(arg)
        files.extend(f for f in found if f not in files)
    return files, missing


_OVERRIDE = re.compile(r"^([~+]?[A-Za-z_][\w\-]*(\.[\w\-]+)*=|~[A-Za-z_])")


def path_exists(path: Path) -> bool:
    """Whether a file or folder is there; False for a name no file can have (longer than the file system
    allows: ENAMETOOLONG, which `Path.exists` raises rather than answers)."""
    try:
        return path.exists()
    except OSError:
        return False


def split_overrides(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(paths, overrides): `key=value`, `+key=value` and `~key` are overrides unless a file or folder
    of that name exists, so `trainkit validate r.yaml strategy.zero_stage=2` means what it says; so is
    any other argument holding `=` that names no file (the override grammar then says what is wrong)."""
    paths: list[str] = []
    overrides: list[str] = []
    for arg in args:
        (overrides if (_OVERRIDE.match(arg) or "=" in arg) and not path_exists(Path(arg)) else paths).append(arg)
    return paths, overrides
