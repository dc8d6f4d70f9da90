"""Rank-0 progress: the start-up phases as they happen, then a live one-line bar on a terminal, plain
periodic lines otherwise."""

from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    def __init__(self, max_steps: int, start_step: int, global_batch: int, enabled: bool, stream=None):
        self.max_steps, self.start_step, self.global_batch = max_steps, start_step, global_batch
        self.stream = stream or sys.stdout
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.perf_counter()

    def rate(self, step: int) -> float:
        elapsed = time.perf_counter() - self.t0
        return (step - self.start_step) * self.global_batch / elapsed if elapsed > 0 else 0.0

    def _text(self, step: int, loss: float) -> str:
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.max_steps - step) if done else 0.0
        return (f"step {step}/{self.max_steps}  loss {loss:.4f}  {self.rate(step):.1f} samples/s  "
                f"ETA {_clock(eta)}")

    def due(self, step: int) -> bool:
        """Redraw at most 5 times a second (reading the loss syncs the device) and at the end."""
        if not self.tty:
            return False
        now = time.perf_counter()
        if now - getattr(self, "_drawn", 0.0) < 0.2 and step < self.max_steps:
            return False
        self._drawn = now
        return True

    def update(self, step: int, loss: float) -> None:
        """Every step: redraw the bar (terminal only)."""
        if not self.tty:
            return
        width = 24
        filled = int(width * step / self.max_steps)
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r[{bar}] {self._text(step, loss)}\x1b[K")
        self.stream.flush()

    def log(self, metrics: dict, step: int) -> None:
        """At log steps: a plain line (not a terminal); a metrics sink like the others."""
        if not self.enabled or self.tty:
            return
        extra = "".join(f"  {k} {v:.4g}" for k, v in metrics.items()
                        if k.startswith("eval_") and isinstance(v, float))
        print(f"trainkit: {self._text(step, metrics.get('loss', float('nan')))}{extra}", file=self.stream, flush=True)

    def rewind(self, step: int) -> None:
        """Nothing to undo: the bar only shows the present."""

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


class StartupPhases:
    """Rank 0 says what it is doing between the launcher's tracking line and the first step (workers
    up, model built, data ready, first step), with the seconds since the process started: the 15-20
    s a new user otherwise waits in silence."""

    def __init__(self, talk: bool, started: float):
        self.talk, self.started = talk, started

    def say(self, what: str) -> None:
        if self.talk:
            print(f"trainkit: {what} ({time.time() - self.started:.1f} s)", flush=True)


def process_start() -> float:
    """When this process started (time.time()): start-up is measured from here to the first step."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return time.time()
