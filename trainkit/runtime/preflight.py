"""Runtime checks run before any worker starts (`trainkit run`, `plan`, `validate --deep`).

The schema says a recipe is well-formed; these checks say it can run here: the data exists, the
model can be built, the batch fits the dataset, and the devices/backends it asks for exist.
Each check returns Problems located at the recipe line that set the offending value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .. import registry
from ..recipe.model_facts import facts_for
from ..recipe.paths import read_path_shown
from ..recipe.problems import Problem, did_you_mean

Finding = tuple[tuple, str, str]  # (path, message, severity)


def check(resolved) -> list[Problem]:
    """Every runtime problem of a resolved recipe (errors and warnings)."""
    recipe = resolved.recipe
    out: list[Problem] = []
    for fn in (_data, _model, _language_model, _batch_fits, _devices, _strategy, _strategy_checks):
        for path, message, severity in fn(recipe):
            out.append(Problem(resolved.locate(path), ".".join(map(str, path)), _with_origin(resolved, path, message),
                               severity))
    return out


def _with_origin(resolved, path: tuple, message: str) -> str:
    """A value produced by `${...}` (often an environment variable's default) says so: the fix is
    usually to set the variable, not to edit the file."""
    origin = resolved.origin(path) if hasattr(resolved, "origin") else ""
    if not origin:
        return message
    what, _, other_fix = message.partition("; ")
    return f"{what}; {origin}" + (f"; or {other_fix}" if other_fix else "")


# --------------------------------------------------------------------------- data
def _data(r) -> Iterator[Finding]:
    """The dataset's own checks of what it reads: its options' (files and folders, light) and then
    its component's (`preflight` on the builder, where it needs the runtime, e.g. tokenizers)."""
    yield from r.data.preflight()
    try:
        builder = registry.component(r.data)
    except Exception:  # a dataset that cannot be imported fails when the run builds it, with its error
        return
    hook = getattr(builder, "preflight", None)
    if hook is not None:
        yield from hook(r)


def _batch_fits(r) -> Iterator[Finding]:
    dp = r.data_parallel_size
    if dp is None:
        return
    n = r.data.train_size()
    if not n:  # unknown, or already reported as missing
        return
    per_rank = -(-n // dp)  # DistributedSampler pads each rank's share up to ceil(n / dp)
    if r.data.drop_last and r.data.batch_size > per_rank:
        yield ("data", "batch_size"), (
            f"batch_size {r.data.batch_size} per device x {dp} data-parallel ranks needs "
            f"{r.data.batch_size * dp} samples per step, but the dataset has only {n} ({per_rank} per rank): "
            f"with drop_last every epoch has zero batches; use batch_size <= {per_rank}, fewer ranks, "
            f"or data.drop_last: false"), "error"


# --------------------------------------------------------------------------- model
def model_problems(resolved) -> list[Problem]:
    """The factory rule alone (`trainkit doctor` applies it before building anything)."""
    return [Problem(resolved.locate(path), ".".join(map(str, path)), message, severity)
            for path, message, severity in _model(resolved.recipe)]


def _model(r) -> Iterator[Finding]:
    from .model import NotAModelFactory, factory

    spec = r.model
    name = spec.name
    if name.startswith("torchvision.") and ":" not in name:
        import torchvision

        known = torchvision.models.list_models(module=torchvision.models)
        short = name.split(".", 1)[1]
        if short not in known:
            hint = did_you_mean(short, known).replace("'", "'torchvision.", 1)
            yield ("model", "name"), f"torchvision has no classification model '{short}'{hint} " \
                f"({len(known)} available, e.g. torchvision.resnet18, torchvision.vit_b_16)", "error"
    else:
        try:
            factory(name)
        except (registry.PluginError, NotAModelFactory) as exc:
            yield ("model", "name"), str(exc), "error"
        except Exception as exc:  # ImportError, AttributeError, or whatever the module raised on import
            yield ("model", "name"), f"cannot import model factory '{name}': {type(exc).__name__}: {exc}", "error"
    from ..recipe.model_facts import facts_for

    for where, message in facts_for(name).missing_inputs(dict(spec.args)):
        yield ("model", "args", *where), message, "error"
    if spec.weights and not Path(spec.weights).expanduser().is_file():
        yield ("model", "weights"), f"weights file not found: {read_path_shown(spec.weights)} (weights are never " \
            f"downloaded; give a local state_dict file)", "error"


# --------------------------------------------------------------------------- language models
def model_vocab_and_positions(r):
    """(vocabulary size, longest sequence) of the recipe's model, None where unknown (its facts).

    Raises:
        LookupError: the model's library does not know what the args name.
    """
    return facts_for(r.model.name).vocab_and_positions(r.model.args)


def _language_model(r) -> Iterator[Finding]:
    """The model's declared vocabulary and maximum length against the data's sequences."""
    if facts_for(r.model.name).missing_inputs(dict(r.model.args)):
        return  # its config is in what is missing (`_model` says so)
    try:
        vocab, longest = model_vocab_and_positions(r)
    except LookupError as exc:
        path = ("model", "args", "config", "model_type") if "model_type" in str(exc) else ("model", "name")
        yield path, str(exc), "error"
        return
    except Exception as exc:  # the model's library rejected the args
        yield ("model", "args", "config"), f"{type(exc).__name__}: {exc}", "error"
        return
    seq_len = getattr(r.data, "seq_len", 0)
    facts = facts_for(r.model.name)
    if isinstance(longest, int) and seq_len > longest and facts.max_positions(r.model.args) is None:
        # the rules did not see this maximum (it comes from the library's defaults): say it here
        yield ("data", "seq_len"), f"seq_len {seq_len} is longer than the model's maximum {longest} " \
            f"(its config's position embeddings)", "error"


# --------------------------------------------------------------------------- devices and backends
def _devices(r) -> Iterator[Finding]:
    """GPU checks follow `accelerator_for`, the same decision the worker makes (gloo runs on the
    CPU even where CUDA is visible). fp16 runs on the CPU too (slow; for testing loss scaling)."""
    import torch

    from .accelerator import AcceleratorError, accelerator_for

    try:
        acc = accelerator_for(r, cuda_available=torch.cuda.is_available())
    except AcceleratorError as exc:
        yield ("launch", "backend"), str(exc).replace("launch.backend: ", "", 1), "error"
        return
    if acc.device_type == "cuda" and r.launch.nproc_per_node > torch.cuda.device_count():
        yield ("launch", "nproc_per_node"), (
            f"nproc_per_node {r.launch.nproc_per_node} but only {torch.cuda.device_count()} GPU(s) are visible "
            f"(one process per GPU)"), "error"
    if r.performance.sync_batchnorm and acc.device_type == "cpu" and r.world_size != 1:
        yield ("performance", "sync_batchnorm"), "torch's SyncBatchNorm runs only on GPUs (DDP refuses it on " \
            "the CPU); set it to false here", "error"
    compile_options = r.performance.compile_options
    if compile_options is not None and compile_options.mode == "reduce-overhead" and acc.device_type == "cpu":
        yield ("performance", "compile", "mode"), "reduce-overhead uses CUDA graphs, which the CPU does not have; " \
            "use mode default", "warning"
    if r.performance.float8 and acc.device_type == "cuda":
        capability = torch.cuda.get_device_capability(acc.device)
        if capability < (8, 9):
            yield ("performance", "float8"), (
                f"float8 matmuls need a GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(acc.device)} is {capability[0]}.{capability[1]}: set performance.float8: "
                "false"), "error"
    if r.performance.float8 and acc.device_type == "cpu":
        yield ("performance", "float8"), "float8 on the CPU computes correctly but slower than bf16 (torch's CPU " \
            "float8 matmul has no matrix-unit kernel); it is meant for testing a GPU recipe", "warning"
    if r.precision == "fp16" and acc.device_type == "cpu":
        yield ("precision",), "fp16 on the CPU is slow (no fp16 matrix units); it is meant for testing loss " \
            "scaling: use bf16 or fp32 for real CPU training", "warning"


def _strategy(r) -> Iterator[Finding]:
    try:
        registry.component(r.strategy)
    except Exception as exc:
        yield ("strategy", "name"), f"strategy '{r.strategy.name}' cannot be loaded here " \
            f"({type(exc).__name__}: {exc})", "error"
        return


def _strategy_checks(r) -> Iterator[Finding]:
    """The strategy class's own checks (split points exist, DeepSpeed config parses, ...), and that an
    explicit `trainer.resume: PATH` holds a checkpoint this strategy wrote."""
    try:
        cls = registry.component(r.strategy)
    except Exception:  # reported by _strategy
        return
    hook = getattr(cls, "preflight", None)
    if hook is not None:
        yield from hook(r)
    yield from _resume_source_fits(r, cls)


def _resume_source_fits(r, cls) -> Iterator[Finding]:
    """`trainer.resume: PATH` of a checkpoint another strategy wrote fails on every rank (its files are not
    where this strategy reads them): refused before launch, naming the strategy that wrote it and the way
    to start from its weights instead."""
    if r.trainer.resume in ("auto", "never"):
        return
    folder = Path(r.trainer.resume).expanduser()
    if not folder.is_dir():
        yield ("trainer", "resume"), f"checkpoint folder not found: {r.trainer.resume} (absolute: " \
            f"{folder.resolve()})", "error"
        return
    if cls.owns_checkpoint(folder):
        return
    writers = []
    for name in registry.names("strategies"):
        try:
            other = registry.import_path(registry.load("strategies", name).component)
        except Exception:  # a plugin that cannot be imported here wrote nothing we could tell
            continue
        if other is not cls and other.owns_checkpoint(folder):
            writers.append(name)
    written_by = f"strategy {' or '.join(writers)}" if writers else "no strategy trainkit knows"
    yield ("trainer", "resume"), (
        f"{r.trainer.resume} was written by {written_by}, not by {r.strategy.name}, whose checkpoints it cannot "
        f"read; resume with the strategy that wrote it, or start from its weights: `trainkit export "
        f"{r.trainer.resume} model.pt`, then model.weights: model.pt and trainer.resume: never"), "error"
