"""Recipe fields that become path components, listed in one place, and the rule they obey.

A value here is joined under a folder trainkit writes (`<launch.run_dir>/<name>/`, torchelastic's
`logs/<rdzv_id>_*`), so it must be one plain name: no path separator, no `..`, no NUL or control
character. Otherwise a recipe could make a run write outside its run directory. `launch.run_dir`
itself is the declared parent and may be any path. MLflow experiment and run names are not path
components (MLflow files artifacts under ids), nor are profiler/report/export file names (trainkit
builds those from ranks and steps; `trainkit export` takes its target on the command line).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

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
    return None


def field_values(recipe: Any) -> Iterator[tuple[tuple[str, ...], str]]:
    """(field path, value) of every path-component field the recipe sets."""
    for path in PATH_COMPONENT_FIELDS:
        value = recipe
        for part in path:
            value = getattr(value, part, None)
        if isinstance(value, str):
            yield path, value
