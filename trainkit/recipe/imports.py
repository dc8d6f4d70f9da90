"""What a recipe may name by import path, decided without importing anything.

`model.name: pkg.module:attr` is the only import path a recipe can write (datasets, strategies and
monitors are entry points). Plain `trainkit validate` never imports it; `validate --deep`, `plan`,
`doctor` and `run` import the module and then check the object is a model factory
(`trainkit.runtime.model.factory`). Standard-library modules are refused here, before any import:
no model lives there, and `os:system`, `subprocess:call` or `builtins:eval` must never be imported
on a recipe's say-so.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_import_path(name: str) -> bool:
    return bool(IMPORT_PATH.fullmatch(name))


def refusal(name: str) -> Optional[str]:
    """Why an import-path model name is refused before importing it, or None."""
    module = name.partition(":")[0]
    top = module.split(".", 1)[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "__main__":
        return (f"'{name}' names the standard-library module '{top}', which holds no model factory; "
                f"an import path must name a torch.nn.Module subclass or a function marked "
                f"@trainkit.model_factory")
    return None
