"""The `loss_spike` monitor (imported only when a run builds it)."""

from typing import Optional

from trainkit.monitors.base import Monitor


class LossSpikeMonitor(Monitor):
    def __init__(self, options, ctx):
        super().__init__(options, ctx)
        self.lowest: Optional[float] = None
        self.spikes: list[int] = []

    def on_log(self, step: int, metrics: dict) -> None:
        loss = metrics.get("loss")
        if loss is None or self.ctx.rank != 0:
            return
        if self.lowest is not None and loss > self.options.factor * self.lowest:
            self.spikes.append(step)
        self.lowest = loss if self.lowest is None else min(self.lowest, loss)

    def report(self, step: int, per_rank: list[dict]) -> dict:
        return {"loss_spike/count": len(self.spikes)}

    def finish(self, per_rank: list[dict]) -> Optional[str]:
        steps = ", ".join(map(str, self.spikes)) or "none"
        return f"## Loss spikes (> {self.options.factor:g}x the lowest loss)\n\n- at log steps: {steps}\n"
