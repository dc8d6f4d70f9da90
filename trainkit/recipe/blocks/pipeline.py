"""The pipeline's options: what `validate`, `plan` and `tune` know about it (the component:
trainkit.strategies.pipeline).

Three layouts: one pipeline over the world (1-D), `data_parallel` replicas of it (pp x dp_replicate,
gradients averaged by the strategy), and sharded stages (a `parallel:` block with pp > 1 and dp_shard
and/or tp above 1, torchtitan's 3-D: each stage tensor-parallel on "tp" and `fully_shard`ed over
"dp_shard"). `sharded_stages` tells them apart; the rules say what the third cannot do.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator, Literal, Optional

from pydantic import Field, PositiveInt

from ..model_facts import facts_for
from .base import Finding
from .strategy import FLOAT8_NOT_VERIFIED, SYNC_BATCHNORM_NEEDS_DDP, Capabilities, MemoryLayout, ParallelDims, StrategyOptions


class PipelineOptions(StrategyOptions):
    """torch.distributed.pipelining: the model split into stages, one per rank."""

    component: ClassVar[str] = "trainkit.strategies.pipeline:PipelineStrategy"
    name: Literal["pipeline"]
    microbatches: PositiveInt = Field(default=4, description="micro-batches each batch is split into")
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(default="1f1b", description="pipeline schedule")
    split_points: list[str] = Field(
        default_factory=list, description="module names where a new stage begins (empty: balance by parameters)"
    )
    data_parallel: PositiveInt = Field(
        default=1, description="replicas of the whole pipeline, each reading its own share of the data (2-D: "
                               "world size = data_parallel x ranks per pipeline; gradients all-reduced per stage)")
    init_order: ClassVar[int] = 3

    @classmethod
    def init_note(cls, world_size: int) -> str:
        return f"pipeline: the model split into {world_size} stage(s), one per GPU; each batch in 4 micro-batches"

    @classmethod
    def init_block(cls, world_size: int, model: str) -> str:
        return (f"{{name: {cls.plugin_name()}, microbatches: 4, schedule: 1f1b"
                + _split_points_yaml(model, world_size) + "}")

    def capabilities(self) -> Capabilities:
        # stage files follow the stage count, which is the world size: no resharding on load (sharded stages'
        # DCP checkpoints would reshard, but the options cannot tell the layouts apart: another strategy, e.g.
        # fsdp, loads them on any mesh)
        # no fp16 loss scaling across stages: fp16 is refused by `validate` (the precision rule)
        # channels_last: a traced ResNet's stage sent its NHWC activation and torch's P2P send refused it
        # ("input tensor has to be contiguous"; found by the compatibility grid)
        return Capabilities(splits_model=True, reshards_on_load=False,
                            effect="per-rank parameters, optimizer state and activations ~ 1/stages (each rank "
                                   "holds its stages)",
                            pretrained_load_refusal="its stages are re-built modules whose parameter names are not "
                            "the checkpoint's (not built yet)",
                            background_save_refusal="the pipeline writes its checkpoint itself (one file per "
                                                    "stage, or, for sharded stages, DCP with one optimizer group "
                                                    "naming the whole model), with no background write",
                            precisions=frozenset({"fp32", "bf16"}),
                            mesh_dims=frozenset({"pp", "dp_replicate", "dp_shard", "tp"}),
                            unsupported_performance={**SYNC_BATCHNORM_NEEDS_DDP, "float8": FLOAT8_NOT_VERIFIED,
                                                     "channels_last": (
                                "torch.distributed.pipelining sends activations between stages with P2P send/recv, "
                                "which need contiguous tensors, and a channels_last activation is not; set it to "
                                "false (or use ddp, fsdp or deepspeed for channels_last)")})

    def parallel_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_replicate=self.data_parallel, pp=max(1, world_size // self.data_parallel))

    def memory_layout(self, world_size: int) -> MemoryLayout:
        # each rank holds its stage's layers (balanced by parameters) and their activations
        stages = self.parallel_dims(world_size).pp
        return MemoryLayout(parameters=stages, gradients=stages, optimizer=stages, parameters_split=stages,
                            builds_whole_model=stages > 1)

    def memory_layout_on(self, dims: ParallelDims) -> MemoryLayout:
        # sharded stages: a stage's parameters, gradients and optimizer state divided over dp_shard (FSDP);
        # tensor parallel's slice is divided by the memory plan
        split, shards = dims.pp, dims.dp_shard
        return MemoryLayout(parameters=split * shards, gradients=split * shards, optimizer=split * shards,
                            parameters_split=split, gathers_units=shards > 1, unit_gradients_whole=shards > 1,
                            builds_whole_model=split > 1)

    def plan_lines(self, recipe: Any) -> list[str]:
        ws = recipe.world_size
        stages = recipe.parallel_dims(ws).pp if ws is not None else "?"
        count = self.replicas(recipe)
        replicas = f", {count} pipeline replicas" if count > 1 else ""
        lines = [f"pipeline:        {stages} stages{replicas}, {self.microbatches} microbatches, "
                 f"schedule {self.schedule}"]
        if ws is not None and sharded_stages(recipe.parallel_dims(ws)):
            dims = recipe.parallel_dims(ws)
            lines.append(f"  each stage:    tensor parallel over tp {dims.tp}, fully_shard over dp_shard "
                         f"{dims.dp_shard}; checkpoints: DCP, original parameter names")
        return lines

    def rules(self, recipe: Any) -> Iterator[Finding]:
        s, r = self, recipe
        yield from self._agrees_with_the_mesh(r)
        yield from self._sharded_stages_rules(r)
        if r.data.batch_size % s.microbatches:
            yield ("strategy", "microbatches"), (
                f"data.batch_size {r.data.batch_size} is not divisible by strategy.microbatches {s.microbatches}; "
                f"each micro-batch must be whole (e.g. batch_size "
                f"{s.microbatches * max(1, r.data.batch_size // s.microbatches)})")
        gb = r.global_batch
        if gb is not None and gb % s.microbatches and not r.data.batch_size % s.microbatches:
            yield ("strategy", "microbatches"), (
                f"global batch {gb} (batch_size x data-parallel size x grad_accum_steps) is not divisible by "
                f"{s.microbatches} microbatches")
        ws = r.world_size
        if ws is not None and r.parallel is None and ws % s.data_parallel:  # a parallel block checks its own
            yield ("strategy", "data_parallel"), (
                f"data_parallel {s.data_parallel} does not divide the world size {ws}: each of the "
                f"{s.data_parallel} pipeline replicas needs the same number of ranks")
            return
        ranks = None if ws is None else r.parallel_dims(ws).pp  # ranks per pipeline
        count = s.replicas(r)
        per = f" (world size {ws} / {count} pipeline replicas)" if count > 1 else " (the world size)"
        facts = facts_for(r.model.name)
        if facts.needs_split_points and not s.split_points:
            yield ("strategy", "split_points"), (
                f"the pipeline traces {r.model.name} (not an nn.Sequential) and cuts it only at named split points; "
                + _split_points_fix(ranks, facts.split_point_example))
        if s.schedule == "interleaved_1f1b" and ranks is not None and s.split_points \
                and (len(s.split_points) + 1) % ranks:
            yield ("strategy", "split_points"), (
                f"interleaved_1f1b places several stages on each rank: {len(s.split_points) + 1} stages "
                f"do not divide evenly over {ranks} ranks per pipeline{per}")
        if ranks is not None and s.split_points and s.schedule != "interleaved_1f1b" \
                and len(s.split_points) + 1 != ranks:
            yield ("strategy", "split_points"), (
                f"{len(s.split_points)} split points make {len(s.split_points) + 1} stages, but a pipeline has "
                f"{ranks} ranks{per}, one stage per rank; use {ranks - 1} split points or change "
                f"launch.nproc_per_node")

    def replicas(self, recipe: Any) -> int:
        """The pipeline replicas: the layout's dp_replicate (`Recipe.parallel_dims`: a `parallel:` block's
        degree when the recipe has one, else `data_parallel`, its alias; the runtime reads the same)."""
        ws = recipe.world_size
        return recipe.parallel_dims(ws).dp_replicate if ws else self.data_parallel

    def _agrees_with_the_mesh(self, r: Any) -> Iterator[Finding]:
        """`data_parallel` and a `parallel:` block's dp_replicate name one number (the pipeline replicas):
        left out, the block's degree is used; written in both places with different values, the recipe
        says two things and is refused."""
        if r.parallel is None or "data_parallel" not in self.model_fields_set:
            return
        replicas = r.parallel.dp_replicate
        if replicas == -1:
            replicas = r.parallel_dims(r.world_size).dp_replicate if r.world_size else None
        if replicas is not None and replicas != self.data_parallel:
            yield ("strategy", "data_parallel"), (
                f"strategy.data_parallel {self.data_parallel} and parallel.dp_replicate {replicas} both give the "
                f"pipeline replicas, differently; leave strategy.data_parallel out (parallel.dp_replicate sets it), "
                f"or set it to {replicas}")


    def _sharded_stages_rules(self, r: Any) -> Iterator[Finding]:
        """What the sharded-stages layout (pp x dp_shard x tp) does not do. Ran with it and equal to one
        process (tests/test_pipeline_3d_runs.py): 1f1b and interleaved_1f1b, grad_clip, full activation
        checkpointing, evaluation; compile under tp is refused by the mesh rules, fp16 by the precisions."""
        ws = r.world_size
        if r.parallel is None or ws is None:
            return
        dims = r.parallel_dims(ws)
        if not sharded_stages(dims):
            return
        mesh = " x ".join(f"{d} {n}" for d, n in dims.degrees().items() if n > 1)
        if dims.pp == 1:
            yield ("parallel", "pp"), (
                f"strategy pipeline with {mesh} and parallel.pp 1 is one stage: nothing is pipelined; use strategy "
                f"fsdp for dp_shard and tp alone, or set parallel.pp to the number of stages")
        if facts_for(r.model.name).needs_split_points:
            yield ("parallel",), (
                f"the traced pipeline ({r.model.name}, not an nn.Sequential) with {mesh} is refused: sharded stages "
                f"are cut from an nn.Sequential's blocks (each stage the model with only its blocks, under their own "
                f"names), and traced stages are not sharded; set parallel.dp_shard: 1 and parallel.tp: 1, or use "
                f"strategy fsdp")
        if dims.dp_replicate > 1:
            yield ("parallel", "dp_replicate"), (
                f"strategy pipeline with {mesh}: replicas of sharded stages (HSDP inside the pipeline) are not "
                f"verified; set parallel.dp_replicate: 1, or drop dp_shard and tp "
                f"for pipeline replicas")


def sharded_stages(dims: ParallelDims) -> bool:
    """The pipeline's third layout: stages tensor-parallel and/or sharded with FSDP (torchtitan's 3-D)."""
    return dims.dp_shard > 1 or dims.tp > 1


def _split_points_yaml(model: str, stages: int) -> str:
    """`, split_points: [...]` for a model the pipeline can only cut at named modules (validate refuses
    it without them); empty for one it splits by itself. ValueError where none are known for `stages`."""
    facts = facts_for(model)
    if not facts.needs_split_points:
        return ""
    names = facts.split_points_for(stages)
    if names is None:
        raise ValueError(f"the pipeline cuts {model} only at named split points, and init knows none for "
                         f"{stages} stage(s); choose another strategy, or write strategy.split_points yourself "
                         "(docs/strategies.md, Pipeline parallel)")
    return f", split_points: [{', '.join(names)}]"


def _split_points_fix(ranks: Optional[int], example: str) -> str:
    """What to write instead of no split points, for `ranks` ranks per pipeline (None: unknown)."""
    if ranks == 1:
        return ("with one rank per pipeline there is nothing to cut: use ddp, fsdp or deepspeed for data "
                "parallelism alone, or give each pipeline more ranks and name split points")
    count = "the module names" if ranks is None else f"{ranks - 1} module name" + ("s" if ranks > 2 else "")
    return (f"set strategy.split_points to {count} where a new stage begins, in forward order"
            + (f" (e.g. [{example}] for 2 stages)" if example else ""))
