"""The data folders a recipe reads exist, are readable, and have the expected layout.

The layout rules (class folders, images, CIFAR files) are preflight's, which `trainkit run` also
stops on; this adds existence and readability first (preflight assumes a folder it finds can be
listed) and says how to fix each case.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path
from typing import Optional

from .check import Check, failed, passed

ROOT_KEYS = ("root", "val_root")


def _fix(resolved, key: str, value: str) -> str:
    d = resolved.recipe.data
    where = f"data.{key} ({resolved.locate(('data', key))})"
    root = Path(value).expanduser()
    if not root.exists():
        return d.fix_missing_folder(value, where)
    if not os.access(root, os.R_OK | os.X_OK):
        return f"chmod -R u+rX {root} (or run as a user who can read it)"
    return d.fix_layout(root, where)


def data_root(resolved) -> Optional[Check]:
    if resolved is None:
        return None
    from ..runtime import preflight

    name = "data root"
    d = resolved.recipe.data
    keys = [k for k in ROOT_KEYS if isinstance(getattr(d, k, None), str)]
    if not keys:
        return passed(name, f"data '{d.name}' reads no files")
    found: list[tuple[str, str]] = []
    for key in keys:
        root = Path(getattr(d, key)).expanduser()
        if not root.exists():
            found.append((key, f"{root} does not exist" + (f" (absolute: {root.resolve()})" if not root.is_absolute() else "")))
        elif root.is_dir() and not os.access(root, os.R_OK | os.X_OK):
            found.append((key, f"{root} is not readable by user {getpass.getuser()}"))
    if not found:  # the layout rules are preflight's; it lists folders, so only once they are readable
        found = [(path[1], message) for path, message, severity in preflight._data(resolved.recipe)
                 if severity == "error" and path[:1] == ("data",) and path[1:2] and path[1] in keys]
    if found:
        detail = "; ".join(f"data.{key}: {message}" for key, message in found)
        return failed(name, detail, "; ".join(dict.fromkeys(_fix(resolved, k, getattr(d, k)) for k, _ in found)))
    return passed(name, ", ".join(f"data.{k} {getattr(d, k)}: readable" for k in keys)
                  + d.layout_note)
