"""The `Recipe`: one frozen, fully typed object that every later component receives.

Plugin blocks (data, strategy, monitors) are discriminated unions on `name` whose members come
from the registry. To keep `trainkit validate` fast and plugins lazily imported, a recipe is
validated against a model built from only the plugins it names; `trainkit schema` builds the
model from every registered plugin.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, create_model

from .. import registry
from .blocks import (
    AdamOptions,
    Block,
    ClassificationTaskOptions,
    LaunchOptions,
    ModelSpec,
    OptimizerOptions,
    ParallelDims,
    ParallelOptions,
    PerformanceOptions,
    PluginBlock,
    SchedulerOptions,
    SGDOptions,
    TrackingOptions,
    TrainerOptions,
)

PLUGIN_FIELDS = {"data": "datasets", "strategy": "strategies", "monitors": "monitors", "task": "tasks"}
Precision = Literal["fp32", "fp16", "bf16"]


class Recipe(Block):
    """Typed view shared by every concrete recipe model (the plugin blocks are narrowed there)."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$", max_length=100,
                      description="run name: letters, digits, '.', '_' and '-'")
    seed: int = Field(default=0, description="base random seed (each rank derives its own)")
    model: ModelSpec
    task: Any = Field(default_factory=lambda: ClassificationTaskOptions(name="classification"),
                      description="what is learned: classification (default), causal_lm, or a task plugin")
    data: Any
    strategy: Any
    parallel: Optional[ParallelOptions] = Field(
        default=None, description="the device mesh: degrees of dp_replicate, dp_shard, tp, pp (absent: the "
                                  "strategy lays the world out itself)")
    precision: Precision = Field(default="fp32", description="fp32 | fp16 (with loss scaling) | bf16")
    optimizer: Annotated[OptimizerOptions, Field(discriminator="name")] = Field(
        default_factory=lambda: SGDOptions(name="sgd", lr=0.1))
    scheduler: SchedulerOptions = Field(default_factory=SchedulerOptions)
    trainer: TrainerOptions
    launch: LaunchOptions = Field(default_factory=LaunchOptions)
    performance: PerformanceOptions = Field(default_factory=PerformanceOptions)
    monitors: list[Any] = Field(default_factory=list, description="monitor plugins, by name or {name: ..., options}")
    tracking: TrackingOptions = Field(default_factory=TrackingOptions)

    # ---- derived facts used by plan, the launcher and the loop
    @property
    def world_size(self) -> Optional[int]:
        nnodes = self.launch.nnodes
        if isinstance(nnodes, str):
            return None  # elastic: known only at rendezvous
        return self.launch.nproc_per_node * nnodes

    def parallel_dims(self, world_size: int) -> ParallelDims:
        """How `world_size` ranks are laid out: the `parallel:` block's degrees when given, else the
        strategy's own layout. Everything that needs the layout (global batch, plan, runtime) asks this."""
        if self.parallel is not None:
            return self.parallel.dims(world_size)
        return self.strategy.parallel_dims(world_size)

    @property
    def data_parallel_size(self) -> Optional[int]:
        ws = self.world_size
        if ws is None:
            return None
        return self.parallel_dims(ws).dp

    @property
    def global_batch(self) -> Optional[int]:
        dp = self.data_parallel_size
        return None if dp is None else self.global_batch_at(dp)

    def global_batch_at(self, data_parallel_size: int) -> int:
        """Samples per optimizer step with `data_parallel_size` data-parallel ranks: the one global-batch
        formula (plan, the loop, the bottleneck report, throughput and DeepSpeed's config use it)."""
        return self.data.batch_size * data_parallel_size * self.trainer.grad_accum_steps


def _union(options: list[type[PluginBlock]]) -> Any:
    if len(options) == 1:
        return options[0]
    return Annotated[Union[tuple(options)], Field(discriminator="name")]


@lru_cache(maxsize=64)
def recipe_model(datasets: tuple[str, ...], strategies: tuple[str, ...], monitors: tuple[str, ...]) -> type[Recipe]:
    """A Recipe model whose plugin blocks accept exactly the named (registered) plugins."""
    data_t = _union([registry.load("datasets", n) for n in datasets])
    strategy_t = _union([registry.load("strategies", n) for n in strategies])
    fields: dict[str, Any] = {"data": (data_t, ...), "strategy": (strategy_t, ...), "task": (
        task_union(), Field(default_factory=lambda: ClassificationTaskOptions(name="classification"),
                            description="what is learned: classification (default), causal_lm, or a task plugin"))}
    if monitors:
        fields["monitors"] = (list[_union([registry.load("monitors", n) for n in monitors])],
                              Field(default_factory=list, description="monitor plugins"))
    return create_model("Recipe", __base__=Recipe, **fields)


def task_union() -> Any:
    """Every registered task whose options import (task options are light pydantic models; a broken
    third-party task is left out here and reported as unknown only if a recipe names it)."""
    options = []
    for name in registry.names("tasks"):
        try:
            options.append(registry.load("tasks", name))
        except registry.PluginError:
            continue
    return _union(options or [ClassificationTaskOptions])


def full_recipe_model() -> type[Recipe]:
    """The model with every registered plugin (for `trainkit schema`)."""
    return recipe_model(tuple(registry.names("datasets")), tuple(registry.names("strategies")),
                        tuple(registry.names("monitors")))


__all__ = ["Recipe", "recipe_model", "full_recipe_model", "PLUGIN_FIELDS", "AdamOptions"]
