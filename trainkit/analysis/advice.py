"""Advice as data: each piece of advice is the recipe change it proposes, the mechanism by which that
saves time, the expected saving and the measurements it rests on. The report renders the sentence
from these fields; `trainkit tune` reads `changes` (never the sentence) to choose what to try.

The rules below state the mechanism in the recipe's own terms and are only given where the recipe's
strategy, backend, device and dataset can act on them (tests/test_bottleneck_advice.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

OVERHEAD_SHARE = 0.10  # checkpoints / evaluation / logging above this share of wall time get advice
TARGET_SHARE = 0.05  # what the suggested interval aims for
GPU_IDLE = 60.0  # percent: below this a compute-bound GPU is starved by the host

# what a piece of advice saves time on
DATA, COMMUNICATION, COMPUTE, STRAGGLER, OVERHEAD = "data", "communication", "compute", "straggler", "overhead"


@dataclass(frozen=True)
class Advice:
    """One thing to change. `changes` maps dotted recipe keys to the proposed values, the first key
    being what the advice is about (the others change alongside it, e.g. `optimizer.lr` with a larger
    global batch); advice that proposes no recipe change ("investigate rank 3") has none and says
    what to do in `action`."""

    saving: float  # expected saving: share of the step (phase OVERHEAD: share of the run's wall time)
    mechanism: str  # why the change saves time, in the recipe's terms, with the numbers it rests on
    changes: dict[str, Any] = field(default_factory=dict)  # recipe key -> proposed value
    was: dict[str, Any] = field(default_factory=dict)  # recipe key -> the value in effect now
    phase: str = ""  # what it saves time on: DATA | COMMUNICATION | COMPUTE | STRAGGLER | OVERHEAD
    evidence: dict[str, float] = field(default_factory=dict)  # the measurements it rests on
    action: str = ""  # what to do where no recipe change says it

    @property
    def key(self) -> Optional[str]:
        """The recipe key this advice is about (None: no recipe change)."""
        return next(iter(self.changes), None)

    @property
    def text(self) -> str:
        """The sentence the report shows: the change, then why."""
        key = self.key
        action = self.action or change_text(key, self.was.get(key), self.changes[key])
        return f"{action}: {self.mechanism}"

    def as_dict(self) -> dict:
        return {"text": self.text, "changes": dict(self.changes), "was": dict(self.was), "phase": self.phase,
                "saving": self.saving, "mechanism": self.mechanism, "evidence": dict(self.evidence),
                **({"action": self.action} if self.action else {})}


def show(value: Any) -> str:
    """A recipe value as the recipe writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return "null" if value is None else str(value)


def change_text(key: str, was: Any, value: Any) -> str:
    """"raise K from A to B" for a number that changes, "set K: V (now 0)" for one that starts, "set K: V"."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (was, value))
    if not numbers:
        return f"set {key}: {show(value)}"
    if was == 0:
        return f"set {key}: {show(value)} (now 0)"
    return f"{'raise' if value > was else 'lower'} {key} from {show(was)} to {show(value)}"


# --------------------------------------------------------------------------- learning-rate rule
def scaled_lr(recipe, factor: float) -> float:
    """optimizer.lr for a global batch `factor`x larger: linear for SGD, square root for the others."""
    opt = recipe.optimizer
    return round(opt.lr * (factor if opt.name == "sgd" else math.sqrt(factor)), 10)


def _lr_rule(recipe, factor: float) -> str:
    opt = recipe.optimizer
    if opt.name == "sgd":
        return f"scale optimizer.lr accordingly (linear rule: {opt.lr:g} → {opt.lr * factor:g}, with warm-up)"
    return (f"scale optimizer.lr accordingly (square-root rule for {opt.name}: {opt.lr:g} → "
            f"{opt.lr * math.sqrt(factor):.3g})")


def _with_lr(recipe, key: str, was: Any, value: Any, factor: float) -> tuple[dict, dict]:
    """changes/was of a change that grows the global batch `factor`x: the learning rate follows."""
    return {key: value, "optimizer.lr": scaled_lr(recipe, factor)}, {key: was, "optimizer.lr": recipe.optimizer.lr}


# --------------------------------------------------------------------------- whole-run time
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


def wall_advice(recipe, parts: dict[str, float], total: float, wall: dict) -> list[Advice]:
    """Checkpoint, evaluation and logging intervals, when one costs more than OVERHEAD_SHARE of wall time."""
    t, out = recipe.trainer, []
    ckpt, saves = parts["checkpoint"], wall.get("checkpoints") or 0
    if ckpt / total > OVERHEAD_SHARE and saves and t.checkpoint.every and t.checkpoint.every < t.max_steps:
        each = ckpt / saves
        every, share = _cheaper_interval(t.checkpoint.every, t.max_steps, each, total - ckpt)
        out.append(Advice(ckpt / total - share,
                          f"saving checkpoints costs {ckpt / total:.0%} of wall time ({saves} saves, {each:.2f} s "
                          f"each); every {every} would cost {share:.0%} (a crash then loses up to {every} steps "
                          f"instead of {t.checkpoint.every})",
                          {"trainer.checkpoint.every": every}, {"trainer.checkpoint.every": t.checkpoint.every},
                          OVERHEAD, {"checkpoint_share": ckpt / total, "checkpoint_each_s": each}))
    ev, evals = parts["eval"], wall.get("evals") or 0
    if ev / total > OVERHEAD_SHARE and evals and t.eval_every:
        each = ev / evals
        cost = f"evaluation costs {ev / total:.0%} of wall time ({evals} evaluations of {t.eval_steps} batches, " \
               f"{each:.2f} s each)"
        facts = {"eval_share": ev / total, "eval_each_s": each}
        if t.eval_every < t.max_steps:
            every, share = _cheaper_interval(t.eval_every, t.max_steps, each, total - ev)
            fewer = f" (or lower trainer.eval_steps from {t.eval_steps}: each evaluation costs in proportion)" \
                if t.eval_steps > 1 else ""
            out.append(Advice(ev / total - share, f"{cost}; every {every} would cost {share:.0%}{fewer}",
                              {"trainer.eval_every": every}, {"trainer.eval_every": t.eval_every}, OVERHEAD, facts))
        elif t.eval_steps > 1:  # only the final evaluation: fewer batches is the one lever
            steps = max(1, t.eval_steps // 2)
            out.append(Advice(ev / total * (1 - steps / t.eval_steps),
                              f"{cost}; each evaluation costs in proportion to its batches",
                              {"trainer.eval_steps": steps}, {"trainer.eval_steps": t.eval_steps}, OVERHEAD, facts))
    log = parts["logging"]
    if log / total > OVERHEAD_SHARE and t.log_every < 10 and t.log_every < t.max_steps:
        every = min(t.max_steps, t.log_every * 10)
        out.append(Advice(log / total * 0.9, f"logging (metric gathers, tracking writes) costs {log / total:.0%} of "
                          f"wall time; {every // t.log_every}x fewer log steps would cost about "
                          f"{log / total * t.log_every / every:.0%}",
                          {"trainer.log_every": every}, {"trainer.log_every": t.log_every}, OVERHEAD,
                          {"logging_share": log / total}))
    return out


# --------------------------------------------------------------------------- one slow rank
def straggler_advice(rank: int, host: str, pre: float, typical: float, step: float) -> Advice:
    return Advice((pre - typical) / step,
                  f"its data loading + forward take {pre / max(typical, 1e-9):.1f}x the median (other jobs on the "
                  f"host, thermal throttling, slower storage); run `trainkit doctor` there",
                  phase=STRAGGLER, action=f"investigate rank {rank} on host {host}",
                  evidence={"rank": rank, "pre_collective_ms": pre * 1000, "median_pre_collective_ms": typical * 1000})


# --------------------------------------------------------------------------- data loading
def data_advice(recipe, env: dict, data: float, data_share: float, rate=None) -> list[Advice]:
    """Loader settings, whenever data wait is visible (> 5% of the step)."""
    d, out = recipe.data, []
    if data_share <= 0.05:
        return out
    cpus = os.cpu_count() or 1
    per_rank = max(1, cpus // max(1, recipe.launch.nproc_per_node))
    ms = f"{data * 1000:.1f} ms"
    seen = {"data_wait_ms": data * 1000, "data_wait_share": data_share}
    if d.num_workers == 0:
        work = d.loading_work()  # in the dataset's own words; "" where the samples are in memory
        if work:
            out.append(Advice(data_share * 0.9, f"the loader's work ({work}) runs inside the training process and "
                              f"stalls it {ms} per step ({data_share:.0%}); worker processes prepare the next batches "
                              f"while the step computes, saving up to that {data_share:.0%}",
                              {"data.num_workers": min(per_rank, 8)}, {"data.num_workers": 0}, DATA, seen))
        else:
            out.append(Advice(data_share * 0.5, f"the samples are in memory (nothing to read or decode), so the {ms} "
                              f"per step ({data_share:.0%}) is building batches (indexing, collation) inside the "
                              f"training process; a worker process builds the next batches while the step computes, "
                              f"at the cost of copying them between processes (`trainkit tune` measures which "
                              f"wins)",
                              {"data.num_workers": 1}, {"data.num_workers": 0}, DATA, seen))
    else:
        needed = rate.workers_needed() if rate is not None and rate.headroom < 1.05 else None
        onto_device = d.device_loading(env.get("device", "")) if needed is not None and needed > per_rank else None
        if onto_device is not None:
            changes, was, does = onto_device
            out.append(Advice(data_share * 0.8, f"the loader cannot keep up on this host's CPUs: one loader process "
                              f"makes {rate.per_worker:,.0f} samples/s, the model alone takes {rate.consumed:,.0f} per "
                              f"rank, so {needed} processes per rank are needed and there are {per_rank} CPU cores per "
                              f"rank; {does}", changes, was, DATA, seen))
        if needed is not None and needed > per_rank:
            more = d.num_workers < per_rank  # use every core first, then the work per sample has to shrink
            out.append(Advice(data_share * 0.6, f"the loader cannot keep up on this host's CPUs: one loader process "
                              f"makes {rate.per_worker:,.0f} samples/s, the model alone takes {rate.consumed:,.0f} per "
                              f"rank, so {needed} processes per rank are needed and there are {per_rank} CPU cores per "
                              f"rank; lighten the per-sample work (smaller images stored on disk, fewer transforms) or "
                              f"add CPU cores", {"data.num_workers": per_rank} if more else {},
                              {"data.num_workers": d.num_workers} if more else {}, DATA, seen,
                              action="" if more else "make each sample cheaper to load, or run on more CPU cores"))
        elif d.num_workers < per_rank:
            target = min(per_rank, 16) if needed is None else max(needed, d.num_workers + 1)
            measured = "" if needed is None else (f"; one loader process makes {rate.per_worker:,.0f} samples/s and the "
                                                  f"model alone takes {rate.consumed:,.0f}, so {needed} keep up")
            out.append(Advice(data_share * 0.6, f"{d.num_workers} worker(s) do not keep up ({data_share:.0%} of the "
                              f"step, {ms}, still waits for data); {target} load {target / d.num_workers:.1g}x as many "
                              f"batches at once ({per_rank} CPU cores per rank here{measured})",
                              {"data.num_workers": target}, {"data.num_workers": d.num_workers}, DATA, seen))
        prefetch = d.prefetch_factor or 2
        if prefetch < 4:
            out.append(Advice(data_share * 0.3, f"each worker keeps 4 batches ready instead of {prefetch}, absorbing "
                              f"slow batches ({ms} data wait per step)",
                              {"data.prefetch_factor": 4}, {"data.prefetch_factor": prefetch}, DATA, seen))
        if not d.persistent_workers:
            out.append(Advice(data_share * 0.2, "the loader's worker processes are started again at every epoch "
                              "boundary; kept alive, the first steps of each epoch stop waiting for them",
                              {"data.persistent_workers": True}, {"data.persistent_workers": False}, DATA, seen))
    if not d.pin_memory and env.get("device") == "cuda":
        out.append(Advice(data_share * 0.1, "batches in page-locked host memory copy to the GPU faster and without "
                          "blocking the step", {"data.pin_memory": True}, {"data.pin_memory": False}, DATA, seen))
    return out


# --------------------------------------------------------------------------- gradient communication
def comm_advice(recipe, env: dict, exposed, comm_share: float, batch: int, dp: int) -> list[Advice]:
    """Bucketed all-reduce settings (DDP and the strategies that share its capability), when exposed
    communication costs more than 10% of the step."""
    s, t, out = recipe.strategy, recipe.trainer, []
    if exposed is None or comm_share <= 0.1 or not s.capabilities().bucketed_allreduce or dp < 2:
        return out
    ms = f"{exposed * 1000:.1f} ms"
    seen = {"comm_exposed_ms": exposed * 1000, "comm_exposed_share": comm_share}
    if s.bucket_cap_mb < 10:
        out.append(Advice(comm_share * 0.6, f"tiny buckets mean many small all-reduces, each paying the full "
                          f"latency; fewer, larger ones cut most of the {ms} exposed per step",
                          {"strategy.bucket_cap_mb": 25.0}, {"strategy.bucket_cap_mb": s.bucket_cap_mb},
                          COMMUNICATION, seen))
    if s.comm_hook == "none":
        backend = env.get("backend")
        hook = "bf16_compress" if backend == "nccl" else "fp16_compress" if backend == "gloo" else None
        if hook:
            why = "" if hook == "bf16_compress" else "; bf16_compress needs NCCL; this run uses gloo"
            out.append(Advice(comm_share * 0.4, f"gradients travel as 16-bit, halving the bytes of each all-reduce: "
                              f"up to ~{exposed * 500:.1f} of the {ms} exposed per step saved (gradients lose "
                              f"precision in transit{why})",
                              {"strategy.comm_hook": hook}, {"strategy.comm_hook": s.comm_hook}, COMMUNICATION, seen))
    accum = t.grad_accum_steps
    new = accum * 4
    changes, was = _with_lr(recipe, "trainer.grad_accum_steps", accum, new, 4)
    out.append(Advice(comm_share * 0.75 * 0.5,
                      f"global batch {batch} → {batch * 4}, one all-reduce per 4x more samples (the {ms} exposed per "
                      f"step is paid once per {new} micro-batches); {_lr_rule(recipe, 4)} — keeping the global batch "
                      f"with a smaller data.batch_size would save nothing", changes, was, COMMUNICATION, seen))
    if not s.static_graph and not s.find_unused_parameters:
        out.append(Advice(comm_share * 0.1, "if the model runs the same graph every step, DDP skips its per-step "
                          "search for unused parameters and can reorder buckets to match the backward order, "
                          "overlapping more of the all-reduce",
                          {"strategy.static_graph": True}, {"strategy.static_graph": False}, COMMUNICATION, seen))
    return out


# --------------------------------------------------------------------------- compute
def compute_advice(recipe, env: dict, busy: Optional[float], batch: int) -> list[Advice]:
    out, d = [], recipe.data
    device = env.get("device")
    if recipe.precision == "fp32" and env.get("bf16"):
        where = "tensor cores" if device == "cuda" else "the CPU's AMX/AVX512-BF16 units"
        out.append(Advice(0.3, f"autocast runs matmuls and convolutions on {where} at 2x or more the fp32 rate "
                          f"(this {device or 'device'} supports bf16); expect the forward/backward time to drop by up "
                          f"to half",
                          {"precision": "bf16"}, {"precision": "fp32"}, COMPUTE, {"bf16": 1.0}))
    if device == "cuda" and busy is not None and busy < GPU_IDLE:
        changes, was = _with_lr(recipe, "data.batch_size", d.batch_size, d.batch_size * 2, 2)
        out.append(Advice(0.1 + (GPU_IDLE - busy) / 200, f"the GPU is busy only {busy:.0f}% of the time, larger "
                          f"kernels keep it fed (if memory allows); global batch {batch} → {batch * 2}, "
                          f"{_lr_rule(recipe, 2)}", changes, was, COMPUTE, {"gpu_busy_percent": busy}))
    return out
