"""One plugin registry for models, datasets, strategies, monitors and tasks.

Built-ins and third-party plugins register the same way: Python entry points in the groups
``trainkit.models``, ``trainkit.datasets``, ``trainkit.strategies``, ``trainkit.monitors`` and
``trainkit.tasks``.
Listing names reads package metadata only; a plugin is imported when a recipe names it.

* datasets / strategies / monitors / tasks: the entry point names a pydantic options model with a
  ``name: Literal[...]`` tag and a ``component`` ClassVar ("module:attr") for the runtime piece.
* models: the entry point names the factory itself (called with the recipe's ``model.args``).

A recipe may also name a model by import path (`pkg.module:attr`); that object must be a
``torch.nn.Module`` subclass or a function marked with ``@model_factory`` (see
`trainkit.runtime.model`), so a recipe can never name `os:system`.
"""

from __future__ import annotations

import importlib
import re
from functools import lru_cache
from importlib.metadata import entry_points
from typing import Any

KINDS = ("models", "datasets", "strategies", "monitors", "tasks")
FACTORY_MARK = "__trainkit_model_factory__"
# the name pip installs trainkit under (`trainkit` on the package index is an unrelated project);
# plugins depend on it, and the built-in plugins are the entry points it declares
DISTRIBUTION = "trainkit-recipes"


class PluginError(Exception):
    """A plugin could not be imported or is malformed."""


@lru_cache(maxsize=None)
def _entry_points(kind: str) -> dict[str, Any]:
    found = {}
    for ep in entry_points(group=f"trainkit.{kind}"):
        found.setdefault(ep.name, ep)
    return found


def names(kind: str, builtin_only: bool = False) -> list[str]:
    """Registered plugin names of one kind, sorted (optionally only trainkit's own)."""
    eps = _entry_points(kind)
    return sorted(n for n, ep in eps.items() if not builtin_only or _distribution(ep) == DISTRIBUTION)


def _distribution(ep: Any) -> str:
    """The normalized name of the distribution that declares `ep` (PEP 503: `Trainkit_Recipes` is `trainkit-recipes`)."""
    dist = getattr(ep, "dist", None)
    return re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() if dist is not None else ""


@lru_cache(maxsize=None)
def load(kind: str, name: str) -> Any:
    """Import the object a plugin entry point names."""
    ep = _entry_points(kind).get(name)
    if ep is None:
        raise PluginError(f"no {kind[:-1]} plugin named '{name}' (registered: {', '.join(names(kind))})")
    try:
        return ep.load()
    except Exception as exc:  # a broken third-party plugin must not crash the CLI
        raise PluginError(f"{kind[:-1]} plugin '{name}' ({ep.value}) failed to import: "
                          f"{type(exc).__name__}: {exc}") from exc


def module_of(kind: str, name: str) -> str:
    """The module a plugin (or a `pkg.module:attr` model path) lives in, without importing it ("" if unknown)."""
    if ":" in name:
        return name.partition(":")[0]
    ep = _entry_points(kind).get(name)
    return ep.value.partition(":")[0] if ep is not None else ""


def model_factory(fn: Any) -> Any:
    """Mark a function as a trainkit model factory, so recipes may name it by import path.

    Plain functions are refused by default: a recipe is data, and `os:system` is a function too.
    """
    setattr(fn, FACTORY_MARK, True)
    return fn


def is_marked_factory(obj: Any) -> bool:
    return getattr(obj, FACTORY_MARK, False) is True


def import_path(spec: str) -> Any:
    """Resolve 'package.module:attr' (the form used by components and model factories)."""
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def component(options: Any) -> Any:
    """The runtime implementation behind a plugin options block."""
    return import_path(type(options).component)
