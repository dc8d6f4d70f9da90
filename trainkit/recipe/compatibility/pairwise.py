"""A small deterministic all-pairs generator: rows that together contain every pair of values of
every two axes (the classic greedy construction, AETG-style, without randomness).

Why not the full product: 10 strategies x 8 options x 4 precisions x 4 models x 2 inits is 2,560
runs; beside the core grid every pair fits in ~60 rows (the strategy x option pairs are the lower
bound), and most interaction bugs (issue 26's crashes) are between two features.

Refusal-aware (`covering_rows`): a row `trainkit validate` refuses verifies none of its pairs, so every
row is an accepted combination, and a pair is left to the refused side only when every combination
holding it is refused (then one of those, refused for the fewest reasons, shows why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations, product
from typing import Callable, Iterable


def all_pairs(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """Rows {axis: value} covering every pair of values of any two axes; the same input gives the
    same rows, in the same order."""
    return covering_rows(axes, lambda row: ()).rows


def _pairs_of(row: dict[str, str], names: list[str]) -> set:
    return {(a, row[a], b, row[b]) for a, b in combinations(names, 2)}


Row = dict[str, str]
Pair = tuple[str, str, str, str]  # (axis, value, other axis, value), axes in declaration order


@dataclass
class Covering:
    rows: list[Row] = field(default_factory=list)  # accepted rows added to the given ones
    refused: dict[Pair, Row] = field(default_factory=dict)  # pairs no accepted row can hold -> a refused row


def covering_rows(axes: dict[str, list[str]], refusals: Callable[[Row], tuple], *,
                  given: Iterable[Row] = (), avoid: Callable[[Row], bool] = lambda row: False) -> Covering:
    """Accepted rows (`refusals(row)` empty) that, with the accepted `given` rows, hold every pair of values
    some accepted combination holds; each remaining pair with a refused row showing why. Greedy: the
    first uncovered pair, completed by the accepted row covering the most uncovered pairs, a row to
    `avoid` (accepted, but e.g. refused by the CI device) only where no other holds the pair; then rows
    whose pairs the others hold are dropped. Deterministic; `refusals` is asked once per row, and only of
    rows that could be chosen (the first accepted in that order), or all of a pair's when none is."""
    names = list(axes)
    memo: dict[tuple, tuple] = {}

    def refused(row: Row) -> tuple:
        key = tuple(row[a] for a in names)
        if key not in memo:
            memo[key] = tuple(refusals(row))
        return memo[key]

    uncovered = {(a, va, b, vb) for a, b in combinations(names, 2) for va, vb in product(axes[a], axes[b])}
    for row in given:
        if not refused(row):
            uncovered -= _pairs_of(row, names)
    out = Covering()
    while uncovered:
        pair = min(uncovered, key=lambda p: _pair_order(p, axes, names))
        candidates = _completions(pair, axes, names)
        gains = [len(_pairs_of(row, names) & uncovered) for row in candidates]
        ranked = sorted(range(len(candidates)), key=lambda i: (avoid(candidates[i]), -gains[i]))  # stable
        chosen = next((candidates[i] for i in ranked if not refused(candidates[i])), None)
        if chosen is None:
            out.refused[pair] = min(candidates, key=lambda row: len(refused(row)))
            uncovered.discard(pair)
            continue
        uncovered -= _pairs_of(chosen, names)
        out.rows.append(chosen)
    out.rows = _without_redundant(out.rows, [r for r in given if not refused(r)], names)
    return out


def _pair_order(pair: Pair, axes: dict[str, list[str]], names: list[str]) -> tuple:
    a, va, b, vb = pair
    return names.index(a), axes[a].index(va), names.index(b), axes[b].index(vb)


def _completions(pair: Pair, axes: dict[str, list[str]], names: list[str]) -> list[Row]:
    """Every row holding `pair`, in axis order."""
    a, va, b, vb = pair
    choices = [[va] if n == a else [vb] if n == b else axes[n] for n in names]
    return [dict(zip(names, values)) for values in product(*choices)]


def _without_redundant(rows: list[Row], given: list[Row], names: list[str]) -> list[Row]:
    """`rows` less each one (latest first) whose pairs the given and the remaining rows all hold."""
    kept = list(rows)
    for row in reversed(rows):
        others = [r for r in kept if r is not row] + given
        held = set().union(*(_pairs_of(r, names) for r in others)) if others else set()
        if _pairs_of(row, names) <= held:
            kept.remove(row)
    return kept
