"""The recorded verification results (docs/compatibility-results.json, written by the grid test with
TRAINKIT_GRID_RECORD set): what the last run on each kind of device found for each cell. The page
shows them; the pairs generator steers clear of what the CPU's preflight refused."""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[3] / "docs" / "compatibility-results.json"


def load_results(path: Path = RESULTS) -> dict[str, Any]:
    """{cell id: {device kind: record}}: what the last verification run found for each cell."""
    return json.loads(path.read_text())["cells"] if path.is_file() else {}


def refused_on(kind: str, rows: list[dict[str, str]], ids: list[str], results: dict[str, Any]) -> set[tuple]:
    """Pairs (axis, value, axis, value) that `trainkit run`'s preflight refused on `kind` in every one of
    `rows` (cells with these `ids`) holding them that was run there: e.g. DeepSpeed with fp16 on the CPU."""
    seen: dict[tuple, bool] = {}
    for row, cell_id in zip(rows, ids):
        record = results.get(cell_id, {}).get(kind)
        if record is None:
            continue
        for a, b in combinations(row, 2):
            pair = (a, row[a], b, row[b])
            seen[pair] = seen.get(pair, True) and record["result"] == "refused"
    return {pair for pair, always in seen.items() if always}
