"""The bottleneck report: from measured step phases, say what limits the run and what to change.

Input is every rank's median step breakdown (runtime.stats.RunStats), plus what the run knows about
where it ran (`env`: device, backend, bf16 support), its whole-run time accounting (`wall`: steps,
evaluation, checkpoints, logging, start-up, shutdown) and GPU utilisation (`gpu`). The run is classified as
straggler-, data-, communication- or compute-bound, with the numbers as evidence and concrete recipe
changes ranked by the time they could save. Communication counts by its *exposed* part: with DDP the
all-reduce overlaps backward, and only the time the step still waits for it after compute is done
costs anything (in-flight time is shown as evidence, not judged). Written at the end of every run and on demand
(`trainkit report RUN_DIR`).

Every advice rule states the mechanism and the expected effect in the recipe's own terms and is only
given where the recipe's strategy, backend and device can do it (tests/test_bottleneck_advice.py).
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from typing import Optional

from ..run_dir import WARMUP_STEPS

DATA_SHARE, COMM_SHARE = 0.25, 0.25  # a phase taking a quarter of the step is worth fixing first
STRAGGLER_MARGIN = 0.2
OVERHEAD_SHARE = 0.10  # checkpoints / evaluation / logging above this share of wall time get advice
TARGET_SHARE = 0.05  # what the suggested interval aims for
GPU_IDLE = 60.0  # percent: below this a compute-bound GPU is starved by the host
WALL_PARTS = ("train", "eval", "checkpoint", "logging", "startup", "shutdown")


@dataclass
class Advice:
    saving: float  # fraction of step time this could save (for ranking)
    text: str


@dataclass
class Diagnosis:
    kind: str  # data-bound | communication-bound | straggler-bound | compute-bound | unknown
    headline: str
    evidence: list[str] = field(default_factory=list)
    advice: list[Advice] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)
    wall: list[list[str]] = field(default_factory=list)  # whole-run time accounting rows
    facts: dict = field(default_factory=dict)  # numbers for tags/metrics: step_ms, data_wait_share, ...

    def ranked(self) -> list[Advice]:
        return sorted(self.advice, key=lambda a: -a.saving)

    def tags(self) -> dict[str, str]:
        """MLflow run tags: filterable and sortable in the UI (`tags.trainkit.bottleneck = 'data-bound'`)."""
        out = {"trainkit.bottleneck": self.kind, "trainkit.bottleneck.headline": self.headline[:4000]}
        for i, a in enumerate(self.ranked()[:3], 1):
            out[f"trainkit.advice.{i}"] = a.text[:4000]
        out.update({f"trainkit.{k}": f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in self.facts.items()})
        return out

    def summary(self) -> dict:
        return {"kind": self.kind, "headline": self.headline, "advice": [a.text for a in self.ranked()],
                "facts": self.facts, "tags": self.tags()}

    def markdown(self, title: str) -> str:
        lines = [f"# Bottleneck report: {title}", "", f"**{self.kind}**: {self.headline}", ""]
        if self.table:
            lines += ["| " + " | ".join(self.table[0]) + " |", "|" + "---|" * len(self.table[0])]
            lines += ["| " + " | ".join(row) + " |" for row in self.table[1:]]
            lines.append("")
        if self.wall:
            lines += ["Where the wall time went:", "", "| part | seconds | share |", "|---|---|---|"]
            lines += ["| " + " | ".join(row) + " |" for row in self.wall]
            lines.append("")
        if self.evidence:
            lines += ["Evidence:", *[f"- {e}" for e in self.evidence], ""]
        if self.advice:
            lines += ["What to change (largest expected saving first):"]
            lines += [f"{i}. {a.text}" for i, a in enumerate(self.ranked(), 1)]
        return "\n".join(lines) + "\n"

    def console(self) -> str:
        top = self.ranked()[:2]
        return "\n".join([f"trainkit: bottleneck: {self.kind}: {self.headline}"]
                         + [f"trainkit:   -> {a.text}" for a in top])


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _mean(ranks: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in ranks if key in r]
    return sum(values) / len(values) if values else None


def _env(recipe, env: Optional[dict]) -> dict:
    """Where the run ran. Reports written before this was recorded: inferred from the recipe's backend
    (`auto` leaves device and backend unknown, and advice that depends on them is not given)."""
    out = dict(env or {})
    backend = recipe.launch.backend
    if "backend" not in out and backend != "auto":
        out["backend"] = backend
    if "device" not in out and out.get("backend") == "nccl":
        out["device"] = "cuda"
    return out


def _times(every: int, max_steps: int) -> int:
    """How often something runs every `every` steps and always at the last step."""
    return max_steps // every + (1 if max_steps % every else 0)


def _cheaper_interval(every: int, max_steps: int, each_s: float, rest_s: float) -> tuple[int, float]:
    """The smallest multiple of `every` (2x, 5x, 10x, ...) whose projected share of wall time is at most
    TARGET_SHARE (or max_steps: only the final one), and that share."""
    choice = max_steps
    for factor in (2, 5, 10, 20, 50, 100, 200, 500, 1000):
        candidate = every * factor
        if candidate >= max_steps:
            break
        n = _times(candidate, max_steps)
        if n * each_s / (rest_s + n * each_s) <= TARGET_SHARE:
            choice = candidate
            break
    n = _times(choice, max_steps)
    return choice, n * each_s / max(rest_s + n * each_s, 1e-9)


def _lr_rule(recipe, factor: float) -> str:
    """How optimizer.lr should follow a global batch `factor`x larger: linear for SGD, square root for Adam."""
    opt = recipe.optimizer
    if opt.name == "sgd":
        return f"scale optimizer.lr accordingly (linear rule: {opt.lr:g} → {opt.lr * factor:g}, with warm-up)"
    return f"scale optimizer.lr accordingly (square-root rule for {opt.name}: {opt.lr:g} → {opt.lr * math.sqrt(factor):.3g})"


def wall_advice(recipe, wall: dict) -> tuple[list[list[str]], list[str], list[Advice], dict]:
    """Rows of the wall-time table, evidence, advice and facts from the run's time accounting
    (`runtime.loop.WallTimes.as_dict()`: *_s seconds per part, counts, wall_s)."""
    total = wall.get("wall_s") or 0.0
    if total <= 0:
        return [], [], [], {}
    t = recipe.trainer
    parts = {p: wall.get(f"{p}_s") or 0.0 for p in WALL_PARTS}
    other = max(0.0, total - sum(parts.values()))
    rows = [[p, f"{v:.2f}", f"{v / total:.0%}"] for p, v in parts.items()] + [["other", f"{other:.2f}",
                                                                                f"{other / total:.0%}"]]
    facts = {f"time.{p}_share": v / total for p, v in parts.items()}
    evidence = ["wall time " + f"{total:.1f} s: " + ", ".join(f"{p} {v / total:.0%}" for p, v in parts.items())]
    advice: list[Advice] = []
    ckpt, saves = parts["checkpoint"], wall.get("checkpoints") or 0
    if ckpt / total > OVERHEAD_SHARE and saves and t.checkpoint.every and t.checkpoint.every < t.max_steps:
        each = ckpt / saves
        every, share = _cheaper_interval(t.checkpoint.every, t.max_steps, each, total - ckpt)
        advice.append(Advice(ckpt / total - share,
                             f"trainer.checkpoint.every {t.checkpoint.every} costs {ckpt / total:.0%} of wall time "
                             f"({saves} saves, {each:.2f} s each); every {every} would cost {share:.0%} (a crash "
                             f"then loses up to {every} steps instead of {t.checkpoint.every})"))
    ev, evals = parts["eval"], wall.get("evals") or 0
    if ev / total > OVERHEAD_SHARE and evals and t.eval_every:
        each = ev / evals
        text = f"trainer.eval_every {t.eval_every} costs {ev / total:.0%} of wall time ({evals} evaluations of " \
               f"{t.eval_steps} batches, {each:.2f} s each)"
        if t.eval_every < t.max_steps:
            every, share = _cheaper_interval(t.eval_every, t.max_steps, each, total - ev)
            text += f"; every {every} would cost {share:.0%}"
            saving = ev / total - share
        else:
            saving = ev / total / 2
        if t.eval_steps > 1:
            text += f" (or lower trainer.eval_steps from {t.eval_steps}: each evaluation costs in proportion)"
        advice.append(Advice(saving, text))
    log = parts["logging"]
    if log / total > OVERHEAD_SHARE and t.log_every < 10 and t.log_every < t.max_steps:
        every = min(t.max_steps, t.log_every * 10)
        advice.append(Advice(log / total * 0.9, f"raise trainer.log_every from {t.log_every} to {every}: logging "
                             f"(metric gathers, tracking writes) costs {log / total:.0%} of wall time; "
                             f"{every // t.log_every}x fewer log steps would cost about "
                             f"{log / total * t.log_every / every:.0%}"))
    return rows, evidence, advice, facts


def diagnose(per_rank: list[dict], recipe, margin: float = STRAGGLER_MARGIN, *, env: Optional[dict] = None,
             wall: Optional[dict] = None, gpu: Optional[dict] = None, global_batch: Optional[int] = None) -> Diagnosis:
    """`env`: {"device": "cuda"|"cpu", "backend": "nccl"|"gloo", "bf16": bool} (what the run could use);
    `wall`: the whole-run time accounting; `gpu`: {"busy_percent": mean NVML utilisation over ranks}."""
    env = _env(recipe, env)
    wall_rows, wall_evidence, wall_tips, wall_facts = wall_advice(recipe, wall or {})
    ranks = [r for r in per_rank if r.get("steps")]
    if not ranks:
        d = Diagnosis("unknown", f"too few steps to measure (the first {WARMUP_STEPS} steps of a launch are warm-up)",
                      wall_evidence, wall_tips, wall=wall_rows, facts=wall_facts)
        return d
    step = statistics.median(r["total"] for r in ranks)
    data = _mean(ranks, "data_wait") or 0.0
    comm = _mean(ranks, "comm")
    exposed = _mean(ranks, "comm_exposed")
    if exposed is None:  # reports written before exposed communication was measured
        exposed = comm
    table = [["rank", "host", "step ms", "data wait ms", "forward ms", "backward ms", "optimizer ms", "comm ms",
              "exposed comm ms"]]
    for r in sorted(ranks, key=lambda r: r["rank"]):
        table.append([str(r["rank"]), r["host"], _ms(r["total"]), _ms(r["data_wait"]), _ms(r.get("forward")),
                      _ms(r.get("backward")), _ms(r["optimizer"]), _ms(r.get("comm")), _ms(r.get("comm_exposed"))])

    # what each rank does before it can join the gradient collective
    pre = {r["rank"]: r["data_wait"] + r.get("forward", 0.0) for r in ranks}
    typical = statistics.median(pre.values())
    slow = [rk for rk, v in pre.items() if len(ranks) > 1 and v > typical * (1 + margin) and v - typical > 0.05 * step]
    data_share, comm_share = data / step, (exposed or 0.0) / step
    d, t, s = recipe.data, recipe.trainer, recipe.strategy
    dp = max(1, len(per_rank)) if s.name in ("ddp", "fsdp", "deepspeed") else 1
    batch = global_batch or d.batch_size * dp * t.grad_accum_steps
    busy = (gpu or {}).get("busy_percent")
    facts = {"step_ms": step * 1000, "data_wait_share": data_share, **wall_facts}
    for key in ("forward", "backward", "optimizer"):
        value = _mean(ranks, key)
        if value is not None:
            facts[f"{key}_ms"] = value * 1000
    if exposed is not None:
        facts["comm_exposed_share"] = comm_share
    if busy is not None:
        facts["gpu_busy_percent"] = busy
    advice: list[Advice] = list(wall_tips)
    evidence = [f"median step {step * 1000:.1f} ms over {min(r['steps'] for r in ranks)} measured steps per rank",
                f"data wait {data_share:.0%} of the step ({data * 1000:.1f} ms)"]
    if comm is not None:
        evidence.append(f"gradient communication in flight {comm / step:.0%} of the step ({comm * 1000:.1f} ms)")
        evidence.append(f"exposed communication (the step waits for it after backward compute is done; the rest "
                        f"overlaps backward) {comm_share:.0%} of the step ({exposed * 1000:.1f} ms)")
    else:
        evidence.append("communication not measured (add the `breakdown` monitor to measure it)")
    if busy is not None:
        evidence.append(f"GPU busy {busy:.0f}% of the time (NVML utilisation, mean over ranks and samples)")
    evidence += wall_evidence

    if slow:
        worst = max(slow, key=lambda rk: pre[rk])
        host = next(r["host"] for r in ranks if r["rank"] == worst)
        kind = "straggler-bound"
        headline = (f"rank {worst} on {host} needs {pre[worst] * 1000:.1f} ms per step before the gradient "
                    f"all-reduce vs a median of {typical * 1000:.1f} ms; every other rank waits for it")
        advice.append(Advice((pre[worst] - typical) / step,
                             f"investigate rank {worst} on host {host}: its data loading + forward take "
                             f"{pre[worst] / max(typical, 1e-9):.1f}x the median (other jobs on the host, "
                             f"thermal throttling, slower storage); run `trainkit doctor` there"))
    elif data_share > DATA_SHARE:
        kind = "data-bound"
        headline = f"{data_share:.0%} of each step waits for data ({data * 1000:.1f} of {step * 1000:.1f} ms)"
    elif exposed is not None and comm_share > COMM_SHARE:
        kind = "communication-bound"
        headline = (f"each step waits {comm_share:.0%} of its time for gradient communication not overlapped "
                    f"with backward ({exposed * 1000:.1f} of {step * 1000:.1f} ms; {comm * 1000:.1f} ms in flight)")
    else:
        kind = "compute-bound"
        headline = f"forward/backward/optimizer take {1 - data_share - (comm_share if slow else 0):.0%} of the step"
        if busy is not None and busy < GPU_IDLE:
            headline += (f"; GPU busy {busy:.0f}% of the time: the host does not keep it fed (kernel launches, "
                         f"small kernels)")

    advice += _data_advice(recipe, env, data, data_share)
    advice += _comm_advice(recipe, env, exposed, comm_share, step, batch, dp)
    if kind == "compute-bound":
        advice += _compute_advice(recipe, env, busy, batch)
    return Diagnosis(kind, headline, evidence, advice, table, wall=wall_rows, facts=facts)


def _data_advice(recipe, env: dict, data: float, data_share: float) -> list[Advice]:
    """Loader settings, whenever data wait is visible (> 5% of the step)."""
    d, out = recipe.data, []
    if data_share <= 0.05:
        return out
    cpus = os.cpu_count() or 1
    per_rank = max(1, cpus // max(1, recipe.launch.nproc_per_node))
    ms = f"{data * 1000:.1f} ms"
    if d.num_workers == 0:
        out.append(Advice(data_share * 0.9, f"set data.num_workers: {min(per_rank, 8)} (now 0): decoding and "
                          f"augmentation run inside the training process and stall it {ms} per step "
                          f"({data_share:.0%}); worker processes prepare the next batches while the step computes, "
                          f"saving up to that {data_share:.0%}"))
    else:
        if d.num_workers < per_rank:
            target = min(per_rank, 16)
            out.append(Advice(data_share * 0.6, f"raise data.num_workers from {d.num_workers} to {target}: "
                              f"{d.num_workers} worker(s) do not keep up ({data_share:.0%} of the step, {ms}, still "
                              f"waits for data); {target} load {target / d.num_workers:.1g}x as many batches at once "
                              f"({per_rank} CPU cores per rank here)"))
        prefetch = d.prefetch_factor or 2
        if prefetch < 4:
            out.append(Advice(data_share * 0.3, f"raise data.prefetch_factor from {prefetch} to 4: each worker keeps "
                              f"4 batches ready instead of {prefetch}, absorbing slow batches ({ms} data wait per step)"))
        if not d.persistent_workers:
            out.append(Advice(data_share * 0.2, "set data.persistent_workers: true: the loader's worker processes "
                              "are started again at every epoch boundary; kept alive, the first steps of each epoch "
                              "stop waiting for them"))
    if not d.pin_memory and env.get("device") == "cuda":
        out.append(Advice(data_share * 0.1, "set data.pin_memory: true: batches in page-locked host memory copy to "
                          "the GPU faster and without blocking the step"))
    return out


def _comm_advice(recipe, env: dict, exposed, comm_share: float, step: float, batch: int, dp: int) -> list[Advice]:
    """DDP settings, when exposed communication costs more than 10% of the step."""
    s, t, out = recipe.strategy, recipe.trainer, []
    if exposed is None or comm_share <= 0.1 or s.name != "ddp" or dp < 2:
        return out
    ms = f"{exposed * 1000:.1f} ms"
    if s.bucket_cap_mb < 10:
        out.append(Advice(comm_share * 0.6, f"raise strategy.bucket_cap_mb from {s.bucket_cap_mb:g} to 25: tiny "
                          f"buckets mean many small all-reduces, each paying the full latency; fewer, larger ones "
                          f"cut most of the {ms} exposed per step"))
    if s.comm_hook == "none":
        backend = env.get("backend")
        hook = "bf16_compress" if backend == "nccl" else "fp16_compress" if backend == "gloo" else None
        if hook:
            why = "" if hook == "bf16_compress" else " (bf16_compress needs NCCL; this run uses gloo)"
            out.append(Advice(comm_share * 0.4, f"set strategy.comm_hook: {hook}{why}: gradients travel as 16-bit, "
                              f"halving the bytes of each all-reduce: up to ~{exposed * 500:.1f} of the {ms} exposed "
                              f"per step saved (gradients lose precision in transit)"))
    accum = t.grad_accum_steps
    new = accum * 4
    out.append(Advice(comm_share * 0.75 * 0.5,
                      f"raise trainer.grad_accum_steps from {accum} to {new}: global batch {batch} → {batch * 4}, "
                      f"one all-reduce per 4x more samples (the {ms} exposed per step is paid once per {new} "
                      f"micro-batches); {_lr_rule(recipe, 4)} — keeping the global batch with a smaller "
                      f"data.batch_size would save nothing"))
    if not s.static_graph and not s.find_unused_parameters:
        out.append(Advice(comm_share * 0.1, "set strategy.static_graph: true if the model runs the same graph every "
                          "step: DDP then skips its per-step search for unused parameters and can reorder buckets "
                          "to match the backward order, overlapping more of the all-reduce"))
    return out


def _compute_advice(recipe, env: dict, busy: Optional[float], batch: int) -> list[Advice]:
    out, d = [], recipe.data
    device = env.get("device")
    if recipe.precision == "fp32" and env.get("bf16"):
        where = "tensor cores" if device == "cuda" else "the CPU's AMX/AVX512-BF16 units"
        out.append(Advice(0.3, f"set precision: bf16: autocast runs matmuls and convolutions on {where} at 2x or more "
                          f"the fp32 rate (this {device or 'device'} supports bf16); expect the forward/backward "
                          f"time to drop by up to half"))
    if device == "cuda" and busy is not None and busy < GPU_IDLE:
        out.append(Advice(0.1 + (GPU_IDLE - busy) / 200, f"raise data.batch_size from {d.batch_size} to "
                          f"{d.batch_size * 2} if memory allows: the GPU is busy only {busy:.0f}% of the time, "
                          f"larger kernels keep it fed; global batch {batch} → {batch * 2}, {_lr_rule(recipe, 2)}"))
    return out


def describe_env(device: str, backend: Optional[str]) -> dict:
    """What advice may assume about where the run ran: device type, process-group backend, and whether
    bf16 runs fast there (a CUDA GPU that supports it; a CPU with AMX or AVX512-BF16)."""
    bf16 = False
    try:
        if device == "cuda":
            import torch

            bf16 = bool(torch.cuda.is_bf16_supported())
        else:
            with open("/proc/cpuinfo") as f:
                flags = f.read(200_000)
            bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    except Exception:
        pass
    return {"device": device, "backend": backend, "bf16": bf16}
