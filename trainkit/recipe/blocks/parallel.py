"""The `parallel:` block: the device mesh a run lays its ranks out on (issue 30).

Four named dimensions, in torchtitan's order ("pp", "dp_replicate", "dp_shard", "tp"); their degrees
multiply to the world size, and one of them may be -1, inferred from the world size and the others
(as torchtitan's `ParallelDims` and Accelerate's `ParallelismConfig` do). Without the block, the
strategy lays the world out as it always has (`StrategyOptions.parallel_dims`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .base import Block
from .strategy import MESH_DIMS, ParallelDims

INFERRED = -1


class ParallelOptions(Block):
    """The degree of each mesh dimension; -1: inferred, world size / the product of the others."""

    dp_replicate: int = Field(default=1, description="replicas holding the same parameters, each reading its own "
                                                     "data (DDP, HSDP's replicate dimension, pipeline replicas); "
                                                     "-1: inferred")
    dp_shard: int = Field(default=INFERRED, description="ranks sharding the parameters, each reading its own data "
                                                        "(FSDP, ZeRO); -1: inferred from the world size (the "
                                                        "default, unless another dimension is -1: then 1)")
    tp: int = Field(default=1, description="tensor-parallel ranks splitting every layer (DTensor); they read the "
                                           "same data; the model must declare a tensor-parallel plan; -1: inferred")
    pp: int = Field(default=1, description="pipeline stages (strategy pipeline); they read the same data; "
                                           "-1: inferred")

    @model_validator(mode="before")
    @classmethod
    def _shard_unless_another_is_inferred(cls, data: Any) -> Any:
        """dp_shard's default -1 gives way when the user puts the -1 on another dimension ({tp: -1} means
        dp_shard 1), so that only -1s the user wrote can collide."""
        if isinstance(data, dict) and "dp_shard" not in data and INFERRED in data.values():
            return {**data, "dp_shard": 1}
        return data

    @field_validator("dp_replicate", "dp_shard", "tp", "pp")
    @classmethod
    def _positive_or_inferred(cls, value: int) -> int:
        if value < 1 and value != INFERRED:
            raise PydanticCustomError("mesh_degree", "a degree is a whole number >= 1, or -1 to infer it from the "
                                                     "world size")
        return value

    @model_validator(mode="after")
    def _one_inferred(self) -> "ParallelOptions":
        inferred = [d for d in MESH_DIMS if getattr(self, d) == INFERRED]
        if len(inferred) > 1:
            raise PydanticCustomError("mesh_inferred", "at most one dimension may be -1 (inferred), got {dims}; give "
                                                       "all but one of them a number", {"dims": " and ".join(inferred)})
        return self

    def degrees(self) -> dict[str, int]:
        """Each dimension's degree as written (-1 where inferred), in mesh order."""
        return {d: getattr(self, d) for d in MESH_DIMS}

    def inferred(self) -> Optional[str]:
        """The dimension whose degree is inferred, if any."""
        return next((d for d, n in self.degrees().items() if n == INFERRED), None)

    def known_product(self) -> int:
        """The product of the degrees written as numbers."""
        return math.prod(n for n in self.degrees().values() if n != INFERRED)

    def dims(self, world_size: int) -> ParallelDims:
        """The layout of `world_size` ranks; an inferred degree is world_size // the others (validation
        refuses a world size they do not divide, so that remainder never reaches a run)."""
        degrees = self.degrees()
        name = self.inferred()
        if name is not None:
            degrees[name] = max(1, world_size // self.known_product())
        return ParallelDims(**degrees)
