"""Monitor options: one block per monitor plugin in `monitors:`."""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt

from .base import PluginBlock


class MonitorOptions(PluginBlock):
    # fields holding a path the monitor writes (confined by the rules: recipe/paths.py)
    written_path_fields: ClassVar[tuple[str, ...]] = ()

    # what the loop must measure for this monitor (off unless some enabled monitor asks)
    needs_forward_time: ClassVar[bool] = False
    needs_comm_time: ClassVar[bool] = False
    precise_timing: ClassVar[bool] = False  # CUDA events around the step phases
    # it writes the bottleneck report's evidence (RUN_DIR/reports/breakdown.json), which `trainkit tune`
    # reads from its baseline trial
    writes_evidence: ClassVar[bool] = False


class SystemMonitorOptions(MonitorOptions):
    """CPU, memory, disk and network of the node (psutil), one sampler per node."""

    component: ClassVar[str] = "trainkit.monitors.system:SystemMonitor"
    name: Literal["system"]
    interval_s: PositiveFloat = Field(default=5.0, description="seconds between samples")


class GpuMonitorOptions(MonitorOptions):
    """GPU utilisation, memory, power and temperature via NVML."""

    component: ClassVar[str] = "trainkit.monitors.gpu:GpuMonitor"
    name: Literal["gpu"]
    interval_s: PositiveFloat = Field(default=5.0, description="seconds between samples")


class ThroughputMonitorOptions(MonitorOptions):
    """samples/s, step-time percentiles and MFU from counted FLOPs."""

    component: ClassVar[str] = "trainkit.monitors.throughput:ThroughputMonitor"
    name: Literal["throughput"]
    window: PositiveInt = Field(default=50, description="steps in the rolling window for percentiles")


class BreakdownMonitorOptions(MonitorOptions):
    """Per-step data-wait / forward / backward / optimizer times, gathered from all ranks."""

    component: ClassVar[str] = "trainkit.monitors.breakdown:BreakdownMonitor"
    needs_forward_time: ClassVar[bool] = True
    needs_comm_time: ClassVar[bool] = True
    precise_timing: ClassVar[bool] = True
    writes_evidence: ClassVar[bool] = True
    name: Literal["breakdown"]


class MemoryMonitorOptions(MonitorOptions):
    """Peak device memory (GPU) or RSS (CPU) per rank."""

    component: ClassVar[str] = "trainkit.monitors.memory:MemoryMonitor"
    name: Literal["memory"]
    snapshot: bool = Field(default=False, description="write a CUDA memory snapshot at the end")


class ProfilerMonitorOptions(MonitorOptions):
    """torch.profiler traces on a wait/warmup/active schedule."""

    component: ClassVar[str] = "trainkit.monitors.profiler:ProfilerMonitor"
    name: Literal["profiler"]
    wait: NonNegativeInt = Field(default=5, description="steps skipped before warming up")
    warmup: NonNegativeInt = Field(default=2, description="steps profiled but discarded")
    active: PositiveInt = Field(default=3, description="steps recorded")
    repeat: NonNegativeInt = Field(default=1, description="cycles (0: until the end)")
    ranks: list[NonNegativeInt] = Field(default_factory=lambda: [0], description="ranks that profile")


class StragglersMonitorOptions(MonitorOptions):
    """Flags ranks that arrive late at the gradient collective."""

    component: ClassVar[str] = "trainkit.monitors.stragglers:StragglersMonitor"
    needs_forward_time: ClassVar[bool] = True
    needs_comm_time: ClassVar[bool] = True
    precise_timing: ClassVar[bool] = True  # device time on a GPU: host time is only the kernels' launch
    name: Literal["stragglers"]
    every: PositiveInt = Field(default=10, description="steps between gathers")
    margin: PositiveFloat = Field(default=0.2, description="fraction slower than the median that counts as late")


class PrometheusMonitorOptions(MonitorOptions):
    """Live metrics for Prometheus (and the Grafana dashboard in docs/grafana-dashboard.json): an HTTP
    /metrics endpoint on each node's local rank 0."""

    component: ClassVar[str] = "trainkit.monitors.prometheus:PrometheusMonitor"
    name: Literal["prometheus"]
    port: int = Field(default=9464, ge=1, le=65535, description="TCP port of /metrics on every node")
    host: str = Field(default="127.0.0.1", description="address to bind (anything but loopback exposes the "
                                                       "metrics to the network, unauthenticated)")


class TensorBoardMonitorOptions(MonitorOptions):
    """Every logged scalar as TensorBoard events (RUN_DIR/tensorboard), beside MLflow."""

    component: ClassVar[str] = "trainkit.monitors.tensorboard:TensorBoardMonitor"
    written_path_fields: ClassVar[tuple[str, ...]] = ("log_dir",)
    name: Literal["tensorboard"]
    log_dir: Optional[str] = Field(default=None, description="event folder (default: RUN_DIR/tensorboard)")
