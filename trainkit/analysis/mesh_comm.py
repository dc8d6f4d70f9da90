"""The bottleneck report's communication per mesh dimension: which dimension's collectives cost most.

From the evidence's `mesh_comm` (every rank's mean per step, per dimension, written by the
`breakdown` monitor: seconds with a collective of the dimension in flight, bytes handed to its
collectives, their count, those not timed). The figures are in-flight time, not exposed time: how
much of it overlapped compute is not measured per dimension (see runtime.mesh_comm), so they are
evidence for choosing the mesh (e.g. tp inside a node), not a verdict of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MeshComm:
    table: list[list[str]] = field(default_factory=list)  # header row, then one row per dimension
    evidence: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # comm_<dim>_ms, comm_costliest_dim


def _mean(per_rank: list[dict], dim: str, key: str) -> float:
    values = [r[dim].get(key, 0) for r in per_rank if dim in r]
    return sum(values) / len(values) if values else 0.0


def summarize(per_rank: list[dict] | None, step_s: float) -> MeshComm:
    """Rows (mean over ranks, the slowest rank's time), the sentence naming the costliest dimension,
    and facts; empty when the run measured none. `step_s`: the median step, for shares."""
    ranks = [r for r in per_rank or [] if r]
    dims = sorted({d for r in ranks for d in r}, key=lambda d: -_mean(ranks, d, "s"))
    if not dims:
        return MeshComm()
    out = MeshComm(table=[["mesh dimension", "in flight ms/step", "share of step", "slowest rank ms", "MB/step",
                           "collectives/step", "not timed/step"]])
    for dim in dims:
        seconds = _mean(ranks, dim, "s")
        slowest = max(r[dim].get("s", 0.0) for r in ranks if dim in r)
        share = seconds / step_s if step_s > 0 else 0.0
        out.table.append([dim, f"{seconds * 1000:.1f}", f"{share:.0%}", f"{slowest * 1000:.1f}",
                          f"{_mean(ranks, dim, 'bytes') / 1e6:.2f}", f"{_mean(ranks, dim, 'count'):.0f}",
                          f"{_mean(ranks, dim, 'untimed'):.0f}"])
        out.facts[f"comm_{dim}_ms"] = seconds * 1000
    top = dims[0]
    others = ", ".join(f"{d} {_mean(ranks, d, 's') * 1000:.1f} ms" for d in dims[1:])
    out.facts["comm_costliest_dim"] = top
    out.evidence.append(
        f"communication per mesh dimension: {top} costs most, {_mean(ranks, top, 's') * 1000:.1f} ms per step with "
        f"its collectives in flight ({out.table[1][2]} of the step, {out.table[1][4]} MB)"
        + (f"; then {others}" if others else "")
        + " (in flight, mean over ranks; how much of it overlaps compute is not measured per dimension)")
    untimed = [d for d in dims if _mean(ranks, d, "untimed") > 0]
    if untimed:
        out.evidence.append(f"not timed (the backend's work has no completion callback, e.g. gloo's send/recv): "
                            f"{', '.join(untimed)}'s asynchronous collectives, counted in bytes only")
    return out
