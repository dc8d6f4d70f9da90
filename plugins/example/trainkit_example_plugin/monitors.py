"""Options of the `loss_spike` monitor: light (pydantic only), imported by `trainkit validate`; the
monitor itself (which imports torch through trainkit.monitors.base) lives in loss_spike.py.

Flags log steps whose loss jumps above `factor` x the running minimum; reports them as a metric while
the run trains and as a section of the run report at the end."""

from typing import ClassVar, Literal

from pydantic import Field, PositiveFloat

from trainkit.recipe.blocks import MonitorOptions


class LossSpikeOptions(MonitorOptions):
    """Warns when the logged loss jumps above `factor` times its lowest value so far."""

    component: ClassVar[str] = "trainkit_example_plugin.loss_spike:LossSpikeMonitor"
    name: Literal["loss_spike"]
    factor: PositiveFloat = Field(default=3.0, description="a loss above factor x the lowest so far is a spike")
