"""Output that never ends a training run: `trainkit run ... | head`, a closed ssh session, a `tee` that
exits. A long job's progress lines are for people; once nobody reads them, training goes on.

`survive_closed_output()` wraps stdout and stderr: the first write that finds its reader gone
(`BrokenPipeError`, EPIPE; Python ignores SIGPIPE, so it arrives as an exception) points the file
descriptor at /dev/null -- so processes started later (torchrun's workers, a restart's workers) inherit
/dev/null instead of the dead pipe -- and every later write is discarded. What matters is on disk
anyway: metrics.jsonl, the run's logs, MLflow.
"""

from __future__ import annotations

import errno
import io
import os
import sys


class _SurvivingStream(io.TextIOBase):
    """A text stream that forwards to `inner` until its reader has gone, then discards."""

    def __init__(self, inner):
        self._inner, self._gone = inner, False

    def _lost(self) -> None:
        self._gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def _guarded(self, action, default=None):
        if self._gone:
            return default
        try:
            return action()
        except BrokenPipeError:
            self._lost()
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise
            self._lost()
        return default

    def write(self, text: str) -> int:
        self._guarded(lambda: self._inner.write(text))
        return len(text)

    def flush(self) -> None:
        self._guarded(self._inner.flush)

    def isatty(self) -> bool:
        return not self._gone and self._guarded(self._inner.isatty, False)

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self):
        return getattr(self._inner, "encoding", "utf-8")

    def writable(self) -> bool:
        return True


def survive_closed_output() -> None:
    """From now on a closed stdout or stderr discards this process's output instead of raising."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _SurvivingStream):
            setattr(sys, name, _SurvivingStream(stream))
