"""Rules that span several fields, checked before launch instead of failing at step 500.

Each rule is a small function taking the typed Recipe and yielding (path, message). Rules here
need no heavy imports; checks that need torch/DeepSpeed live in `deep_checks`.
"""

from __future__ import annotations

import importlib.util

from typing import Callable, Iterator

from . import mesh_rules, paths
from .model_facts import facts_for, unknown_arguments
from .blocks import Finding
from .schema import Recipe

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
def seeded_init_needs_a_seedable_model(r: Recipe) -> Iterator[Finding]:
    why = facts_for(r.model.name).not_seedable
    if r.model.init == "seeded" and why:
        yield ("model", "init"), f"model {r.model.name} cannot be seeded: {why}"


@rule
def skip_step_needs_a_loop_owned_optimizer_step(r: Recipe) -> Iterator[Finding]:
    if r.trainer.on_nonfinite == "skip_step" and r.strategy.capabilities().owns_optimizer_step:
        yield ("trainer", "on_nonfinite"), (f"skip_step discards an optimizer step before it runs, but strategy "
                                            f"{r.strategy.name}'s engine owns its step (and skips fp16 overflows "
                                            f"itself); use stop")


@rule
def plugin_blocks_own_rules(r: Recipe) -> Iterator[Finding]:
    """The strategy's and the dataset's own rules (each options class owns its checks; a plugin
    that subclasses a built-in inherits them)."""
    yield from r.strategy.rules(r)
    yield from r.data.rules(r)


@rule
def mesh_fits_the_world_the_strategy_and_the_model(r: Recipe) -> Iterator[Finding]:
    """The `parallel:` block's rules (trainkit.recipe.mesh_rules)."""
    yield from mesh_rules.findings(r)


@rule
def precision_fits_the_strategy(r: Recipe) -> Iterator[Finding]:
    supported = r.strategy.capabilities().precisions
    if r.precision not in supported:
        yield ("precision",), (f"strategy {r.strategy.name} does not train in {r.precision}; use one of "
                               f"{', '.join(sorted(supported))}")


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


@rule
def written_paths_stay_where_writing_is_allowed(r: Recipe) -> Iterator[Finding]:
    for path, value in paths.written_values(r):
        why = paths.written_path_problem(value)
        if why:
            yield path, why


# ----------------------------------------------------------------------------- language models
@rule
def sequence_fits_the_model(r: Recipe) -> Iterator[Finding]:
    seq_len = getattr(r.data, "seq_len", None)
    facts = facts_for(r.model.name)
    longest = facts.max_positions(r.model.args)
    if isinstance(seq_len, int) and isinstance(longest, int) and seq_len > longest:
        yield ("data", "seq_len"), (f"seq_len {seq_len} is longer than the model's maximum {longest} "
                                    f"(model.args.{facts.positions_key}); use seq_len <= {longest} or a longer model")


@rule
def model_args_are_usable(r: Recipe) -> Iterator[Finding]:
    """The model family's own checks of its args (a pretrained directory's files, config and format), and a
    strategy that cannot read pretrained weights into the model it holds."""
    facts = facts_for(r.model.name)
    for where, message in unknown_arguments(facts, r.model.name, dict(r.model.args)) + \
            facts.args_problems(dict(r.model.args)):
        yield ("model", "args", *where), message
    why = r.strategy.capabilities().pretrained_load_refusal
    if facts.loads_pretrained(dict(r.model.args)) and why:
        yield ("strategy", "name"), (f"strategy {r.strategy.name} cannot read pretrained weights: {why}; use ddp or "
                                     "fsdp (with a parallel: mesh for HSDP or tensor parallel)")


@rule
def quantized_base_fits_the_run(r: Recipe) -> Iterator[Finding]:
    """QLoRA (a frozen NF4 base under LoRA adapters): where the strategy holds the NF4 base whole (DDP) or
    shards it over one dimension as NF4 (FSDP2, torchao's all-gather extension)."""
    quantized = facts_for(r.model.name).quantized_base(dict(r.model.args))
    if not quantized:
        return
    where = ("model", "args", "lora", "quantize_base")
    why = r.strategy.capabilities().quantized_base_refusal
    if why:
        yield where, (f"quantize_base: {quantized} with strategy {r.strategy.name} is refused: {why}; use strategy ddp "
                      "(one process or data parallel), or drop quantize_base")
    # the resolved degrees (-1 takes the ranks left over); an elastic world, unknown here: any degree but 1
    dims = r.parallel_dims(r.world_size) if r.parallel is not None and r.world_size else None
    tp = dims.tp if dims else (r.parallel.tp if r.parallel is not None else 1)
    replicas = dims.dp_replicate if dims else (r.parallel.dp_replicate if r.parallel is not None else 1)
    if tp != 1:
        yield where, (f"quantize_base: {quantized} with tensor parallel is refused: an NF4 weight cannot be split "
                      "into DTensor shards here; set parallel.tp: 1, or drop quantize_base")
    elif replicas != 1 and r.strategy.capabilities().shards_parameters:
        yield where, (f"quantize_base: {quantized} with HSDP (parallel.dp_replicate > 1) is refused: not verified "
                      "(the NF4 base is sharded over one mesh dimension, as torchtune does); set "
                      "parallel.dp_replicate: 1, or drop quantize_base")
    if r.model.init == "seeded":
        yield ("model", "init"), (f"quantize_base: {quantized} builds the model whole and quantizes each adapted "
                                  "weight from its values before any sharding, so model.init seeded cannot apply; "
                                  "leave init at auto (or constructor)")
    if r.performance.compile:
        yield where, (f"quantize_base: {quantized} with performance.compile is refused: not verified (torchao's NF4 "
                      "linear under dynamo); set performance.compile: false")


@rule
def split_strategies_need_a_splittable_model(r: Recipe) -> Iterator[Finding]:
    if r.strategy.capabilities().splits_model and not facts_for(r.model.name).splits_into_stages:
        yield ("strategy", "name"), (f"the {r.strategy.name} strategy splits an nn.Sequential of blocks at module "
                                     f"names; {r.model.name} is not one, so it cannot be pipelined here: use a "
                                     f"strategy that keeps the model whole (ddp, fsdp or deepspeed), or the "
                                     f"built-in model 'transformer' (splits at layers.N)")


@rule
def background_save_fits_the_strategy(r: Recipe) -> Iterator[Finding]:
    why = r.strategy.capabilities().background_save_refusal
    if r.trainer.checkpoint.async_save and why:
        yield ("trainer", "checkpoint", "async_save"), (
            f"strategy {r.strategy.name} cannot save in the background: {why}; set trainer.checkpoint.async_save: "
            "false (ddp and fsdp save in the background)")


@rule
def performance_options_fit_the_strategy(r: Recipe) -> Iterator[Finding]:
    p, s = r.performance, r.strategy
    defaults = type(p)()
    for option, why in s.capabilities().unsupported_performance.items():
        if getattr(p, option, None) != getattr(defaults, option, None):
            yield ("performance", option), f"{option} is not supported by strategy {s.name}: {why}"
    if p.float8 and r.precision != "bf16":
        yield ("performance", "float8"), (
            f"float8 linears run inside bf16 autocast (torchao's float8 training: the other ops, the master weights "
            f"and the optimizer stay as with bf16); precision is {r.precision}: set precision: bf16")
    if p.float8 and importlib.util.find_spec("torchao") is None:
        yield ("performance", "float8"), "float8 linears need torchao: pip install torchao"
    ac = p.checkpointing
    if ac.mode == "full" and ac.every_n_blocks != 1:
        yield ("performance", "activation_checkpointing", "every_n_blocks"), (
            "every_n_blocks applies to mode selective (full checkpoints every block)")
