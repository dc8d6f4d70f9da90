"""Recipe fields that become path components, listed in one place, and the rule they obey.

A value here is joined under a folder trainkit writes (`<launch.run_dir>/<name>/`, torchelastic's
`logs/<rdzv_id>_*`), so it must be one plain name: no path separator, no `..`, no NUL or control
character. Otherwise a recipe could make a run write outside its run directory. `launch.run_dir`
itself is the declared parent and may be any path. MLflow experiment and run names are not path
components (MLflow files artifacts under ids), nor are profiler/report/export file names (trainkit
builds those from ranks and steps; `trainkit export` takes its target on the command line).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePath
from typing import Any, Iterator, Optional

from .confinement import UnreadablePath, outside, real_path

PATH_COMPONENT_FIELDS: tuple[tuple[str, ...], ...] = (
    ("name",),               # <launch.run_dir>/<name>/
    ("launch", "rdzv_id"),   # <run dir>/logs/<rdzv_id>_<random>/ (torchelastic), defaults to name
)


def problem(value: str) -> Optional[str]:
    """Why `value` cannot be a single path component, or None."""
    if "/" in value or "\\" in value:
        return f"got {value!r}: it names a folder, so it cannot contain a path separator"
    if ".." in value:
        return f"got {value!r}: it names a folder, so it cannot contain '..'"
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"got {value!r}: it names a folder, so it cannot contain NUL or control characters"
    if not value.strip():
        return "it names a folder, so it cannot be empty"
    if len(value.encode()) > MAX_COMPONENT_BYTES:
        return (f"it names a folder, so it must be at most {MAX_COMPONENT_BYTES} bytes (got {len(value.encode())}; "
                f"file systems allow 255 per name and trainkit adds suffixes)")
    return None


def read_path_shown(value: str) -> str:
    """A path a recipe reads, as a message shows it. Relative paths (data roots, model.weights) resolve
    from the working directory, like the run directory, unlike `defaults:` (from the file naming them):
    so the message says which folder that was (docs/recipes.md, "Paths")."""
    path = Path(value).expanduser()
    return value if path.is_absolute() else f"{value} (from the working directory: {path.absolute()})"


MAX_COMPONENT_BYTES = 200
WRITE_ROOTS_VAR = "TRAINKIT_WRITE_ROOTS"


def written_path_problem(value: str, environ: Optional[dict] = None) -> Optional[str]:
    """Why a path the run would *write* is not allowed, or None.

    A recipe may make trainkit write only under the working directory it runs in (relative paths
    without `..`) or under a folder the operator lists in TRAINKIT_WRITE_ROOTS (os.pathsep-separated,
    absolute): a recipe from a pull request must not create files elsewhere on the machine. The path
    is then resolved (symlinks of its existing part followed, as `confinement` does for reads) and must
    still lie there: a symlinked folder the checkout carries cannot lead out."""
    env = os.environ if environ is None else environ
    path = PurePath(value)
    if any(ord(c) < 32 for c in value):
        return f"got {value!r}: a path trainkit writes cannot contain control characters"
    if ".." in path.parts:
        return f"got {value!r}: a path trainkit writes cannot contain '..' (it would leave the working directory)"
    roots = [PurePath(r) for r in env.get(WRITE_ROOTS_VAR, "").split(os.pathsep) if r.strip()]
    if path.is_absolute():
        if not any(path.is_relative_to(r) for r in roots):
            return (f"got {value!r}: trainkit writes absolute paths only under the folders listed in "
                    f"{WRITE_ROOTS_VAR}; use a path relative to the working directory, or list its folder there")
    return _leaves_through_a_link(value, roots)


def _leaves_through_a_link(value: str, roots: list[PurePath]) -> Optional[str]:
    """Why `value`, with every symlink of its existing part followed, lies outside the working directory
    and every write root (each resolved too), or None."""
    try:
        target = real_path(Path(value))
        allowed = [real_path(Path.cwd()), *(real_path(Path(r)) for r in roots if r.is_absolute())]
    except (UnreadablePath, OSError) as exc:
        return f"got {value!r}: a path trainkit writes must resolve ({exc})"
    if all(outside(target, root) for root in allowed):
        return (f"got {value!r}: it resolves through a symlink to {target}, outside the working directory "
                f"{allowed[0]}" + (f" and the folders listed in {WRITE_ROOTS_VAR}" if roots else "")
                + " (trainkit writes only there)")
    return None


def written_values(recipe: Any) -> Iterator[tuple[tuple, str]]:
    """(recipe path, value) of every path the run would write, as the blocks declare them."""
    yield from recipe.data.written_paths()
    for i, monitor in enumerate(recipe.monitors):
        for key in getattr(monitor, "written_path_fields", ()):
            value = getattr(monitor, key, None)
            if isinstance(value, str):
                yield ("monitors", i, key), value


def field_values(recipe: Any) -> Iterator[tuple[tuple[str, ...], str]]:
    """(field path, value) of every path-component field the recipe sets."""
    for path in PATH_COMPONENT_FIELDS:
        value = recipe
        for part in path:
            value = getattr(value, part, None)
        if isinstance(value, str):
            yield path, value
