"""`prometheus`: live metrics at http://HOST:PORT/metrics on each node's local rank 0 (prometheus_client).

What each endpoint carries:
- every node: its serving rank's progress, updated every step (`trainkit_step`, `trainkit_step_seconds`,
  `trainkit_data_wait_seconds`), labelled `rank` and `host`;
- node 0 (global rank 0) in addition, at every log step: what the run logs -- `trainkit_loss`,
  `trainkit_samples_per_second`, `trainkit_learning_rate`, every rank's step phases from the log-step
  gather (`trainkit_step_phase_seconds{rank,host,phase}`), the `system` and `gpu` monitors' values
  (`trainkit_system_*{node}`, `trainkit_gpu_*{rank}`), and any other logged scalar as
  `trainkit_metric{name=...}`.

Bound to 127.0.0.1 unless the recipe sets `host` (the endpoint has no authentication: a warning says
so). `trainkit run` checks the port is free before it launches (`doctor`'s "monitor ports" check).
docs/grafana-dashboard.json queries these names.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

from .base import Monitor, StepTimes

LOOPBACK = ("127.0.0.1", "localhost", "::1")
PHASES = ("data_wait", "forward", "backward", "optimizer", "comm", "comm_exposed", "total")
# logged metric -> (Prometheus name, help)
NAMED = {"loss": ("trainkit_loss", "training loss, mean over the log interval"),
         "samples_per_s": ("trainkit_samples_per_second", "global samples per second"),
         "lr": ("trainkit_learning_rate", "learning rate of the first param group"),
         "grad_norm": ("trainkit_grad_norm", "global gradient norm before clipping")}
# families declared up front so a dashboard finds them before (or without) their first value
SYSTEM = ("cpu_percent", "workers_rss_mb", "memory_used_percent", "memory_available_mb", "disk_read_mb_s",
          "disk_write_mb_s", "net_recv_mb_s", "net_sent_mb_s")
GPU = ("utilization_percent", "memory_utilization_percent", "memory_used_mb", "power_w", "temperature_c")


def _metric_name(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", text)


class PrometheusMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.server = None
        self.pending: list[StepTimes] = []
        if ctx.local_rank != 0:
            return
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        if options.host not in LOOPBACK:
            print(f"trainkit: warning: prometheus monitor binds {options.host}:{options.port}: anyone who can reach "
                  f"this machine can read the run's metrics (no authentication; default 127.0.0.1)",
                  file=sys.stderr, flush=True)
        self.registry = registry = CollectorRegistry()
        self.Gauge = Gauge
        who = ["rank", "host"]
        self.g = {
            "step": Gauge("trainkit_step", "optimizer steps done", who, registry=registry),
            "step_seconds": Gauge("trainkit_step_seconds", "host time of the last step", who, registry=registry),
            "data_wait": Gauge("trainkit_data_wait_seconds", "time the last step waited for data", who,
                               registry=registry),
            "phase": Gauge("trainkit_step_phase_seconds", "mean step phase over the last log interval",
                           who + ["phase"], registry=registry),
        }
        for key, (name, text) in NAMED.items():
            self.g[key] = Gauge(name, text, who, registry=registry)
        self.g["metric"] = Gauge("trainkit_metric", "any other logged scalar, by name", who + ["name"],
                                 registry=registry)
        self.families: dict[str, object] = {}
        for k in SYSTEM:
            self._family(f"trainkit_system_{k}", ["node", "host"])
        for k in GPU:
            self._family(f"trainkit_gpu_{k}", ["rank", "host"])
        try:
            self.server, self._thread = start_http_server(options.port, addr=options.host, registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"prometheus monitor: cannot serve on {options.host}:{options.port} "
                                     f"({exc.strerror}); set the monitor's port to a free one") from None
        self.who = {"rank": str(ctx.rank), "host": ctx.hostname}

    def _family(self, name: str, labels: list[str]):
        if name not in self.families:
            self.families[name] = self.Gauge(name, name.replace("_", " "), labels, registry=self.registry)
        return self.families[name]

    def on_step_end(self, step: int, times: StepTimes) -> None:
        self.pending.append(times)
        if self.server is not None:
            self.g["step"].labels(**self.who).set(step)
            self.g["step_seconds"].labels(**self.who).set(times.total)
            self.g["data_wait"].labels(**self.who).set(times.data_wait)

    def collect(self, step: int) -> dict:
        """This rank's mean phases over the interval (device times resolved now, at the log step)."""
        pending, self.pending = self.pending, []
        sums: dict = {}
        for t in pending:
            t.resolve()
            values = {"data_wait": t.data_wait, "optimizer": t.optimizer, "total": t.total, "comm": t.comm,
                      "comm_exposed": t.comm_exposed}
            if t.forward is not None:
                values["forward"], values["backward"] = t.forward, t.compute - t.forward
            for k, v in values.items():
                if v is not None:
                    sums[k] = sums.get(k, 0.0) + v
        n = len(pending)
        return {"host": self.ctx.hostname, "phases": {k: v / n for k, v in sums.items()} if n else {}}

    def report(self, step: int, per_rank: list[dict]) -> dict:
        if self.server is not None:
            for rank, entry in enumerate(per_rank):
                for phase, value in entry.get("phases", {}).items():
                    self.g["phase"].labels(rank=str(rank), host=entry["host"], phase=phase).set(value)
        return {}  # gauges only: these values are already logged by `breakdown`

    def on_log(self, step: int, metrics: dict) -> None:
        if self.server is None or self.ctx.rank != 0:
            return
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            parts = key.split("/")
            if key in NAMED:
                self.g[key].labels(**self.who).set(value)
            elif len(parts) == 3 and parts[0] == "system" and parts[1].startswith("node"):
                self._family(f"trainkit_system_{_metric_name(parts[2])}", ["node", "host"]).labels(
                    node=parts[1][4:], host=self.ctx.hostname).set(value)
            elif len(parts) == 3 and parts[0] == "gpu" and parts[1].startswith("rank"):
                self._family(f"trainkit_gpu_{_metric_name(parts[2])}", ["rank", "host"]).labels(
                    rank=parts[1][4:], host=self.ctx.hostname).set(value)
            else:
                self.g["metric"].labels(name=key, **self.who).set(value)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
