"""The evidence a bottleneck diagnosis reasons from, and the one reader of it from a run's files.

Rank 0 writes it when training ends (reports/breakdown.json: every rank's median step phases, where
the run ran, its whole-run time accounting, GPU busy, the global batch); the end-of-run report,
`trainkit report` and `trainkit tune` all read it back with `read()`, so each of them diagnoses the
same run from the same facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from ..run_dir import BREAKDOWN, read_evidence, report_path, write_json


@dataclass(frozen=True)
class Evidence:
    per_rank: list[dict]  # every rank's median step phases (runtime.stats.RunStats): total, data_wait, ...
    env: dict = field(default_factory=dict)  # {"device": "cuda"|"cpu", "backend": "nccl"|"gloo", "bf16": bool}
    wall: Optional[dict] = None  # whole-run time accounting (runtime.loop.WallTimes.as_dict())
    gpu: Optional[dict] = None  # {"busy_percent": mean NVML utilisation over ranks} (the gpu monitor)
    # every rank's communication per mesh dimension, per step: [{dim: {"s", "bytes", "count", "untimed"}}]
    # (the breakdown monitor with a device mesh: runtime.mesh_comm)
    mesh_comm: Optional[list] = None
    global_batch: Optional[int] = None  # samples per optimizer step as the run measured them
    steps: Optional[int] = None
    world_size: Optional[int] = None
    name: str = ""

    @classmethod
    def from_record(cls, record: dict) -> "Evidence":
        known = {k: record[k] for k in cls.__dataclass_fields__ if record.get(k) is not None}
        return cls(**known)


def write(run_dir: Path, evidence: Evidence) -> None:
    write_json(report_path(run_dir, BREAKDOWN), asdict(evidence))


def read(run_dir: Path) -> Evidence:
    """The evidence of a finished run (OSError: none written; ValueError: cut short by a crash)."""
    return Evidence.from_record(read_evidence(run_dir))


def describe_env(device: str, backend: Optional[str]) -> dict:
    """What advice may assume about where the run ran: device type, process-group backend, and whether
    bf16 runs fast there (a CUDA GPU that supports it; a CPU with AMX or AVX512-BF16)."""
    bf16 = False
    try:
        if device == "cuda":
            import torch

            bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))  # V100/T4 only emulate it
        else:
            with open("/proc/cpuinfo") as f:
                flags = f.read(200_000)
            bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    except Exception:
        pass
    return {"device": device, "backend": backend, "bf16": bf16}
