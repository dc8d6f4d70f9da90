"""`throughput`: samples/s, step-time p50/p95 and MFU.

FLOPs per step come from the recipe's task (`Task.flops_per_microbatch`): classification counts
them with `torch.utils.flop_counter.FlopCounterMode` on a meta-device copy of the model (no memory,
no effect on training); causal_lm uses 6·N plus the attention term per token. MFU divides achieved FLOP/s by
the device's peak from a table of known GPUs; on CPU only achieved FLOP/s is reported.
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch

from .. import registry
from .base import Monitor

# dense peak TFLOP/s per GPU: (bf16/fp16 tensor cores, tf32 for fp32 training)
PEAK_TFLOPS = {
    "H200": (989.0, 494.0), "H100 SXM": (989.0, 494.0), "H100 NVL": (835.0, 418.0), "H100 PCIe": (756.0, 378.0),
    "H100": (989.0, 494.0), "GH200": (989.0, 494.0), "B200": (2250.0, 1100.0),
    "A100": (312.0, 156.0), "A800": (312.0, 156.0), "A10G": (70.0, 35.0), "A10": (125.0, 62.5),
    "L40S": (362.0, 183.0), "L40": (181.0, 90.5), "L4": (121.0, 60.0), "V100": (125.0, 15.7), "T4": (65.0, 8.1),
    "RTX 4090": (165.0, 82.6), "RTX 3090": (71.0, 35.6),
}


def peak_flops(device: torch.device, precision: str) -> Optional[float]:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, tf32) in PEAK_TFLOPS.items():  # most specific names first in the table
        if key in name:
            return (half if precision in ("bf16", "fp16") else tf32) * 1e12
    return None


def count_step_flops(recipe) -> Optional[float]:
    """FLOPs of one forward+backward of one micro-batch per rank, as the recipe's task estimates them
    (classification counts them with FlopCounterMode on the meta device; causal_lm uses 6·N +
    attention per token)."""
    try:
        task = registry.component(recipe.task)(recipe.task, device=torch.device("meta"), recipe=recipe)
        return task.flops_per_microbatch()
    except Exception:  # exotic models: report throughput without MFU rather than fail the run
        return None


class ThroughputMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.times: list[float] = []
        self.flops: Optional[float] = None
        self.peak = peak_flops(ctx.device, ctx.recipe.precision)

    def on_run_start(self) -> None:
        if self.ctx.rank == 0:
            self.flops = count_step_flops(self.ctx.recipe)
            if self.flops:
                self.ctx.facts["flops_per_microbatch"] = self.flops

    def on_step_end(self, step, times) -> None:
        self.times.append(times.total)
        self.times = self.times[-self.options.window:]

    def collect(self, step: int) -> dict:
        return {"times": list(self.times)}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        times = per_rank[0]["times"]
        if not times:
            return {}
        r = self.ctx.recipe
        dp = self.ctx.strategy.data_parallel_size
        p50 = statistics.median(times)
        p95 = sorted(times)[min(len(times) - 1, int(0.95 * len(times)))]
        out = {"throughput/samples_per_s": r.data.batch_size * dp * r.trainer.grad_accum_steps / p50,
               "throughput/step_time_p50_s": p50, "throughput/step_time_p95_s": p95}
        if self.flops:
            achieved = self.flops * r.trainer.grad_accum_steps / p50  # per rank
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
