"""Rules that span several fields, checked before launch instead of failing at step 500.

Each rule is a small function taking the typed Recipe and yielding (path, message). Rules here
need no heavy imports; checks that need torch/DeepSpeed live in `deep_checks`.
"""

from __future__ import annotations

from typing import Callable, Iterator

from . import paths
from .schema import Recipe

Finding = tuple[tuple, str]
RULES: list[Callable[[Recipe], Iterator[Finding]]] = []


def rule(fn: Callable[[Recipe], Iterator[Finding]]) -> Callable[[Recipe], Iterator[Finding]]:
    RULES.append(fn)
    return fn


def check(recipe: Recipe) -> list[Finding]:
    return [finding for fn in RULES for finding in fn(recipe)]


@rule
def fp16_needs_loss_scaling(r: Recipe) -> Iterator[Finding]:
    if r.precision == "fp16" and r.trainer.loss_scale is None:
        yield ("trainer", "loss_scale"), ("fp16 without loss scaling lets small gradients underflow to zero; "
                                          "set trainer.loss_scale: dynamic (or use precision: bf16)")


@rule
def seeded_init_has_no_weights_file(r: Recipe) -> Iterator[Finding]:
    if r.model.init == "seeded" and r.model.weights:
        yield ("model", "init"), ("seeded draws fresh initial weights, and model.weights loads them from a "
                                  "file: remove one (with weights, leave init at auto)")


@rule
def skip_step_needs_a_loop_owned_optimizer_step(r: Recipe) -> Iterator[Finding]:
    if r.trainer.on_nonfinite == "skip_step" and r.strategy.name == "deepspeed":
        yield ("trainer", "on_nonfinite"), ("skip_step discards an optimizer step before it runs, but DeepSpeed's "
                                            "engine owns its step (and skips fp16 overflows itself); use stop")


@rule
def pipeline_batch_splits_into_microbatches(r: Recipe) -> Iterator[Finding]:
    s = r.strategy
    if s.name != "pipeline":
        return
    if r.data.batch_size % s.microbatches:
        yield ("strategy", "microbatches"), (
            f"data.batch_size {r.data.batch_size} is not divisible by strategy.microbatches {s.microbatches}; "
            f"each micro-batch must be whole (e.g. batch_size {s.microbatches * max(1, r.data.batch_size // s.microbatches)})")
    gb = r.global_batch
    if gb is not None and gb % s.microbatches and not r.data.batch_size % s.microbatches:
        yield ("strategy", "microbatches"), (
            f"global batch {gb} (batch_size x data-parallel size x grad_accum_steps) is not divisible by "
            f"{s.microbatches} microbatches")
    ws = r.world_size
    if ws is not None and ws % s.data_parallel:
        yield ("strategy", "data_parallel"), (
            f"data_parallel {s.data_parallel} does not divide the world size {ws}: each of the {s.data_parallel} "
            f"pipeline replicas needs the same number of ranks")
        return
    ranks = None if ws is None else ws // s.data_parallel  # ranks per pipeline
    per = f" (world size {ws} / data_parallel {s.data_parallel})" if s.data_parallel > 1 else " (the world size)"
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


@rule
def deepspeed_options_are_consistent(r: Recipe) -> Iterator[Finding]:
    s = r.strategy
    if s.name != "deepspeed":
        return
    if s.offload_param != "none" and s.zero_stage != 3:
        yield ("strategy", "offload_param"), (
            f"parameter offload needs zero_stage 3 (got zero_stage {s.zero_stage})")
    if s.offload_optimizer != "none" and s.zero_stage == 0:
        yield ("strategy", "offload_optimizer"), "optimizer offload needs zero_stage 1, 2 or 3 (got 0)"
    owned = {
        "train_batch_size": "data.batch_size and trainer.grad_accum_steps",
        "train_micro_batch_size_per_gpu": "data.batch_size",
        "gradient_accumulation_steps": "trainer.grad_accum_steps",
        "gradient_clipping": "trainer.grad_clip",
        "fp16": "precision", "bf16": "precision",
        "optimizer": "optimizer", "scheduler": "scheduler",
    }
    for key in s.config:
        if key in owned:
            yield ("strategy", "config", key), f"set by the recipe, not the pass-through config: use {owned[key]}"
    zero = s.config.get("zero_optimization", {})
    if isinstance(zero, dict) and "stage" in zero:
        yield ("strategy", "config", "zero_optimization", "stage"), "use strategy.zero_stage"


@rule
def loader_options_need_workers(r: Recipe) -> Iterator[Finding]:
    d = r.data
    if d.num_workers == 0 and d.prefetch_factor is not None:
        yield ("data", "prefetch_factor"), "prefetch_factor needs num_workers > 0 (set num_workers, or remove it)"
    if d.num_workers == 0 and d.persistent_workers:
        yield ("data", "persistent_workers"), "persistent_workers needs num_workers > 0"


@rule
def schedule_fits_training(r: Recipe) -> Iterator[Finding]:
    sc, t = r.scheduler, r.trainer
    if sc.warmup_steps >= t.max_steps and sc.warmup_steps > 0:
        yield ("scheduler", "warmup_steps"), (
            f"warm-up ({sc.warmup_steps} steps) must be shorter than training (trainer.max_steps {t.max_steps})")
    if sc.name == "step" and sc.step_size is None:
        yield ("scheduler", "step_size"), "scheduler 'step' needs step_size (steps between decays)"
    if sc.name != "step" and sc.step_size is not None:
        yield ("scheduler", "step_size"), f"step_size only applies to scheduler 'step' (got '{sc.name}')"


@rule
def trainer_intervals(r: Recipe) -> Iterator[Finding]:
    t = r.trainer
    if t.resume not in ("auto", "never") and not t.resume.strip():
        yield ("trainer", "resume"), "resume is auto, never, or a checkpoint folder path"
    if t.eval_every is not None and r.data.name == "imagefolder" and r.data.val_root is None:
        yield ("trainer", "eval_every"), "evaluation needs data.val_root (a folder of held-out images)"


@rule
def multi_node_needs_rendezvous(r: Recipe) -> Iterator[Finding]:
    l = r.launch
    nnodes = l.nnodes
    if isinstance(nnodes, str):
        parts = nnodes.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or int(parts[0]) > int(parts[1]):
            yield ("launch", "nnodes"), f"got '{nnodes}'; use a number or 'MIN:MAX' with 0 < MIN <= MAX, e.g. '1:4'"
            return
    multi = not (nnodes == 1 or nnodes == "1:1")
    if multi and l.rdzv_endpoint is None and l.cluster == "none":  # otherwise a cluster may supply it at run time
        yield ("launch", "rdzv_endpoint"), "several nodes need a rendezvous endpoint HOST:PORT reachable from all of them"
    if l.rdzv_endpoint is not None and not _host_port(l.rdzv_endpoint):
        yield ("launch", "rdzv_endpoint"), f"got '{l.rdzv_endpoint}'; expected HOST:PORT, e.g. node0.cluster:29400"
    if l.rdzv_backend == "static" and multi and l.node_rank is None:
        yield ("launch", "node_rank"), "static rendezvous needs each node's node_rank"


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


@rule
def monitor_ranks_exist(r: Recipe) -> Iterator[Finding]:
    ws = r.world_size
    for i, m in enumerate(r.monitors):
        for rank in getattr(m, "ranks", []) or []:
            if ws is not None and rank >= ws:
                yield ("monitors", i, "ranks"), f"rank {rank} does not exist: world size is {ws}"


@rule
def path_components_stay_inside_the_run_dir(r: Recipe) -> Iterator[Finding]:
    for path, value in paths.field_values(r):
        why = paths.problem(value)
        if why:
            yield path, why + " (the run must write only inside its run directory)"


# ----------------------------------------------------------------------------- language models
def _declared_max_positions(r: Recipe):
    """The longest sequence the recipe's model is built for, when the recipe says it."""
    args = r.model.args
    if r.model.name == "transformer":
        return args.get("seq_len", 512)
    if r.model.name == "hf_causal_lm" and isinstance(args.get("config"), dict):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            if isinstance(args["config"].get(key), int):
                return args["config"][key]
    return None


@rule
def text_data_fits_the_task_and_model(r: Recipe) -> Iterator[Finding]:
    d = r.data
    if d.name == "text" and r.task.name == "classification":
        yield ("data", "name"), ("text data yields token sequences, not (input, label) pairs, so it cannot train "
                                 "task classification (the default); set task: {name: causal_lm}")
    seq_len = getattr(d, "seq_len", None)
    longest = _declared_max_positions(r)
    if isinstance(seq_len, int) and isinstance(longest, int) and seq_len > longest:
        key = "seq_len" if r.model.name == "transformer" else "config"
        yield ("data", "seq_len"), (f"seq_len {seq_len} is longer than the model's maximum {longest} "
                                    f"(model.args.{key}); use seq_len <= {longest} or a longer model")
    if d.name == "text" and d.generate is not None:
        if len(d.files) != 1:
            yield ("data", "files"), "data.generate writes one training file: list exactly one in data.files"
        if len(d.eval_files) > 1:
            yield ("data", "eval_files"), "data.generate writes one held-out file: list at most one in data.eval_files"


@rule
def pipeline_needs_a_sequential_model(r: Recipe) -> Iterator[Finding]:
    if r.strategy.name == "pipeline" and r.model.name == "hf_causal_lm":
        yield ("strategy", "name"), ("the pipeline strategy splits an nn.Sequential of blocks at module names; a "
                                     "Hugging Face model is not one, so it cannot be pipelined here: use ddp, fsdp or "
                                     "deepspeed, or the built-in model 'transformer' (splits at layers.N)")


@rule
def performance_options_fit_the_strategy(r: Recipe) -> Iterator[Finding]:
    p, s = r.performance, r.strategy
    if p.sync_batchnorm and s.name != "ddp":
        yield ("performance", "sync_batchnorm"), (
            f"sync_batchnorm is for strategy ddp (got {s.name}): "
            + ("FSDP2 does not synchronise BatchNorm buffers through SyncBatchNorm's process group; "
               if s.name == "fsdp" else "")
            + "set it to false, or use strategy ddp")
    ac = p.checkpointing
    fsdp_flag = s.name == "fsdp" and getattr(s, "activation_checkpointing", False)
    if p.compile_options is not None and (ac.mode != "none" or fsdp_flag):
        yield ("performance", "compile"), (
            "compile together with activation checkpointing is not supported: trainkit checkpoints blocks with "
            "hooks (torch.distributed._composable.checkpoint), which torch.compile cannot trace; use one of them")
    if fsdp_flag and ac.mode != "none":
        yield ("strategy", "activation_checkpointing"), (
            "set either the deprecated strategy.activation_checkpointing or performance.activation_checkpointing, "
            "not both")
    if ac.mode == "full" and ac.every_n_blocks != 1:
        yield ("performance", "activation_checkpointing", "every_n_blocks"), (
            "every_n_blocks applies to mode selective (full checkpoints every block)")
    if p.channels_last and r.data.name == "synthetic" and len(r.data.shape) != 3:
        yield ("performance", "channels_last"), (
            f"channels_last needs 4-D inputs (batch, channels, height, width); data.shape {list(r.data.shape)} "
            f"makes {len(r.data.shape) + 1}-D batches: set it to false, or use a [C, H, W] shape")
