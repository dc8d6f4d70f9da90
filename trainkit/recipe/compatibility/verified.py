"""Is a combination verified by the matrix, and if not, why: the question the doctor and the bottleneck
advice ask before they offer a mesh change (issue 30). Light (no torch): the grid's own axes, validate's
own rules (`status`) and the recorded results (docs/compatibility-results.json).

A combination is a grid cell's coordinates: strategy, model family, precision, performance option, init
and the mesh. The mesh is named by the dimensions a `parallel:` block gives more than one rank, as the
grid names its meshes (`meshes.py`): no dimension or dp_shard alone is the strategy's own layout
("none"), `tp` alone "tp", `dp_replicate` alone "replicate", `pp` alone "pp", pp x dp_shard x tp the 3-D
cell; any other set ("dp_replicate-dp_shard", HSDP; "dp_shard-tp", FSDP x TP) is named by its
dimensions and is in the matrix only once a cell declares it. A cell verifies the combination of
features, not their numbers (tp 2 and tp 4 are the same cell).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import yaml

from ... import registry
from ..blocks.strategy import MESH_DIMS
from ..problems import RecipeError
from ..resolver import resolve
from .grid import INITS, MODELS, OPTIONS, PRECISIONS, STRATEGIES, Cell, strategy_block
from .meshes import MESH_DEGREES, MESH_DIMENSION
from .results import load_results
from .status import refusals

VERIFIED, REFUSED, MISSING = "verified", "refused", "not in the matrix"

# a set of dimensions with more than one rank -> the grid's mesh name
_ONE_DIMENSION = {(dim,): mesh for mesh, dim in MESH_DIMENSION.items()}
_SEVERAL = {tuple(d for d in MESH_DIMS if degrees.get(d, 1) > 1): mesh for mesh, degrees in MESH_DEGREES.items()}


@dataclass(frozen=True)
class Verdict:
    status: str  # VERIFIED | REFUSED | MISSING
    cell: str  # the cell id the combination is (or would be)
    reason: str  # VERIFIED: where it was verified; REFUSED: validate's messages; MISSING: what is missing

    @property
    def verified(self) -> bool:
        return self.status == VERIFIED

    def text(self) -> str:
        return f"cell {self.cell}: {self.status} ({self.reason})"


def mesh_name(degrees: dict[str, int]) -> str:
    """The grid's name of a mesh with these degrees (dimension -> ranks; missing dimensions are 1)."""
    used = tuple(d for d in MESH_DIMS if degrees.get(d, 1) > 1)
    if used in ((), ("dp_shard",)):
        return "none"
    return _ONE_DIMENSION.get(used) or _SEVERAL.get(used) or "-".join(used)


def _declared_mesh(mesh: str) -> bool:
    return mesh == "none" or mesh in MESH_DIMENSION or mesh in MESH_DEGREES


def lookup(strategy: str, model: str, precision: str, degrees: dict[str, int], option: str = "none",
           init: Optional[str] = None, results: Optional[dict] = None) -> Verdict:
    """The matrix's answer for one combination, in the grid's axis values: verified on some device (a
    recorded run followed its reference), refused by `trainkit validate` (its messages), or not in the
    matrix (no such cell, or a cell accepted but never verified)."""
    init = init or MODELS.get(model, {}).get("core_init", "seeded")
    mesh = mesh_name(degrees)
    cell = Cell(strategy, model, precision, option, init, mesh)
    recorded = (load_results() if results is None else results).get(cell.id, {})
    verified_on = sorted(kind for kind, r in recorded.items() if r.get("result") == "verified")
    if verified_on:
        return Verdict(VERIFIED, cell.id, "verified on " + ", ".join(verified_on))
    known = strategy in STRATEGIES and model in MODELS and precision in PRECISIONS and option in OPTIONS \
        and init in INITS
    if not known or not _declared_mesh(mesh):
        what = f"mesh {mesh}" if known else "an axis value"
        return Verdict(MISSING, cell.id, f"the grid declares no cell with {what} (trainkit/recipe/compatibility/)")
    refused = refusals(cell)
    if refused:
        return Verdict(REFUSED, cell.id, "; ".join(refused))
    return Verdict(MISSING, cell.id, "accepted by validate but no recorded verification run")


# --------------------------------------------------------------------------- a resolved recipe's cell
def _holds(have: Any, fragment: Any) -> bool:
    if isinstance(fragment, dict):
        return isinstance(have, dict) and all(_holds(have.get(k), v) for k, v in fragment.items())
    return have == fragment


def _size(fragment: Any) -> int:
    return sum(1 + _size(v) for v in fragment.values()) if isinstance(fragment, dict) else 0


def _most_specific(dump: dict, fragments: dict[str, Any]) -> Optional[str]:
    """The axis value whose fragment the recipe holds, the largest one where several do (fsdp+cpu_offload
    over fsdp)."""
    held = [name for name, fragment in fragments.items() if _holds(dump, fragment)]
    return max(held, key=lambda name: _size(fragments[name]), default=None)


def _leaves(fragment: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in fragment.items():
        out += _leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and key != "activation_checkpointing" \
            else [prefix + key]
    return out


def _at(dump: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        dump = dump.get(part) if isinstance(dump, dict) else None
    return dump


def _resolved_dump(recipe: dict) -> Optional[dict]:
    with tempfile.TemporaryDirectory(prefix="trainkit-cell-") as folder:
        path = Path(folder) / "cell.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        try:
            return resolve(path).recipe.model_dump()
        except RecipeError:
            return None


def _holds_option(dump: dict, cell: Cell, fragment: dict) -> bool:
    """The recipe's values of the option's settings are those of the option's own cell, resolved (an
    activation_checkpointing mode, not only "some checkpointing"). A setting the cell resolves to a
    structure (compile's options) counts as held where the recipe's is one too."""
    option = _cell_dump(cell)
    if option is None:
        return False
    for key in _leaves(fragment):
        have, want = _at(dump, key), _at(option, key)
        if isinstance(want, dict) and key.endswith("activation_checkpointing"):
            if not isinstance(have, dict) or have.get("mode") != want.get("mode"):
                return False
        elif not isinstance(want, dict) and have != want:
            return False
    return True


@lru_cache(maxsize=None)
def _cell_dump(cell: Cell) -> Optional[dict]:
    return _resolved_dump(cell.recipe())


def _is_strategy(options: Any, fragment: dict) -> bool:
    """`options` is the strategy a grid fragment names -- by its options class, so that a plugin
    subclassing it (`my_fsdp` of FSDP) is that strategy's cell -- with the fragment's settings."""
    settings = {key: value for key, value in fragment.items() if key != "name"}
    return isinstance(options, registry.load("strategies", fragment["name"])) and \
        _holds(options.model_dump(), settings)


def grid_strategy(options: Any, model: str) -> Optional[str]:
    """The grid strategy these strategy options are, the most specific where several hold (fsdp+cpu_offload
    over fsdp); None where none does."""
    blocks = {s: strategy_block(s, model) for s in STRATEGIES}
    held = [s for s, block in blocks.items() if _is_strategy(options, block)]
    return max(held, key=lambda s: _size(blocks[s]), default=None)


def axes_of(recipe: Any) -> Optional[dict[str, str]]:
    """The grid's axis values (strategy, model, precision, option, init) of a resolved recipe, matched by
    the grid's own fragments; the option is each performance/trainer setting that differs from the
    grid's base cell. None where some axis has no value for this recipe (then it is not in the matrix)."""
    dump = recipe.model_dump()
    model = next((m for m, f in MODELS.items() if _holds(dump["model"], {"name": f["model"]["name"]})), None)
    if model is None:
        return None
    axes = {"model": model, "strategy": grid_strategy(recipe.strategy, model),
            "precision": _most_specific(dump, PRECISIONS), "init": _most_specific(dump, INITS)}
    if None in axes.values():
        return None
    base = _resolved_dump(Cell(axes["strategy"], model, axes["precision"], "none", axes["init"]).recipe())
    if base is None:
        return None
    # an option is held where the recipe has each of its settings as the option's own cell resolves them
    # (checkpointing "full" is not "selective", though both differ from the base)
    options = [name for name, fragment in OPTIONS.items() if fragment
               and all(_at(dump, key) != _at(base, key) for key in _leaves(fragment))
               and _holds_option(dump, Cell(axes["strategy"], model, axes["precision"], name, axes["init"]), fragment)]
    # an option of several (compile+checkpointing) stands for the single ones it holds
    options = [name for name in options if not any(other != name and _holds(OPTIONS[other], OPTIONS[name])
                                                   for other in options)]
    if len(options) > 1:  # a cell holds one option: several together are not a cell
        return None
    return {**axes, "option": options[0] if options else "none"}


def verdict_for(recipe: Any, degrees: dict[str, int], results: Optional[dict] = None, *,
                strategy: Optional[str] = None) -> Verdict:
    """The matrix's answer for `recipe` on a mesh of these degrees (the recipe's own axes, another mesh;
    `strategy`: another grid strategy, e.g. the memory plan's FSDP alternative to a DDP recipe)."""
    axes = axes_of(recipe)
    if axes is not None and strategy is not None:
        axes = {**axes, "strategy": strategy}
    if axes is None:
        return Verdict(MISSING, "-", f"no grid cell has this recipe's strategy, model, precision, init and "
                                     f"options together (trainkit/recipe/compatibility/grid.py)")
    return lookup(axes["strategy"], axes["model"], axes["precision"], degrees, axes["option"], axes["init"],
                  results)


__all__ = ["MISSING", "REFUSED", "VERIFIED", "Verdict", "axes_of", "grid_strategy", "lookup", "mesh_name",
           "verdict_for"]
