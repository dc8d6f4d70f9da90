"""Runtime checks run before any worker starts (`trainkit run`, `plan`, `validate --deep`).

The schema says a recipe is well-formed; these checks say it can run here: the data exists, the
model can be built, the batch fits the dataset, and the devices/backends it asks for exist.
Each check returns Problems located at the recipe line that set the offending value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .. import registry
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
    from .data import IMAGE_EXTENSIONS, scan_imagefolder

    d = r.data
    if d.num_workers == 0 and d.prefetch_factor is not None:
        yield ("data", "prefetch_factor"), "prefetch_factor needs num_workers > 0 (DataLoader rejects it)", "error"
    if d.num_workers == 0 and d.persistent_workers:
        yield ("data", "persistent_workers"), "persistent_workers needs num_workers > 0", "warning"
    if d.name == "imagefolder":
        for key in ("root", "val_root"):
            value = getattr(d, key)
            if value is None:
                continue
            root = Path(value).expanduser()
            if not root.is_dir():
                yield ("data", key), f"data folder not found: {root} (absolute: {root.resolve()}); " \
                    f"make a small one with `trainkit data make-imagefolder {value}`", "error"
                continue
            classes, samples = scan_imagefolder(root)
            if not classes:
                yield ("data", key), f"{root} has no class sub-folders (expected {root}/<class>/<image>)", "error"
            elif not samples:
                yield ("data", key), f"{root} has {len(classes)} class folders but no images " \
                    f"({', '.join(IMAGE_EXTENSIONS)})", "error"
    elif d.name == "cifar10":
        folder = Path(d.root).expanduser() / "cifar-10-batches-py"
        missing = [n for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if not (folder / n).is_file()]
        if missing:
            yield ("data", "root"), f"CIFAR-10 not found: {folder} lacks {', '.join(missing)} (trainkit never " \
                f"downloads; unpack cifar-10-python.tar.gz into {Path(d.root).expanduser()})", "error"


def _batch_fits(r) -> Iterator[Finding]:
    from .data import dataset_size

    dp = r.data_parallel_size
    if dp is None:
        return
    n = dataset_size(r.data)
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
    if spec.weights and not Path(spec.weights).expanduser().is_file():
        yield ("model", "weights"), f"weights file not found: {spec.weights} (weights are never downloaded; " \
            f"give a local state_dict file)", "error"


# --------------------------------------------------------------------------- language models
def _hf_config(r):
    """(model_type, the transformers config the recipe builds) or raise LookupError with a message."""
    config = dict(r.model.args.get("config") or {})
    model_type = config.pop("model_type", None)
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    except ImportError:
        raise LookupError("model hf_causal_lm needs Hugging Face transformers: pip install 'trainkit[hf]'") from None
    if model_type not in CONFIG_MAPPING_NAMES:
        known = sorted(CONFIG_MAPPING_NAMES)
        raise LookupError(f"unknown Hugging Face model_type '{model_type}'{did_you_mean(str(model_type), known)} "
                          f"({len(known)} known to transformers, e.g. llama, gpt2, qwen2, mistral)")
    return CONFIG_MAPPING[model_type](**config)


def model_vocab_and_positions(r):
    """(vocabulary size, longest sequence) of the recipe's language model, None where unknown."""
    if r.model.name == "transformer":
        return r.model.args.get("vocab_size"), r.model.args.get("seq_len", 512)
    if r.model.name == "hf_causal_lm":
        from ..models.hf import max_positions

        config = _hf_config(r)
        return getattr(config, "vocab_size", None), max_positions(config.to_dict())
    return None, None


def _language_model(r) -> Iterator[Finding]:
    """Text data and LM models: files, the tokenizer against the model's vocabulary, the JSONL field,
    the Hugging Face model type and its maximum length."""
    try:
        vocab, longest = model_vocab_and_positions(r)
    except LookupError as exc:
        path = ("model", "args", "config", "model_type") if "model_type" in str(exc) else ("model", "name")
        yield path, str(exc), "error"
        vocab = longest = None
    except Exception as exc:  # transformers rejected the config values
        yield ("model", "args", "config"), f"{type(exc).__name__}: {exc}", "error"
        vocab = longest = None
    d = r.data
    if r.model.name == "hf_causal_lm" and isinstance(longest, int) and getattr(d, "seq_len", 0) > longest:
        yield ("data", "seq_len"), f"seq_len {d.seq_len} is longer than the model's maximum {longest} " \
            f"(its config's position embeddings)", "error"
    if d.name != "text":
        return
    from .text_data import file_format, iter_jsonl_missing_field, tokenizer_vocab_size

    generated = d.generate is not None
    for key in ("files", "eval_files"):
        for i, f in enumerate(getattr(d, key)):
            if not Path(f).expanduser().is_file() and not generated:
                yield ("data", key, i), f"text file not found: {f} (absolute: {Path(f).expanduser().resolve()}); " \
                    f"or set data.generate to write a synthetic corpus there", "error"
    present = [f for f in [*d.files, *d.eval_files] if Path(f).expanduser().is_file()]
    jsonl = [f for f in present if file_format(f, d.format) == "json"]
    for f, line in iter_jsonl_missing_field(jsonl, d.text_field):
        yield ("data", "text_field"), f"{f}:{line}: the record has no field '{d.text_field}'; set " \
            f"data.text_field to the field that holds the text", "error"
    tokenizer = Path(d.tokenizer).expanduser()
    ids = None
    if tokenizer.is_file():
        try:
            ids = tokenizer_vocab_size(str(tokenizer))
        except Exception as exc:
            yield ("data", "tokenizer"), f"{tokenizer} is not a tokenizers file: {type(exc).__name__}: {exc}", "error"
    elif generated:
        ids = d.generate.vocab_size
    else:
        yield ("data", "tokenizer"), f"tokenizer file not found: {d.tokenizer} (absolute: {tokenizer.resolve()}); " \
            f"train one with `trainkit data train-tokenizer {' '.join(d.files)} --out {d.tokenizer} " \
            f"--vocab-size {vocab or 32000}`", "error"
    if ids is not None and isinstance(vocab, int) and ids > vocab:
        where = "data.generate.vocab_size" if not tokenizer.is_file() else f"the tokenizer {d.tokenizer}"
        yield ("data", "tokenizer"), f"{where} has {ids} tokens but the model's vocabulary has {vocab}: " \
            f"token ids past {vocab - 1} have no embedding; use a model vocab_size >= {ids} or another " \
            f"tokenizer", "error"


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
    hook = getattr(r.strategy, "comm_hook", "none")
    import torch

    from .accelerator import AcceleratorError, accelerator_for

    try:
        backend = accelerator_for(r, cuda_available=torch.cuda.is_available()).device_backend
    except AcceleratorError:  # reported by _devices
        return
    if hook == "bf16_compress" and backend == "gloo":
        error = _probe_hook_on_gloo("bf16_compress_hook")
        if error:
            yield ("strategy", "comm_hook"), f"bf16_compress does not work on gloo with this torch " \
                f"({error}); use fp16_compress or none", "error"
    if hook == "powersgd" and backend == "gloo":
        yield ("strategy", "comm_hook"), "powersgd on gloo is known to fail or hang with several gradient " \
            "buckets (pytorch#58467); it is only reliable here for small models", "warning"


def _strategy_checks(r) -> Iterator[Finding]:
    """The strategy class's own checks (split points exist, DeepSpeed config parses, ...)."""
    try:
        cls = registry.component(r.strategy)
    except Exception:  # reported by _strategy
        return
    hook = getattr(cls, "preflight", None)
    if hook is not None:
        yield from hook(r)


_PROBE = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = DDP(torch.nn.Linear(4, 2))
model.register_comm_hook(None, getattr(default_hooks, sys.argv[1]))
model(torch.ones(2, 4)).sum().backward()
dist.barrier(); dist.destroy_process_group()
"""


def _probe_hook_on_gloo(name: str) -> str:
    """Run one backward through a 1-process gloo DDP with the hook (in a child process, so this
    process never joins a process group); '' if it works, else the error's last line."""
    import subprocess
    import sys

    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, name], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "the probe timed out"
    if proc.returncode == 0:
        return ""
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"
