"""The compatibility matrix (issue 26): the declared grid of combinations (`grid`), a deterministic,
refusal-aware all-pairs generator (`pairwise`), each cell's status from `trainkit validate`'s own rules
(`status`), the recorded verification results (`results`) and the generated docs/compatibility.md
(`page`).

Light like the rest of the recipe layer: no torch import. The runner that trains the cells is
`trainkit.runtime.cell_runner`; `python -m trainkit.recipe.compatibility --markdown` prints the page.
"""

from .grid import Cell, core_cells, declared_cells, pairwise_cells
from .status import Status, statuses

__all__ = ["Cell", "Status", "core_cells", "declared_cells", "pairwise_cells", "statuses"]
