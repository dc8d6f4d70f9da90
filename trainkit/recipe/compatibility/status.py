"""A cell's status, asked of the product: `trainkit validate`'s own resolution of the cell's recipe
(schema, then the rules each strategy and option class owns). Refused cells carry validate's
messages; every other cell is expected to train, and the verification runner checks that it does."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import yaml

from ..problems import RecipeError
from ..resolver import resolve

if TYPE_CHECKING:  # grid asks this module for refusals while declaring its cells
    from .grid import Cell


@dataclass(frozen=True)
class Status:
    cell: Cell
    refusals: tuple[str, ...]  # validate's messages ("field: message"); empty: expected to train

    @property
    def refused(self) -> bool:
        return bool(self.refusals)


def statuses(cells: Iterable[Cell]) -> list[Status]:
    """Each cell's status, from validating its recipe exactly as `trainkit validate FILE` would."""
    with tempfile.TemporaryDirectory(prefix="trainkit-grid-") as folder:
        return [_status(cell, Path(folder)) for cell in cells]


def refusals(cell: Cell) -> tuple[str, ...]:
    """validate's messages for one cell (empty: accepted)."""
    return statuses([cell])[0].refusals


def _status(cell: Cell, folder: Path) -> Status:
    path = folder / f"{cell.id}.yaml"
    path.write_text(yaml.safe_dump(cell.recipe(), sort_keys=False))
    try:
        resolve(path)
    except RecipeError as exc:
        return Status(cell, tuple(f"{p.path}: {p.message}" if p.path else p.message
                                  for p in exc.problems if p.severity == "error"))
    return Status(cell, ())
