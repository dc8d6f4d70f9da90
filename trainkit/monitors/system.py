"""`system`: CPU %, RSS of this node's training processes, host memory, disk and network I/O rates
(psutil), sampled in a background thread on one process per node (local rank 0) and tagged by node."""

from __future__ import annotations

import os
import threading
import time
from typing import Optional

import psutil

from .base import Monitor

MB = 1024 * 1024


class SystemMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.latest: dict = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        if ctx.local_rank == 0:
            self._thread = threading.Thread(target=self._sample, name="trainkit-system", daemon=True)
            self._thread.start()

    def _workers(self) -> list[psutil.Process]:
        """This node's training processes: the torchrun agent's children (or just us)."""
        me = psutil.Process()
        try:
            parent = me.parent()
            siblings = [p for p in parent.children() if "trainkit.runtime.worker" in " ".join(p.cmdline())]
            return siblings or [me]
        except (psutil.Error, AttributeError):
            return [me]

    def _sample(self) -> None:
        psutil.cpu_percent(None)
        disk, net, t = psutil.disk_io_counters(), psutil.net_io_counters(), time.monotonic()
        workers = self._workers()
        while not self._stop.wait(self.options.interval_s):
            now_disk, now_net, now = psutil.disk_io_counters(), psutil.net_io_counters(), time.monotonic()
            dt = max(now - t, 1e-6)
            rss = 0
            for p in workers:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            vm = psutil.virtual_memory()
            sample = {"cpu_percent": psutil.cpu_percent(None), "workers_rss_mb": rss / MB,
                      "memory_used_percent": vm.percent, "memory_available_mb": vm.available / MB}
            if disk and now_disk:
                sample["disk_read_mb_s"] = (now_disk.read_bytes - disk.read_bytes) / MB / dt
                sample["disk_write_mb_s"] = (now_disk.write_bytes - disk.write_bytes) / MB / dt
            if net and now_net:
                sample["net_recv_mb_s"] = (now_net.bytes_recv - net.bytes_recv) / MB / dt
                sample["net_sent_mb_s"] = (now_net.bytes_sent - net.bytes_sent) / MB / dt
            self.latest = sample
            disk, net, t = now_disk, now_net, now

    def collect(self, step: int) -> dict:
        return {"node": self.ctx.node_rank, "values": dict(self.latest)} if self.ctx.local_rank == 0 else {}

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
