"""`gpu`: utilisation, memory, power and temperature of this rank's GPU via NVML (nvidia-ml-py),
sampled every `interval_s` by a background thread; each log step reports the min/mean/max of the
samples since the previous one (a single reading at log steps would see only what the GPU does while
the loop logs). Without a GPU or NVML it says so once and does nothing."""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Optional

from ..run_dir import GPU, REPORTS, write_json
from .base import Monitor

MB = 1024 * 1024


def nvml_reader(device, rank: int) -> Optional[Callable[[], dict]]:
    """A function returning one NVML reading of `device` ({metric: value}), or None without NVML."""
    if device.type != "cuda":
        if rank == 0:
            print("trainkit: gpu monitor: no GPU in use; it reports nothing", file=sys.stderr, flush=True)
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        index = device.index or 0
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in visible.split(",")] if visible else []
        if index < len(ids) and ids[index].startswith(("GPU-", "MIG-")):
            handle = pynvml.nvmlDeviceGetHandleByUUID(ids[index])
        else:
            if index < len(ids) and ids[index].isdigit():
                index = int(ids[index])
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        if rank == 0:
            print(f"trainkit: gpu monitor: NVML unavailable ({exc}); it reports nothing", file=sys.stderr)
        return None
    n, h = pynvml, handle
    queries = {
        "utilization_percent": lambda: float(n.nvmlDeviceGetUtilizationRates(h).gpu),
        "memory_utilization_percent": lambda: float(n.nvmlDeviceGetUtilizationRates(h).memory),
        "memory_used_mb": lambda: n.nvmlDeviceGetMemoryInfo(h).used / MB,
        "power_w": lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,
        "temperature_c": lambda: float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
    }

    def read() -> dict:
        """Each NVML query on its own: MIG slices and some boards do not support all of them."""
        out = {}
        for key, query in queries.items():
            try:
                out[key] = query()
            except Exception:  # NVMLError_NotSupported and friends: skip that metric
                pass
        return out

    return read


class Sampler:
    """Calls `read()` every `interval_s` on a daemon thread and keeps min/sum/max per metric until `take()`."""

    def __init__(self, read: Callable[[], dict], interval_s: float):
        self.read, self.interval_s = read, interval_s
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._window: dict[str, list] = {}  # metric -> [min, sum, max, count]
        self._thread = threading.Thread(target=self._run, name="trainkit-gpu-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        values = self.read()
        with self._lock:
            for key, v in values.items():
                w = self._window.get(key)
                if w is None:
                    self._window[key] = [v, v, v, 1]
                else:
                    w[0], w[1], w[2], w[3] = min(w[0], v), w[1] + v, max(w[2], v), w[3] + 1

    def take(self) -> dict:
        """{metric: value} as mean, plus `metric_min` / `metric_max`, over the samples since the last call."""
        with self._lock:
            window, self._window = self._window, {}
        out = {}
        for key, (lo, total, hi, n) in window.items():
            out[key], out[f"{key}_min"], out[f"{key}_max"] = total / n, lo, hi
        out["samples"] = max((w[3] for w in window.values()), default=0)
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(1.0, 2 * self.interval_s))


class GpuMonitor(Monitor):
    """Also keeps the run-long mean utilisation per rank: `finish` writes it to reports/gpu.json, where
    the bottleneck verdict reads it ("GPU busy 43% of the time")."""

    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        read = nvml_reader(ctx.device, ctx.rank)
        self.sampler = Sampler(read, options.interval_s).start() if read is not None else None
        self.busy = [0.0, 0]  # utilisation sum and sample windows over the run

    def collect(self, step: int) -> dict:
        if self.sampler is None:
            return {}
        values = self.sampler.take()
        if not values.pop("samples"):  # a log interval shorter than interval_s: one reading now
            self.sampler.sample()
            values = self.sampler.take()
            values.pop("samples")
        if "utilization_percent" in values:
            self.busy[0] += values["utilization_percent"]
            self.busy[1] += 1
        if step == -1:  # the end of the run: the run-long mean rides along for finish()
            values["run_utilization_percent"] = self.busy[0] / self.busy[1] if self.busy[1] else None
        return values

    def finish(self, per_rank: list[dict]):
        busy = [r.get("run_utilization_percent") for r in per_rank if r.get("run_utilization_percent") is not None]
        if not busy:
            return None
        mean = sum(busy) / len(busy)
        reports = self.ctx.run_dir / REPORTS
        reports.mkdir(exist_ok=True)
        write_json(reports / GPU, {"busy_percent": mean, "per_rank": busy}, indent=None)
        return "## GPU\n\n" + "\n".join(f"- rank {r}: busy {b:.0f}% of the time" for r, b in enumerate(busy)) + "\n"

    def report(self, step: int, per_rank: list[dict]) -> dict:
        return {f"gpu/rank{r}/{k}": v for r, values in enumerate(per_rank) for k, v in values.items()}

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
