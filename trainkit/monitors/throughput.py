"""`throughput`: samples/s, step-time p50/p95 and MFU.

FLOPs per step come from the recipe's task (`Task.flops_per_microbatch`): classification counts
them with `torch.utils.flop_counter.FlopCounterMode` on a meta-device copy of the model (no memory,
no effect on training); causal_lm uses 6·N plus the attention term per token. With the pipeline
strategy each rank counts only its own stages (image models; a language model's stages are credited
with the whole model). MFU divides achieved FLOP/s by the peak of what actually runs on this GPU
(bf16/fp16 tensor cores, TF32 only with `performance.tf32: true`, else plain fp32), from a table of
known GPUs matched on the device name; on CPU only achieved FLOP/s is reported.
"""

from __future__ import annotations

import re
import statistics
from typing import Optional

import torch

from ..runtime.model import build_model
from .base import Monitor

# Dense peak TFLOP/s per GPU, matched on `torch.cuda.get_device_name()` ("NVIDIA H100 80GB HBM3",
# "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-16GB", ...): the first pattern that
# matches wins, so specific variants come before their family. Columns: bf16/fp16 tensor cores,
# TF32 tensor cores (None: no TF32), plain fp32 (CUDA cores) -- the one that matches what runs.
PEAK_TFLOPS: list[tuple[str, tuple[float, Optional[float], float]]] = [
    (r"\bGH200\b", (989.0, 494.0, 67.0)),
    (r"\bH200\b", (989.0, 494.0, 67.0)),
    (r"\bH100\b.*\bNVL\b", (835.0, 418.0, 60.0)),
    (r"\bH100\b.*\bPCIe\b", (756.0, 378.0, 51.0)),
    (r"\bH100\b", (989.0, 494.0, 67.0)),  # SXM: "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    (r"\bH800\b.*\bPCIe\b", (756.0, 378.0, 51.0)),
    (r"\bH800\b", (989.0, 494.0, 67.0)),
    (r"\bB200\b", (2250.0, 1100.0, 80.0)),
    (r"\bA100\b", (312.0, 156.0, 19.5)),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"
    (r"\bA800\b", (312.0, 156.0, 19.5)),
    (r"\bA10G\b", (70.0, 35.0, 31.2)),
    (r"\bA10\b", (125.0, 62.5, 31.2)),
    (r"\bL40S\b", (362.0, 183.0, 91.6)),
    (r"\bL40\b", (181.0, 90.5, 90.5)),
    (r"\bL4\b", (121.0, 60.0, 30.3)),
    (r"\bV100\b", (125.0, None, 15.7)),  # fp16 tensor cores only (no bf16, no TF32)
    (r"\bT4\b", (65.0, None, 8.1)),
    (r"\bRTX 4090\b", (165.0, 82.6, 82.6)),
    (r"\bRTX 3090\b", (71.0, 35.6, 35.6)),
]


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> Optional[float]:
    """Dense peak TFLOP/s of `device_name` for what runs: bf16/fp16 tensor cores, TF32 only when it is
    on (recipe `performance.tf32`), else plain fp32. None for an unknown device."""
    for pattern, (half, tf32_peak, fp32) in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            if precision in ("bf16", "fp16"):
                return half
            return tf32_peak if tf32 and tf32_peak else fp32
    return None


def peak_flops(device: torch.device, precision: str, tf32: bool = False) -> Optional[float]:
    if device.type != "cuda":
        return None
    peak = peak_tflops(torch.cuda.get_device_name(device), precision, tf32)
    return None if peak is None else peak * 1e12


def _image_input(data) -> Optional[torch.Tensor]:
    shape = getattr(data, "shape", None)
    if shape is None and hasattr(data, "image_size"):
        shape = [3, data.image_size, data.image_size]
    return None if shape is None else torch.empty(data.batch_size, *shape)


def count_step_flops(run, strategy=None) -> Optional[float]:
    """FLOPs of one forward+backward of one micro-batch on this rank (`run`: monitors.base.RunFacts). A
    strategy that splits the model across ranks (pipeline) credits each rank with its own part
    (`Strategy.flops_of_rank`); otherwise the run's task estimates the whole model's (classification:
    FlopCounterMode on the meta device; causal_lm: 6·N + attention per token)."""
    try:
        if strategy is not None and strategy.splits_model:
            with torch.device("meta"):
                x = _image_input(run.data)
                if x is not None:
                    model = build_model(run.model_spec.model_copy(update={"weights": None}))
                    of_rank = strategy.flops_of_rank(model, x)
                    if of_rank is not None:
                        return float(of_rank)
        return run.task.flops_per_microbatch()
    except Exception:  # exotic models: report throughput without MFU rather than fail the run
        return None


class ThroughputMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.times: list[float] = []
        self.flops: Optional[float] = None
        self.peak = peak_flops(ctx.device, ctx.run.precision, tf32=ctx.run.tf32)
        self.per_rank_flops = ctx.strategy.splits_model  # ranks do different work

    def on_run_start(self) -> None:
        if self.ctx.rank == 0 or self.per_rank_flops:
            self.flops = count_step_flops(self.ctx.run, self.ctx.strategy)
            if self.flops and not self.per_rank_flops:
                # the ranks of one data-parallel group (tensor parallel) split its model's work: each
                # rank's share, so MFU is per rank as on a plain data-parallel run
                self.flops /= self.ctx.strategy.ranks_per_batch
            if self.flops:
                self.ctx.facts["flops_per_microbatch"] = self.flops

    def on_step_end(self, step, times) -> None:
        self.times.append(times.total)
        self.times = self.times[-self.options.window:]

    def collect(self, step: int) -> dict:
        return {"times": list(self.times), "flops": self.flops}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        times = per_rank[0]["times"]
        if not times:
            return {}
        r = self.ctx.run
        dp = self.ctx.strategy.data_parallel_size
        p50 = statistics.median(times)
        p95 = sorted(times)[min(len(times) - 1, int(0.95 * len(times)))]
        out = {"throughput/samples_per_s": r.global_batch_at(dp) / p50,
               "throughput/step_time_p50_s": p50, "throughput/step_time_p95_s": p95}
        flops = [p.get("flops") for p in per_rank] if self.per_rank_flops else [self.flops]
        if all(flops):
            achieved = sum(flops) / len(flops) * r.grad_accum_steps / p50  # mean per rank
            out["throughput/tflops_per_rank"] = achieved / 1e12
            if self.peak:
                out["throughput/mfu"] = achieved / self.peak
        return out

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        metrics = self.report(-1, per_rank)
        if not metrics:
            return None
        lines = [f"- {k.split('/', 1)[1]}: {v:.4g}" for k, v in metrics.items()]
        if self.flops and not self.peak:
            lines.append("- MFU: no peak FLOP/s known for this device (CPU or an unlisted GPU)")
        return "## Throughput\n\n" + "\n".join(lines) + "\n"
