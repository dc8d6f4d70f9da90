"""The bottleneck report: from measured step phases, say what limits the run and what to change.

Input is every rank's mean step breakdown (runtime.stats.RunStats). The run is classified as
straggler-, data-, communication- or compute-bound, with the numbers as evidence and concrete recipe
changes ranked by the time they could save. Communication counts by its *exposed* part: with DDP the
all-reduce overlaps backward, and only the time the step still waits for it after compute is done
costs anything (in-flight time is shown as evidence, not judged). Written at the end of every run and on demand
(`trainkit report RUN_DIR`).
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Optional

DATA_SHARE, COMM_SHARE = 0.25, 0.25  # a phase taking a quarter of the step is worth fixing first
STRAGGLER_MARGIN = 0.2


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

    def markdown(self, title: str) -> str:
        lines = [f"# Bottleneck report: {title}", "", f"**{self.kind}**: {self.headline}", ""]
        if self.table:
            lines += ["| " + " | ".join(self.table[0]) + " |", "|" + "---|" * len(self.table[0])]
            lines += ["| " + " | ".join(row) + " |" for row in self.table[1:]]
            lines.append("")
        if self.evidence:
            lines += ["Evidence:", *[f"- {e}" for e in self.evidence], ""]
        if self.advice:
            lines += ["What to change (largest expected saving first):"]
            lines += [f"{i}. {a.text}" for i, a in enumerate(sorted(self.advice, key=lambda a: -a.saving), 1)]
        return "\n".join(lines) + "\n"

    def console(self) -> str:
        top = sorted(self.advice, key=lambda a: -a.saving)[:2]
        return "\n".join([f"trainkit: bottleneck: {self.kind}: {self.headline}"]
                         + [f"trainkit:   -> {a.text}" for a in top])


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _mean(ranks: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in ranks if key in r]
    return sum(values) / len(values) if values else None


def diagnose(per_rank: list[dict], recipe, margin: float = STRAGGLER_MARGIN) -> Diagnosis:
    ranks = [r for r in per_rank if r.get("steps")]
    if not ranks:
        return Diagnosis("unknown", "too few steps to measure (the first 2 steps of a launch are warm-up)")
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
    d = recipe.data
    advice: list[Advice] = []
    evidence = [f"median step {step * 1000:.1f} ms over {min(r['steps'] for r in ranks)} measured steps per rank",
                f"data wait {data_share:.0%} of the step ({data * 1000:.1f} ms)"]
    if comm is not None:
        evidence.append(f"gradient communication in flight {comm / step:.0%} of the step ({comm * 1000:.1f} ms)")
        evidence.append(f"exposed communication (the step waits for it after backward compute is done; the rest "
                        f"overlaps backward) {comm_share:.0%} of the step ({exposed * 1000:.1f} ms)")
    else:
        evidence.append("communication not measured (add the `breakdown` monitor to measure it)")

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

    # data loader advice (whenever data wait is visible)
    if data_share > 0.05:
        cpus = os.cpu_count() or 1
        per_rank = max(1, cpus // max(1, recipe.launch.nproc_per_node))
        if d.num_workers == 0:
            advice.append(Advice(data_share * 0.9, f"set data.num_workers: {min(per_rank, 8)} (now 0): decoding and "
                                 f"augmentation run inside the training process and stall it {data * 1000:.1f} ms "
                                 f"per step ({data_share:.0%})"))
        else:
            if d.num_workers < per_rank:
                advice.append(Advice(data_share * 0.6, f"raise data.num_workers from {d.num_workers} towards "
                                     f"{min(per_rank, 16)} ({data_share:.0%} of the step still waits for data)"))
            if (d.prefetch_factor or 2) < 4:
                advice.append(Advice(data_share * 0.3, f"raise data.prefetch_factor to 4 (now {d.prefetch_factor or 2})"))
            if not d.persistent_workers:
                advice.append(Advice(data_share * 0.2, "set data.persistent_workers: true (workers restart every epoch)"))
        if not d.pin_memory and getattr(recipe, "_on_cuda", False):
            advice.append(Advice(data_share * 0.1, "set data.pin_memory: true (faster host-to-GPU copies)"))
    # communication advice
    s = recipe.strategy
    if exposed is not None and comm_share > 0.1 and s.name == "ddp":
        if s.bucket_cap_mb < 10:
            advice.append(Advice(comm_share * 0.6, f"raise strategy.bucket_cap_mb from {s.bucket_cap_mb:g} to 25: tiny "
                                 f"buckets mean many small all-reduces, each paying the full latency"))
        if s.comm_hook == "none":
            advice.append(Advice(comm_share * 0.4, "set strategy.comm_hook: bf16_compress (or fp16_compress) to halve "
                                 "the bytes each all-reduce sends"))
        if recipe.trainer.grad_accum_steps == 1:
            advice.append(Advice(comm_share * 0.5, "use trainer.grad_accum_steps: 4 with a 4x smaller data.batch_size: "
                                 "gradients are all-reduced once per 4 micro-batches (no_sync)"))
        if not s.static_graph:
            advice.append(Advice(comm_share * 0.1, "set strategy.static_graph: true if the model runs the same "
                                 "graph every step (lets DDP overlap and skip checks)"))
    # compute advice
    if kind == "compute-bound":
        if recipe.precision == "fp32":
            advice.append(Advice(0.3, "set precision: bf16 (autocast): matrix units run 2x or more faster than fp32 "
                                 "on recent GPUs and CPUs with AMX/AVX512-BF16"))
        advice.append(Advice(0.1, "raise data.batch_size if memory allows (better device utilisation per step)"))
    return Diagnosis(kind, headline, evidence, advice, table)
