"""The bottleneck report: from measured step phases, say what limits the run and what to change.

Input is the run's evidence (`evidence.Evidence`: every rank's median step breakdown, where the run
ran, its whole-run time accounting, GPU utilisation, the global batch). The run is classified as
straggler-, data-, communication- or compute-bound, with the numbers as evidence and recipe changes
(`advice.Advice`) ranked by the time they could save. Communication counts by its *exposed* part:
with DDP the all-reduce overlaps backward, and only the time the step still waits for it after
compute is done costs anything (in-flight time is shown as evidence, not judged). Written at the end
of every run and on demand (`trainkit report RUN_DIR`); `trainkit tune` tries its changes.

The headline never contradicts the advice: when a compute-bound run's advice is all about another
phase (exposed communication, data wait), the headline names that phase and its share.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..run_dir import WARMUP_STEPS
from . import evidence as evidence_files
from . import mesh_comm as mesh_comm_figures
from .mesh_advice import mesh_advice
from .advice import (COMMUNICATION, COMPUTE, DATA, GPU_IDLE, OVERHEAD, Advice, comm_advice, compute_advice,
                     data_advice, straggler_advice, wall_advice)
from .evidence import Evidence, describe_env
from .loader_rate import LoaderRate, loader_rate

__all__ = ["Advice", "Diagnosis", "diagnose", "diagnose_evidence", "diagnose_run", "describe_env"]

DATA_SHARE, COMM_SHARE = 0.25, 0.25  # a phase taking a quarter of the step is worth fixing first
STRAGGLER_MARGIN = 0.2
WALL_PARTS = ("train", "eval", "checkpoint", "logging", "startup", "shutdown")


@dataclass
class Diagnosis:
    kind: str  # data-bound | communication-bound | straggler-bound | compute-bound | unknown
    headline: str
    evidence: list[str] = field(default_factory=list)
    advice: list[Advice] = field(default_factory=list)
    table: list[list[str]] = field(default_factory=list)
    wall: list[list[str]] = field(default_factory=list)  # whole-run time accounting rows
    mesh: list[list[str]] = field(default_factory=list)  # communication per mesh dimension (header first)
    facts: dict = field(default_factory=dict)  # numbers for tags/metrics: step_ms, data_wait_share, ...

    def ranked(self) -> list[Advice]:
        return sorted(self.advice, key=lambda a: -a.saving)

    def changes(self) -> dict[str, Advice]:
        """Recipe key -> the advice proposing it (the largest expected saving where several do)."""
        out: dict[str, Advice] = {}
        for a in self.ranked():
            if a.key is not None:
                out.setdefault(a.key, a)
        return out

    def tags(self) -> dict[str, str]:
        """MLflow run tags: filterable and sortable in the UI (`tags.trainkit.bottleneck = 'data-bound'`)."""
        out = {"trainkit.bottleneck": self.kind, "trainkit.bottleneck.headline": self.headline[:4000]}
        for i, a in enumerate(self.ranked()[:3], 1):
            out[f"trainkit.advice.{i}"] = a.text[:4000]
        out.update({f"trainkit.{k}": f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in self.facts.items()})
        return out

    def summary(self) -> dict:
        """reports/verdict.json: `advice` as sentences, `advice_data` as fields (changes, mechanism, ...)."""
        ranked = self.ranked()
        return {"kind": self.kind, "headline": self.headline, "advice": [a.text for a in ranked],
                "advice_data": [a.as_dict() for a in ranked], "facts": self.facts, "tags": self.tags()}

    def markdown(self, title: str) -> str:
        lines = [f"# Bottleneck report: {title}", "", f"**{self.kind}**: {self.headline}", ""]
        if self.table:
            lines += ["| " + " | ".join(self.table[0]) + " |", "|" + "---|" * len(self.table[0])]
            lines += ["| " + " | ".join(row) + " |" for row in self.table[1:]]
            lines.append("")
        if self.mesh:
            lines += ["Communication per mesh dimension (time with the dimension's collectives in flight):", ""]
            lines += ["| " + " | ".join(self.mesh[0]) + " |", "|" + "---|" * len(self.mesh[0])]
            lines += ["| " + " | ".join(row) + " |" for row in self.mesh[1:]]
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
    if out.get("backend") is None and backend != "auto":
        out["backend"] = backend
    if out.get("device") is None and out.get("backend") == "nccl":
        out["device"] = "cuda"
    return out


def _wall(recipe, wall: dict) -> tuple[list[list[str]], list[str], list[Advice], dict]:
    """Rows of the wall-time table, evidence, advice and facts from the run's time accounting
    (`runtime.loop.WallTimes.as_dict()`: *_s seconds per part, counts, wall_s)."""
    total = wall.get("wall_s") or 0.0
    if total <= 0:
        return [], [], [], {}
    parts = {p: wall.get(f"{p}_s") or 0.0 for p in WALL_PARTS}
    other = max(0.0, total - sum(parts.values()))
    rows = [[p, f"{v:.2f}", f"{v / total:.0%}"] for p, v in parts.items()] + [["other", f"{other:.2f}",
                                                                                f"{other / total:.0%}"]]
    facts = {f"time.{p}_share": v / total for p, v in parts.items()}
    evidence = ["wall time " + f"{total:.1f} s: " + ", ".join(f"{p} {v / total:.0%}" for p, v in parts.items())]
    return rows, evidence, wall_advice(recipe, parts, total, wall), facts


def diagnose_run(run_dir: Path, recipe) -> Diagnosis:
    """The diagnosis of a finished run from its files (OSError/ValueError: no readable evidence)."""
    return diagnose_evidence(evidence_files.read(run_dir), recipe)


def diagnose_evidence(ev: Evidence, recipe) -> Diagnosis:
    return diagnose(ev.per_rank, recipe, env=ev.env, wall=ev.wall, gpu=ev.gpu, global_batch=ev.global_batch,
                    mesh_comm=ev.mesh_comm)


def diagnose(per_rank: list[dict], recipe, margin: float = STRAGGLER_MARGIN, *, env: Optional[dict] = None,
             wall: Optional[dict] = None, gpu: Optional[dict] = None, global_batch: Optional[int] = None,
             mesh_comm: Optional[list] = None) -> Diagnosis:
    """`env`: {"device": "cuda"|"cpu", "backend": "nccl"|"gloo", "bf16": bool} (what the run could use);
    `wall`: the whole-run time accounting; `gpu`: {"busy_percent": mean NVML utilisation over ranks};
    `mesh_comm`: every rank's communication per mesh dimension (`evidence.Evidence.mesh_comm`)."""
    env = _env(recipe, env)
    wall_rows, wall_evidence, wall_tips, wall_facts = _wall(recipe, wall or {})
    ranks = [r for r in per_rank if r.get("steps")]
    if not ranks:
        return Diagnosis("unknown", f"too few steps to measure (the first {WARMUP_STEPS} steps of a launch are "
                         f"warm-up)", wall_evidence, wall_tips, wall=wall_rows, facts=wall_facts)
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
    dp = recipe.parallel_dims(max(1, len(per_rank))).dp  # per_rank: one report per rank of the world
    batch = global_batch or recipe.global_batch_at(dp)
    busy = (gpu or {}).get("busy_percent")
    mesh = mesh_comm_figures.summarize(mesh_comm, step)
    facts = {"step_ms": step * 1000, "data_wait_share": data_share, **wall_facts, **mesh.facts}
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
    elif not mesh.evidence:
        evidence.append("communication not measured (add the `breakdown` monitor to measure it)")
    evidence += mesh.evidence
    if busy is not None:
        evidence.append(f"GPU busy {busy:.0f}% of the time (NVML utilisation, mean over ranks and samples)")
    rate = loader_rate(_mean(ranks, "loader"), step, data, recipe.data.batch_size * recipe.trainer.grad_accum_steps,
                       recipe.data.num_workers)
    if rate is not None:
        evidence.append(_loader_evidence(rate, recipe.data.num_workers))
        facts.update(loader_samples_per_s=rate.capacity, loader_headroom=rate.headroom)
    evidence += wall_evidence

    if slow:
        worst = max(slow, key=lambda rk: pre[rk])
        host = next(r["host"] for r in ranks if r["rank"] == worst)
        kind = "straggler-bound"
        headline = (f"rank {worst} on {host} needs {pre[worst] * 1000:.1f} ms per step before the gradient "
                    f"all-reduce vs a median of {typical * 1000:.1f} ms; every other rank waits for it")
        advice.append(straggler_advice(worst, host, pre[worst], typical, step))
    elif data_share > DATA_SHARE:
        kind = "data-bound"
        headline = f"{data_share:.0%} of each step waits for data ({data * 1000:.1f} of {step * 1000:.1f} ms)"
    elif exposed is not None and comm_share > COMM_SHARE:
        kind = "communication-bound"
        headline = (f"each step waits {comm_share:.0%} of its time for gradient communication not overlapped "
                    f"with backward ({exposed * 1000:.1f} of {step * 1000:.1f} ms; {comm * 1000:.1f} ms in flight)")
    else:
        kind = "compute-bound"
        headline = f"forward/backward/optimizer take {max(0.0, 1 - data_share - comm_share):.0%} of the step"
        if busy is not None and busy < GPU_IDLE:
            headline += (f"; GPU busy {busy:.0f}% of the time: the host does not keep it fed (kernel launches, "
                         f"small kernels)")

    advice += data_advice(recipe, env, data, data_share, rate)
    advice += comm_advice(recipe, env, exposed, comm_share, batch, dp)
    mesh_tips, withheld = mesh_advice(recipe, per_rank, mesh.facts, step)  # only where the matrix verifies
    advice += mesh_tips
    evidence += withheld
    if kind == "compute-bound":
        advice += compute_advice(recipe, env, busy, batch)
        headline += _elsewhere(advice, data_share, comm_share)
    return Diagnosis(kind, headline, evidence, advice, table, wall=wall_rows, mesh=mesh.table, facts=facts)


def _loader_evidence(rate: LoaderRate, num_workers: int) -> str:
    """The loader's own rate per rank against what the model consumed."""
    who = f"{rate.workers} worker process(es)" if num_workers else "the training process itself (num_workers 0)"
    line = (f"data loader alone: {rate.per_worker:,.0f} samples/s per loader process (read, decode, transform, "
            f"collate), {who}: up to {rate.capacity:,.0f} samples/s per rank; the model alone (the step without "
            f"its data wait) consumes {rate.consumed:,.0f} samples/s per rank")
    if not num_workers:
        return line + f" (loading inside the step: each step pays for it; {rate.workers_needed()} worker process(es) " \
                      f"would keep up)"
    if rate.headroom < 1.05:
        return line + f" -- the loader is the limit: {rate.workers_needed()} loader processes would keep up"
    return line + f" -- {rate.headroom:.1f}x headroom"


def _elsewhere(advice: list[Advice], data_share: float, comm_share: float) -> str:
    """A compute-bound headline's pointer to the phases the advice addresses, when none of it is compute."""
    phases = {a.phase for a in advice}
    if not advice or COMPUTE in phases:
        return ""
    parts = []
    if COMMUNICATION in phases:
        parts.append(f"exposed gradient communication {comm_share:.0%} of the step")
    if DATA in phases:
        parts.append(f"data wait {data_share:.0%} of the step")
    if OVERHEAD in phases:
        parts.append("time outside the steps")
    return f"; the advice below targets the rest: {', '.join(parts)}" if parts else ""
