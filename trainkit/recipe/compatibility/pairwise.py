"""A small deterministic all-pairs generator: rows that together contain every pair of values of
every two axes (the classic greedy construction, AETG-style, without randomness).

Why not the full product: 10 strategies x 7 options x 4 precisions x 4 models x 2 inits is 2,240
runs; every pair fits in ~70 rows (the product of the two largest axes is the lower bound), and
most interaction bugs (issue 26's crashes) are between two features.
"""

from __future__ import annotations

from itertools import combinations, product


def all_pairs(axes: dict[str, list[str]]) -> list[dict[str, str]]:
    """Rows {axis: value} covering every pair of values of any two axes; the same input gives the
    same rows, in the same order."""
    names = list(axes)
    uncovered = {(a, va, b, vb) for a, b in combinations(names, 2) for va, vb in product(axes[a], axes[b])}
    rows: list[dict[str, str]] = []
    while uncovered:
        a, va, b, vb = min(uncovered, key=lambda p: (names.index(p[0]), axes[p[0]].index(p[1]),
                                                     names.index(p[2]), axes[p[2]].index(p[3])))
        row = {a: va, b: vb}
        for axis in names:  # each remaining axis: the value covering the most still-uncovered pairs
            if axis not in row:
                row[axis] = max(axes[axis], key=lambda v: (_gain(row, axis, v, uncovered), -axes[axis].index(v)))
        uncovered -= _pairs_of(row, names)
        rows.append({axis: row[axis] for axis in names})
    return rows


def _gain(row: dict[str, str], axis: str, value: str, uncovered: set) -> int:
    return sum(((a, row[a], axis, value) in uncovered) or ((axis, value, a, row[a]) in uncovered) for a in row)


def _pairs_of(row: dict[str, str], names: list[str]) -> set:
    return {(a, row[a], b, row[b]) for a, b in combinations(names, 2)}
