"""`trainkit init`: a few answers -> a commented recipe that validates (like `accelerate config`).

Each answer comes from a flag, else from `ask(question, default)`, else (with --yes) the default.
The recipe is written, then resolved like any other: what `init` writes always validates.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .. import registry
from ..machine import data_workers_per_rank, usable_cores, visible_gpus
from .problems import RecipeError

Ask = Optional[Callable[[str, str], str]]
PRECISIONS = ("fp32", "bf16", "fp16")


class InitError(Exception):
    """An answer trainkit cannot turn into a recipe, or a file it will not overwrite."""


def _answer(value, ask: Ask, question: str, default: str, check: Callable[[str], Optional[str]] = lambda v: None) -> str:
    """A flag's value, else the user's answer (asked again while it is wrong, up to three times)."""
    if value is not None:
        why = check(str(value))
        if why:
            raise InitError(why)
        return str(value)
    if ask is None:
        return default
    for _ in range(3):
        text = ask(question, default)
        why = check(text)
        if not why:
            return text
        print(f"  {why}", file=sys.stderr, flush=True)
    raise InitError(why)


def _one_of(choices: tuple[str, ...], what: str) -> Callable[[str], Optional[str]]:
    def check(text: str) -> Optional[str]:
        if text in choices:
            return None
        from .aliases import PRECISIONS as P, STRATEGY_NAMES as S

        alias = (S if what == "strategy" else P).get(text)
        hint = f" ({text} is written {alias} in trainkit)" if alias else ""
        return f"{what} {text!r} is not one of: {', '.join(choices)}{hint}"
    return check


def offered_strategies() -> dict[str, Any]:
    """name -> options class of each built-in strategy `init` offers (its `init_order`), in that order;
    each class writes its own block and comment (`init_block`, `init_note`)."""
    offered = {name: registry.load("strategies", name) for name in registry.names("strategies", builtin_only=True)}
    chosen = [(cls.init_order, name) for name, cls in offered.items() if cls.init_order is not None]
    return {name: offered[name] for _, name in sorted(chosen)}


def _whole(text: str) -> Optional[str]:
    return None if text.isdigit() and int(text) > 0 else f"expected a positive whole number, got {text!r}"


def _data_block(answer: str, batch: int, ranks: int, gpus_here: bool) -> tuple[str, str]:
    """(YAML for the data block, the comment explaining it); loader workers sized to this machine's cores."""
    if answer == "synthetic":
        return (f"{{name: synthetic, batch_size: {batch}, num_samples: 4096, shape: [3, 32, 32], num_classes: 10}}",
                "synthetic: random tensors, to check the setup before real data (batch_size is per GPU)")
    root = Path(answer).expanduser()
    workers = data_workers_per_rank(ranks)
    loading = f"num_workers: {workers}" + (", pin_memory: true" if gpus_here else "")
    sized = f"num_workers {workers}: {usable_cores()} core(s) here for {ranks} rank(s) and their loader workers"
    if (root / "cifar-10-batches-py").is_dir():
        return (f"{{name: cifar10, root: {json.dumps(answer)}, batch_size: {batch}, {loading}}}",
                f"CIFAR-10 from a local folder (never downloaded); batch_size is per process; {sized}")
    return (f"{{name: imagefolder, root: {json.dumps(answer)}, batch_size: {batch}, {loading}}}",
            f"ImageFolder layout: {answer}/<class>/<image>; batch_size is per process; {sized}; "
            "add val_root for evaluation")


def _classes(answer: str) -> Optional[int]:
    root = Path(answer).expanduser()
    if answer == "synthetic":
        return 10
    if (root / "cifar-10-batches-py").is_dir():
        return 10
    try:
        return sum(1 for p in root.iterdir() if p.is_dir()) or None
    except OSError:
        return None


def write_recipe(args, ask: Ask) -> tuple[Path, str]:
    """Write args.out from the answers; returns (path, a one-paragraph summary)."""
    out = Path(args.out)
    if out.exists() and not args.force:
        raise InitError(f"{out} exists; choose another file or pass --force")
    data = _answer(args.data, ask, "Training data: 'synthetic', or a folder (ImageFolder layout or CIFAR-10)",
                   "synthetic", lambda v: None if v.strip() else "give 'synthetic' or a folder")
    model = _answer(args.model, ask, "Model: mlp, small_cnn, torchvision.<name> or package.module:factory",
                    "mlp" if data == "synthetic" else "torchvision.resnet50",
                    lambda v: None if v.strip() else "give a model name")
    found = visible_gpus()
    question = (f"GPUs per node (worker processes per machine, one per GPU; {found} here)" if found else
                "Processes per node (no GPU here: 1 trains on the CPU, its cores shared by torch's threads)")
    gpus = int(_answer(args.gpus_per_node, ask, question, str(found or 1), _whole))
    nodes = int(_answer(args.nodes, ask, "Nodes (machines)", "1", _whole))
    endpoint = None
    if nodes > 1:
        endpoint = _answer(args.rdzv_endpoint, ask, "Rendezvous endpoint HOST:PORT reachable from every node",
                           "node0:29400", lambda v: None if v.rpartition(":")[2].isdigit() else
                           f"expected HOST:PORT, got {v!r}")
    world = gpus * nodes
    offered = offered_strategies()
    choices = tuple(offered)
    strategy = _answer(args.strategy, ask, f"Strategy ({', '.join(choices)})",
                       choices[0], _one_of(choices, "strategy"))
    options = offered[strategy]
    precision = _answer(args.precision, ask, f"Precision ({', '.join(PRECISIONS)})",
                        "bf16" if world > 1 else "fp32", _one_of(PRECISIONS, "precision"))
    tracking = _answer(args.tracking_uri, ask, "MLflow tracking server URI ('' for the local store, 'off' for none)",
                       "")
    tracking = "" if tracking in ("''", '""') else tracking
    batch = args.batch_size or 32
    steps = args.max_steps or 1000
    name = args.name or "".join(c if c.isalnum() or c in "._-" else "-" for c in out.stem) or "run"

    data_yaml, data_note = _data_block(data, batch, gpus, gpus_here=found > 0)
    classes = _classes(data)
    args_yaml = f", args: {{num_classes: {classes}}}" if classes and model.startswith("torchvision.") else ""
    lines = [f"# Written by `trainkit init`; check it with `trainkit plan {out}`, start it with `trainkit run {out}`.",
             "# Every key: docs/reference.md (or `trainkit schema --markdown`).",
             f"name: {name}                  # names the run folder (launch.run_dir/{name}) and the MLflow run",
             f"# {_model_note(model)}",
             f"model: {{name: {json.dumps(model)}{args_yaml}}}",
             f"# {data_note}",
             f"data: {data_yaml}",
             f"# {options.init_note(world)}",
             f"strategy: {_strategy_yaml(options, world, model)}",
             f"# {_precision_note(precision)}",
             f"precision: {precision}",
             "optimizer: {name: adamw, lr: 0.001, weight_decay: 0.01}",
             "scheduler: {name: cosine, warmup_steps: " + str(min(100, steps // 10)) + "}",
             "# max_steps counts optimizer steps (not epochs): `trainkit plan` prints steps per epoch",
             f"trainer: {{max_steps: {steps}, log_every: 10, checkpoint: {{every: {max(1, steps // 4)}, keep: 3}}, "
             "resume: auto}",
             f"# {gpus} worker process(es) per node (one per GPU) x {nodes} node(s) = world size {world}"
             + ("; start `trainkit run` on every node" if nodes > 1 else ""),
             "launch: {" + f"nproc_per_node: {gpus}, nnodes: {nodes}"
             + (f", rdzv_endpoint: {json.dumps(endpoint)}" if endpoint else "") + "}",
             "monitors: [system, throughput]   # add gpu, breakdown, profiler: docs/monitors.md",
             f"# {_tracking_note(tracking)}",
             f"tracking: {_tracking_yaml(tracking, name)}", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    from .resolver import resolve

    try:
        resolve(out)
    except RecipeError as err:
        raise InitError(f"wrote {out}, but it does not validate (a bug in init, or an answer it cannot check):\n"
                        f"{err}") from None
    return out, (f"wrote {out}: {model} on {data}, {strategy} over {world} process(es), {precision}, "
                 f"tracking {'off' if tracking == 'off' else tracking or 'in the mlflow.db of the project'}")


def _model_note(model: str) -> str:
    if model.startswith("torchvision."):
        return "a torchvision classification model, built with random weights (weights are never downloaded)"
    if ":" in model:
        return "your factory function, imported when the run starts (it must return a torch.nn.Module)"
    return "a built-in model; for your own, write 'package.module:factory'"


def _strategy_yaml(options: Any, world: int, model: str) -> str:
    try:
        return options.init_block(world, model)
    except ValueError as exc:
        raise InitError(str(exc)) from None


def _precision_note(precision: str) -> str:
    return {
        "fp32": "fp32: full precision (slowest, simplest; the choice on CPUs)",
        "bf16": "bf16: autocast to bfloat16 (Ampere GPUs and newer); no loss scaling needed",
        "fp16": "fp16: autocast to float16 with dynamic loss scaling (older GPUs)",
    }[precision]


def _tracking_note(tracking: str) -> str:
    if tracking == "off":
        return "no MLflow tracking (metrics still go to the console and the run directory)"
    if tracking:
        return "metrics, parameters and the recipe are logged to this MLflow server"
    return "MLflow in the project's SQLite file (mlflow.db at the repository root; docs/tracking.md); `trainkit ui` shows it"


def _tracking_yaml(tracking: str, name: str) -> str:
    if tracking == "off":
        return "{enabled: false}"
    uri = f", uri: {json.dumps(tracking)}" if tracking else ""
    return f"{{experiment: {name}{uri}}}"
