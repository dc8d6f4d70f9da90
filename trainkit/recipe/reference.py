"""The recipe reference (docs/reference.md), generated from the schema so it cannot drift.

Regenerate with `trainkit schema --markdown > docs/reference.md`; a test fails when the
committed file differs from what the schema says.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .. import registry
from .blocks import (
    CheckpointOptions, LaunchOptions, ModelSpec, ParallelOptions, PerformanceOptions, SchedulerOptions, SGDOptions,
    AdamOptions, TrackingOptions, TrainerOptions,
)
from .schema import PLUGIN_FIELDS, Recipe

HEADER = """# Recipe reference

Generated from the schema by `trainkit schema --markdown` — do not edit by hand.
It lists trainkit's built-in plugins; `trainkit schema --markdown --all` adds the installed third-party ones.
Every block rejects unknown keys. Plugin blocks (`data`, `strategy`, `monitors`) choose their
options model by `name`; third-party plugins add sections here once installed.
"""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if isinstance(a, str) else str(a) for a in args)
    if origin is typing.Union:
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp)).replace("Annotated", "")


def _default(field: Any) -> str:
    if field.default is not PydanticUndefined:
        return f"`{field.default!r}`".replace("'", '"') if field.default is not None else "`null`"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(factory)"
        return "(block defaults)" if isinstance(value, BaseModel) else f"`{value!r}`".replace("'", '"')
    return "**required**"


def _table(model: type[BaseModel], skip: tuple[str, ...] = ()) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        desc = (field.description or "").replace("|", "\\|")
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            desc = desc or f"see `{name}` below"
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | {desc} |")
    return rows


def _summary(doc: str) -> str:
    """A docstring's first paragraph on one line (its first line alone may stop mid-sentence)."""
    return " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())


def reference_markdown(builtin_only: bool = True) -> str:
    out = [HEADER, "## Top level", ""]
    out += _table(Recipe, skip=("data", "strategy", "monitors"))
    out += ["| `data` | plugin block | **required** | see Datasets |",
            "| `strategy` | plugin block | **required** | see Strategies |",
            "| `monitors` | list of plugin blocks | `[]` | see Monitors; a bare name means default options |",
            "| `defaults` | list[str] | `[]` | recipe files merged under this one, paths relative to it |", ""]
    for title, model in (("model", ModelSpec), ("optimizer: sgd", SGDOptions), ("optimizer: adam / adamw", AdamOptions),
                         ("scheduler", SchedulerOptions), ("trainer", TrainerOptions),
                         ("trainer.checkpoint", CheckpointOptions), ("launch", LaunchOptions),
                         ("parallel", ParallelOptions),
                         ("performance", PerformanceOptions), ("tracking", TrackingOptions)):
        out += [f"## `{title}`", ""]
        if model.__doc__:
            out += [_summary(model.__doc__), ""]
        out += _table(model) + [""]
    titles = {"data": "Datasets", "strategy": "Strategies", "monitors": "Monitors", "task": "Tasks"}
    for block, kind in PLUGIN_FIELDS.items():
        out += [f"## {titles[block]} (`{block}`)", ""]
        for name in registry.names(kind, builtin_only=builtin_only):
            model = registry.load(kind, name)
            out += [f"### `{block}: {{name: {name}}}`", ""]
            if model.__doc__:
                out += [_summary(model.__doc__), ""]
            out += _table(model, skip=("name",)) + [""]
    out += ["## Models (`model.name`)", "",
            "`torchvision.<name>` (any torchvision classification model, no weight download), an import path "
            "`package.module:factory`, or a registered model plugin: "
            + ", ".join(f"`{n}`" for n in registry.names("models", builtin_only=builtin_only)) + ".", ""]
    return "\n".join(out)
