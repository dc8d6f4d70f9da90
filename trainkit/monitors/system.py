"""`system`: CPU %, RSS of this node's training processes, host memory, disk and network I/O rates
(psutil), on one process per node (local rank 0), tagged by node.

Sampled at run start, at every log step and every `interval_s` in a background thread (whichever
comes first), so a 30-step run still logs system/* points; rates are over the time since the
previous sample."""

from __future__ import annotations

import threading
import time
from typing import Optional

import psutil

from ..processes import WORKER
from .base import Monitor

MB = 1024 * 1024
MIN_RATE_WINDOW_S = 0.05  # a shorter window gives noise, not a rate: keep the previous rates


class SystemMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.latest: dict = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._previous: Optional[tuple] = None  # (disk counters, net counters, monotonic time)
        self._workers_cache: Optional[list[psutil.Process]] = None
        if ctx.local_rank == 0:
            psutil.cpu_percent(None)
            self._previous = (psutil.disk_io_counters(), psutil.net_io_counters(), time.monotonic())
            self._thread = threading.Thread(target=self._run, name="trainkit-system", daemon=True)
            self._thread.start()

    def _workers(self) -> list[psutil.Process]:
        """This node's training processes: the torchrun agent's children (or just us)."""
        if self._workers_cache is not None:
            return self._workers_cache
        me = psutil.Process()
        try:
            parent = me.parent()
            siblings = [p for p in parent.children() if WORKER in " ".join(p.cmdline())]
            self._workers_cache = siblings or [me]
        except (psutil.Error, AttributeError):
            self._workers_cache = [me]
        return self._workers_cache

    def _run(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            self.sample()

    def sample(self) -> dict:
        """One reading now (any thread); returns it and keeps it as `latest`."""
        with self._lock:
            now_disk, now_net, now = psutil.disk_io_counters(), psutil.net_io_counters(), time.monotonic()
            disk, net, t = self._previous
            rss = 0
            for p in self._workers():
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            vm = psutil.virtual_memory()
            sample = {"cpu_percent": psutil.cpu_percent(None), "workers_rss_mb": rss / MB,
                      "memory_used_percent": vm.percent, "memory_available_mb": vm.available / MB}
            dt = now - t
            if dt >= MIN_RATE_WINDOW_S:
                if disk and now_disk:
                    sample["disk_read_mb_s"] = (now_disk.read_bytes - disk.read_bytes) / MB / dt
                    sample["disk_write_mb_s"] = (now_disk.write_bytes - disk.write_bytes) / MB / dt
                if net and now_net:
                    sample["net_recv_mb_s"] = (now_net.bytes_recv - net.bytes_recv) / MB / dt
                    sample["net_sent_mb_s"] = (now_net.bytes_sent - net.bytes_sent) / MB / dt
                self._previous = (now_disk, now_net, now)
            else:
                sample.update({k: v for k, v in self.latest.items() if k.endswith("_mb_s")})
            self.latest = sample
            return dict(sample)

    def on_run_start(self) -> None:
        if self.ctx.local_rank == 0:
            self.sample()

    def collect(self, step: int) -> dict:
        if self.ctx.local_rank != 0:
            return {}
        return {"node": self.ctx.node_rank, "values": self.sample()}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        out = {}
        for entry in per_rank:
            if entry:
                out.update({f"system/node{entry['node']}/{k}": v for k, v in entry["values"].items()})
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
