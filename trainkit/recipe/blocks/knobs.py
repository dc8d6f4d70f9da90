"""A knob `trainkit tune` can try: which recipe key it sets and which values to try.

Defined in the recipe layer (no torch) so that the options class of a strategy can own its knobs
(`StrategyOptions.tune_knobs`): a strategy plugin that subclasses a built-in one inherits them.
The table of general knobs and the tuner live in `trainkit.launch`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

Values = Callable[[Any, dict], list[Any]]  # (recipe, machine facts) -> values to try (not the current one)
Applies = Callable[[Any, dict], Optional[str]]  # -> why it does not apply, or None


@dataclass(frozen=True)
class Knob:
    name: str
    path: str  # the recipe key it sets
    values: Values
    owner: Optional[type] = None  # the strategy options class it belongs to (None: any strategy)
    semantic: Optional[str] = None  # "batch" | "precision": changes training itself; needs --allow
    applies: Optional[Applies] = None
    also: Callable[[Any, Any], dict[str, Any]] = field(default=lambda recipe, value: {})  # coupled keys
    note: Callable[[Any, Any], str] = field(default=lambda recipe, value: "")  # the semantic change, in words


def get(recipe: Any, path: str) -> Any:
    """The recipe's value at a dotted key (None where the recipe has no such key)."""
    value: Any = recipe
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def flip(path: str, to: bool) -> Values:
    """Values for a boolean knob: `to`, unless the recipe has it already."""
    return lambda recipe, facts: [to] if get(recipe, path) != to else []
