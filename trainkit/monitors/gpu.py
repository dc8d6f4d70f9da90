"""`gpu`: utilisation, memory, power and temperature of this rank's GPU via NVML (nvidia-ml-py).
Without a GPU or NVML it says so once and does nothing."""

from __future__ import annotations

import sys

from .base import Monitor

MB = 1024 * 1024


class GpuMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.handle = None
        if ctx.device.type != "cuda":
            if ctx.rank == 0:
                print("trainkit: gpu monitor: no GPU in use; it reports nothing", file=sys.stderr, flush=True)
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            index = ctx.device.index or 0
            import os

            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [v.strip() for v in visible.split(",")] if visible else []
            if index < len(ids) and ids[index].startswith(("GPU-", "MIG-")):
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(ids[index])
            else:
                if index < len(ids) and ids[index].isdigit():
                    index = int(ids[index])
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:
            if ctx.rank == 0:
                print(f"trainkit: gpu monitor: NVML unavailable ({exc}); it reports nothing", file=sys.stderr)

    def collect(self, step: int) -> dict:
        """Each NVML query on its own: MIG slices and some boards do not support all of them."""
        if self.handle is None:
            return {}
        n, h, out = self.nvml, self.handle, {}
        queries = {
            "utilization_percent": lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu),
            "memory_utilization_percent": lambda: float(n.nvmlDeviceGetUtilizationRates(h).memory),
            "memory_used_mb": lambda: n.nvmlDeviceGetMemoryInfo(h).used / MB,
            "power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "temperature_c": lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
        }
        for key, query in queries.items():
            try:
                out[key] = query()
            except Exception:  # NVMLError_NotSupported and friends: skip that metric
                pass
        return out

    def report(self, step: int, per_rank: list[dict]) -> dict:
        return {f"gpu/rank{r}/{k}": v for r, values in enumerate(per_rank) for k, v in values.items()}
