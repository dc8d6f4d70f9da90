"""How a rank answers SIGTERM and SIGINT: a stop request raised where the rank is, so it unwinds
(discarding a half-written checkpoint, waiting a bounded time for a background write) and exits
non-zero; and the one moment a stop must not interrupt, a failing rank's own report.

Why its own module: the worker installs the handlers, the launcher's in-process path (world size 1)
catches `StopRequested` from the same worker code, and neither needs the other's imports for it."""

from __future__ import annotations

import signal

STOPPING = (signal.SIGTERM, signal.SIGINT)


class StopRequested(KeyboardInterrupt):
    """SIGTERM/SIGINT arrived: unwind (discarding a half-written checkpoint) and exit non-zero."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum, frame):
    raise StopRequested(signum)


def raise_on_stop() -> dict:
    """Install the handlers that raise StopRequested; returns the previous ones, for `restore`."""
    return {s: signal.signal(s, _on_signal) for s in STOPPING}


def restore(previous: dict) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)


def finish_failure_report_first() -> None:
    """A failing rank finishes its report before anything else: the agent stops the other ranks as soon
    as one fails, and its SIGTERM arriving while this rank reports its own failure (its collective
    broke when the first rank died) would raise StopRequested inside the report. Python then printed
    both tracebacks on the user's console instead of the rank's one line (seen once in the suite:
    tests/test_run_ddp.py, exhausted restarts). `restore` puts the handlers back on the way out."""
    for s in STOPPING:
        signal.signal(s, signal.SIG_IGN)
