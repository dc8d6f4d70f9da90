"""Per-rank memory and step time of one ~105M-parameter model under DDP, FSDP, ZeRO-2 and ZeRO-3
(2 ranks), side by side in one run, plus the pipeline bubble (measured vs ideal step time).

    python bench/strategies_memory.py [--steps 4] [--out results.json]
    python bench/strategies_memory.py --only ddp fsdp zero3 --lifecycle [--nproc 4 --depth 3 --hidden 2048]

`--lifecycle` measures the whole life of each rank, as a trainkit run has it: after the steps, the
pre-checkpoint weights check, a checkpoint save, its load (a resume) and the end-of-run replica check,
each through trainkit's own code, with the peak after each (issue 28: no rank holds the whole model).

Each strategy runs in its own `torchrun --standalone --nproc-per-node 2` group (so peaks do not
mix) through trainkit's own Strategy classes -- the same setup / forward_backward /
optimizer_step calls the training loop makes. Per rank it reports:

- model+optimizer state bytes: unique storages of the parameters this rank holds (FSDP: its DTensor
  shards; ZeRO-3: its partition), the optimizer's parameter copies and its state (AdamW moments),
  measured after a step. Gradients and communication buffers are transient and not included.
- peak RSS (CPU; ru_maxrss) or torch.cuda.max_memory_allocated (GPU). RSS includes the Python +
  torch runtime (~0.3-0.5 GB). The model is built as the training worker builds it
  (`build_initial_model`): FSDP and ZeRO-3 seeded by default (no rank holds the whole model), and
  once more with `model.init: constructor` (every rank builds it whole first) to show the difference.
- step time: median of the measured steps (after one warm-up step), 2 ranks x batch 8.

Pipeline: 2 stages (balanced by parameters), global batch 16 in 4 micro-batches. The ideal step of
GPipe/1F1B with S stages and M micro-batches is (M + S - 1) x t_mb + t_opt, where t_mb is the
slowest stage's forward+backward per micro-batch, measured alone on each rank (no pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = os.environ.get("TRAINKIT_BENCH_PHASES") == "1"  # --phases; the workers read it from the environment
LIFECYCLE = os.environ.get("TRAINKIT_BENCH_LIFECYCLE")  # --lifecycle: a folder for the checkpoint
DEPTH = int(os.environ.get("TRAINKIT_BENCH_DEPTH", "7"))  # --depth; the workers read it from the environment
HIDDEN = int(os.environ.get("TRAINKIT_BENCH_HIDDEN", "4096"))  # --hidden
NPROC = int(os.environ.get("TRAINKIT_BENCH_NPROC", "2"))  # --nproc
MODEL = {"name": "mlp", "args": {"in_features": 1024, "hidden": HIDDEN, "num_classes": 10, "depth": DEPTH}}
CONFIGS = {  # "init": model.init (default auto: seeded for FSDP and ZeRO-3, constructor otherwise)
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fsdp-constructor": {"name": "fsdp", "init": "constructor"},
    "zero2": {"name": "deepspeed", "zero_stage": 2},
    "zero3": {"name": "deepspeed", "zero_stage": 3},
    "zero3-constructor": {"name": "deepspeed", "zero_stage": 3, "init": "constructor"},
    "pipeline-gpipe": {"name": "pipeline", "schedule": "gpipe", "microbatches": 4},
    "pipeline-1f1b": {"name": "pipeline", "schedule": "1f1b", "microbatches": 4},
}
BATCH_PER_RANK = 8


def write_recipe(folder: Path, label: str, strategy: dict, host_allocator: str = "auto") -> Path:
    import yaml

    from trainkit import registry

    strategy = dict(strategy)
    init = strategy.pop("init", "auto")
    # ranks holding different layers (the pipeline's stages) read one batch
    pipeline = registry.load("strategies", strategy["name"]).model_validate(strategy).capabilities().splits_model
    recipe = {
        "name": f"bench-{label}", "seed": 0, "model": {**MODEL, "init": init},
        "data": {"name": "synthetic", "batch_size": BATCH_PER_RANK * (2 if pipeline else 1), "num_samples": 64,
                 "shape": [1024], "num_classes": 10},
        "strategy": strategy, "precision": "fp32",
        "optimizer": {"name": "adamw", "lr": 1.0e-4},
        "trainer": {"max_steps": 10}, "launch": {"nproc_per_node": NPROC}, "tracking": {"enabled": False},
        "performance": {"host_allocator": host_allocator},
    }
    path = folder / f"{label}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --------------------------------------------------------------------------- one rank
def state_bytes(strategy, model, optimizer) -> int:
    """Unique storages of the parameters this rank holds + the optimizer's copies and state."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}

    def add(t):
        if not isinstance(t, torch.Tensor):
            return
        if isinstance(t, DTensor):
            t = t.to_local()
        t = getattr(t, "ds_tensor", t)  # ZeRO-3: the partition this rank owns
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()

    for p in strategy.unwrap(model).parameters():
        add(p)
    for group in optimizer.param_groups:
        for p in group["params"]:
            add(p)
    for master in getattr(getattr(model, "optimizer", None), "fp32_partitioned_groups_flat", []):
        add(master)  # ZeRO-3's fp32 master partition: its optimizer's parameters only during its step
    for st in optimizer.state.values():
        for v in st.values():
            add(v)
    return sum(seen.values())


def worker(recipe_path: str, steps: int, out: str) -> None:
    import resource

    import torch
    import torch.distributed as dist

    from trainkit import registry
    from trainkit.recipe import resolve
    from trainkit.runtime import host_allocator
    from trainkit.runtime.model import build_initial_model
    from trainkit.runtime.optim import build_optimizer
    from trainkit.runtime.precision import Precision

    recipe = resolve(recipe_path).recipe
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    # as trainkit's worker does, before anything large is allocated (performance.host_allocator)
    allocator = host_allocator.apply(host_allocator.for_recipe(recipe, device.type))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    phases = []  # --phases (Linux, CPU): each step's peak RSS in forward+backward and in the optimizer step

    def proc_status(field: str) -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))

    def reset_peak() -> None:  # VmHWM := VmRSS (Linux >= 4.0); it also resets what getrusage reports
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")

    def peak() -> int:
        return torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    start_peak = peak()  # the interpreter, torch and the process group: no model yet
    precision = Precision(recipe.precision, device)
    strategy_cls = registry.component(recipe.strategy)
    strategy = strategy_cls(recipe.strategy, device=device, precision=precision, **strategy_cls.run_inputs(recipe))
    model, init = build_initial_model(recipe.model, strategy, recipe.seed)  # what the training worker does
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: partitioned
    model, optimizer = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    setup_peak = peak()  # building and sharding the model: what model.init changes
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1 + strategy.data_parallel_rank)
    x = torch.randn(recipe.data.batch_size, 1024, generator=g).to(device)
    y = torch.randint(0, 10, (recipe.data.batch_size,), generator=g).to(device)
    times, opt_times = [], []
    for i in range(steps + 1):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if PHASES:
            before = proc_status("VmRSS")
            reset_peak()
        strategy.forward_backward(model, x, y, loss_fn, precision, grad_accum_steps=1, last_micro_step=True)
        if PHASES:
            fb_peak, after_fb = proc_status("VmHWM"), proc_status("VmRSS")
            reset_peak()
        t1 = time.perf_counter()
        strategy.optimizer_step(model, optimizer, precision, None)
        if PHASES:
            phases.append({"step": i, "rss_before": before, "fb_peak": fb_peak, "rss_after_fb": after_fb,
                           "opt_peak": proc_status("VmHWM"), "rss_after": proc_status("VmRSS")})
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t2 = time.perf_counter()
        if i:  # the first step allocates optimizer state and warms up
            times.append(t2 - t0)
            opt_times.append(t2 - t1)
    steps_peak = peak()  # setup and the steps, before anything at the end of a run
    lifecycle = run_lifecycle(strategy, model, optimizer, steps, device, peak) if LIFECYCLE else {}
    result = {"rank": rank, "params": n_params, "init": init, "host_allocator": allocator, "state_bytes": state_bytes(strategy, model, optimizer),
              "step_s": statistics.median(times), "optimizer_s": statistics.median(opt_times),
              "peak_bytes": peak(), "start_peak_bytes": start_peak, "setup_peak_bytes": setup_peak,
              "peak_kind": "cuda max_memory_allocated" if cuda else "peak RSS", "steps_peak_bytes": steps_peak,
              "lifecycle": lifecycle}
    if PHASES:  # the resets above cleared the process's own peak: the largest phase peak is the run's
        result.update(phases=phases, peak_bytes=max([setup_peak] + [max(p["fb_peak"], p["opt_peak"]) for p in phases]))
    if recipe.strategy.capabilities().splits_model:
        result.update(stage_alone(strategy, model, x, loss_fn, recipe.strategy.microbatches, device))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def run_lifecycle(strategy, model, optimizer, step: int, device, peak) -> dict:
    """--lifecycle: what a trainkit run does after its last step, through trainkit's own code, with
    the peak after each phase (the peak is the process's high-water mark: each figure includes the
    phases before it). The loop checks the weights before a checkpoint (`local_tensors`), the
    Checkpointer saves, a resume loads it back into the same model and optimizer, and the worker's
    end-of-run replica check (`replica_digests`) runs last."""
    import itertools

    from trainkit.runtime.checkpoint import Checkpointer
    from trainkit.runtime.nonfinite import NonFiniteGuard

    marks = {}
    checkpointer = Checkpointer(Path(LIFECYCLE), strategy, keep=1, recipe_data={"bench": True})
    NonFiniteGuard.weights_finite(strategy, itertools.chain(strategy.local_tensors(model), model.buffers()), device)
    marks["weights check"] = peak()
    folder = checkpointer.save(step, model, optimizer, {"progress": {"step": step}})
    marks["checkpoint save"] = peak()
    checkpointer.load(folder, model, optimizer)
    marks["checkpoint load"] = peak()
    strategy.replicas_agree(strategy.replica_digests(model))
    marks["end-of-run replica check"] = peak()
    return marks


def stage_alone(strategy, model, x, loss_fn, microbatches: int, device) -> dict:
    """Forward+backward of this rank's stage on one micro-batch, without the pipeline (its input is
    made by running the earlier blocks of a local copy of the model)."""
    import torch

    from trainkit.runtime.model import build_model
    from trainkit.recipe.blocks import ModelSpec
    from trainkit.strategies.pipeline import flatten_blocks

    full = build_model(ModelSpec(**MODEL))
    blocks = dict(flatten_blocks(full))
    stage = strategy.modules[0]
    first = list(blocks).index(stage.names[0])
    mb = x[: x.shape[0] // microbatches]
    with torch.no_grad():
        h = mb
        for name in list(blocks)[:first]:
            h = blocks[name](h)
    samples = []
    for _ in range(4):
        t0 = time.perf_counter()
        out = stage(h.detach().requires_grad_(first > 0))
        (out.float().sum() if out.shape[-1] != 10 else loss_fn(out, torch.zeros(out.shape[0], dtype=torch.long,
                                                                                     device=device))).backward()
        samples.append(time.perf_counter() - t0)
    stage.zero_grad(set_to_none=True)
    return {"stage_mb_s": statistics.median(samples[1:])}


# --------------------------------------------------------------------------- the driver
def launch(label: str, recipe: Path, steps: int, folder: Path, timeout: int) -> list[dict]:
    out = folder / f"{label}.json"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), DS_ACCELERATOR="cpu")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions"))
    if LIFECYCLE:
        env["TRAINKIT_BENCH_LIFECYCLE"] = str(folder / f"checkpoints-{label}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROC),
           __file__, "--worker", str(recipe), "--steps", str(steps), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{proc.stderr[-4000:]}")
    print(f"  {label}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return json.loads(out.read_text())


def table(results: dict[str, list[dict]]) -> str:
    gb = 1024**3
    ddp = results["ddp"]
    ddp_state = max(r["state_bytes"] for r in ddp)
    ddp_peak = max(r["peak_bytes"] for r in ddp)
    ddp_step = max(r["step_s"] for r in ddp)
    kind = ddp[0]["peak_kind"]
    ddp_above = max(r["peak_bytes"] - r["start_peak_bytes"] for r in ddp)
    lines = [f"| strategy | model.init | host allocator | model+optimizer state / rank (GiB) | vs DDP | {kind} / rank (GiB) | vs DDP | "
             f"{kind} above the process before the model (GiB) | vs DDP | {kind} after setup, before training (GiB) | "
             f"step time (s) | vs DDP |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label in ("ddp", "fsdp", "fsdp-constructor", "zero2", "zero3", "zero3-constructor"):
        rs = results[label]
        state, peak, step, setup = (max(r[k] for r in rs) for k in ("state_bytes", "peak_bytes", "step_s",
                                                                      "setup_peak_bytes"))
        above = max(r["peak_bytes"] - r["start_peak_bytes"] for r in rs)
        per_rank = ", ".join(f"{r['state_bytes'] / gb:.2f}" for r in rs)
        lines.append(f"| {label} | {rs[0]['init']} | {rs[0]['host_allocator']} | {state / gb:.2f} ({per_rank}) | "
                     f"{state / ddp_state:.2f}x | {peak / gb:.2f} | {peak / ddp_peak:.2f}x | {above / gb:.2f} | "
                     f"{above / ddp_above:.2f}x | {setup / gb:.2f} | {step:.2f} | {step / ddp_step:.2f}x |")
    lines += ["", "| pipeline schedule | measured step (s) | slowest stage fwd+bwd / micro-batch (s) | "
              "ideal step (M+S-1) x t_mb + t_opt (s) | measured / ideal | ideal bubble (S-1)/(M+S-1) |",
              "|---|---|---|---|---|---|"]
    for label in ("pipeline-gpipe", "pipeline-1f1b"):
        rs = results[label]
        m, s = 4, 2
        t_mb = max(r["stage_mb_s"] for r in rs)
        t_opt = max(r["optimizer_s"] for r in rs)
        measured = max(r["step_s"] for r in rs)
        ideal = (m + s - 1) * t_mb + t_opt
        lines.append(f"| {label.split('-', 1)[1]} | {measured:.3f} | {t_mb:.3f} | {ideal:.3f} | "
                     f"{measured / ideal:.2f}x | {(s - 1) / (m + s - 1):.0%} |")
    return "\n".join(lines)


def lifecycle_table(results: dict) -> str:
    """--lifecycle: the largest per-rank peak after each phase of the run, and over the whole life of
    the process against DDP's; model+optimizer state per rank (what follows 1/N)."""
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    phases = list(next(iter(results.values()))[0]["lifecycle"])
    ddp = results.get("ddp")
    ddp_peak = max(r["peak_bytes"] for r in ddp) if ddp else None
    ddp_state = max(r["state_bytes"] for r in ddp) if ddp else None
    rows = ["| strategy | model+optimizer state / rank (GiB) | vs DDP | peak after setup | after the steps | "
            + " | ".join(f"after {p}" for p in phases) + " | whole-run peak / rank (GiB) | vs DDP | above the "
            "process before the model |", "|---" * (8 + len(phases)) + "|"]
    for label, ranks in results.items():
        state, peak = max(r["state_bytes"] for r in ranks), max(r["peak_bytes"] for r in ranks)
        after = [gib(max(r["lifecycle"][p] for r in ranks)) for p in phases]
        above = max(r["peak_bytes"] - r["start_peak_bytes"] for r in ranks)
        rows.append(f"| {label} | {gib(state)} | {f'{state / ddp_state:.2f}x' if ddp else '-'} | "
                    f"{gib(max(r['setup_peak_bytes'] for r in ranks))} | {gib(max(r['steps_peak_bytes'] for r in ranks))} | "
                    + " | ".join(after) + f" | {gib(peak)} | {f'**{peak / ddp_peak:.2f}x**' if ddp else '-'} | {gib(above)} |")
    return "\n".join(rows)


def phase_table(results: dict) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    rows = ["| strategy | rank | step | RSS before (GiB) | peak in forward+backward | RSS after backward | "
            "peak in optimizer step | RSS after |", "|---|---|---|---|---|---|---|---|"]
    for label, ranks in results.items():
        for r in ranks:
            for p in r.get("phases", []):
                rows.append(f"| {label} | {r['rank']} | {p['step']} | {gib(p['rss_before'])} | {gib(p['fb_peak'])} | "
                            f"{gib(p['rss_after_fb'])} | {gib(p['opt_peak'])} | {gib(p['rss_after'])} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4, help="measured steps per strategy (after 1 warm-up)")
    ap.add_argument("--out", help="JSON file for the raw per-rank results")
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS), help="a subset (the table needs all)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per strategy")
    ap.add_argument("--depth", type=int, help="MLP depth (default 7: 105 M parameters; 14: 206 M)")
    ap.add_argument("--hidden", type=int, help="MLP width (default 4096)")
    ap.add_argument("--nproc", type=int, help="ranks per strategy (default 2)")
    ap.add_argument("--lifecycle", action="store_true", help="after the steps, what a run does at its end: the "
                    "weights check, a checkpoint save, its load (a resume) and the end-of-run replica check, "
                    "with the peak after each; the peak then covers the whole life of the process")
    ap.add_argument("--phases", action="store_true", help="CPU on Linux: also each step's peak RSS in "
                    "forward+backward and in the optimizer step (/proc/self/clear_refs), printed per rank")
    ap.add_argument("--host-allocator", choices=["auto", "retain", "release", "system"], default="auto",
                    help="performance.host_allocator of every recipe (default auto, as in a trainkit run: each "
                         "strategy's capabilities().host_memory_on_cpu)")
    args = ap.parse_args()
    global NPROC, LIFECYCLE
    if args.phases and not args.worker:
        os.environ["TRAINKIT_BENCH_PHASES"] = "1"
    if args.depth and not args.worker:
        os.environ["TRAINKIT_BENCH_DEPTH"] = str(args.depth)
        MODEL["args"]["depth"] = args.depth
    if args.hidden and not args.worker:
        os.environ["TRAINKIT_BENCH_HIDDEN"] = str(args.hidden)
        MODEL["args"]["hidden"] = args.hidden
    if args.nproc and not args.worker:
        os.environ["TRAINKIT_BENCH_NPROC"] = str(args.nproc)
        NPROC = args.nproc
    if args.lifecycle and not args.worker:
        os.environ["TRAINKIT_BENCH_LIFECYCLE"] = "1"
        LIFECYCLE = "1"
    if args.worker:
        worker(args.worker, args.steps, args.out)
        # as trainkit's worker does: leave without interpreter finalization, during which gloo's
        # threads can abort a finished process ("terminate called without an active exception")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for label in args.only or CONFIGS:
            results[label] = launch(label, write_recipe(folder, label, CONFIGS[label], args.host_allocator), args.steps, folder,
                                    args.timeout)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    params = results[next(iter(results))][0]["params"]
    print(f"model: mlp {MODEL['args']} = {params / 1e6:.1f} M parameters, fp32, AdamW; {NPROC} ranks")
    if args.lifecycle:
        print(lifecycle_table(results))
    elif set(CONFIGS) <= set(results):
        print(table(results))
    else:
        print(json.dumps({k: [{f: v for f, v in r.items() if f != "phases"} for r in rs] for k, rs in results.items()},
                         indent=2))
    if args.phases:
        print(phase_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
