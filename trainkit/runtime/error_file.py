"""How a failed rank reports: torchelastic's error file (what the launcher's failure report reads)
and one console line, with the recipe's secrets masked in both, and never a half-written file.

Its own module because the error file is an interface with two sharp edges: torch records the
original message (a token in a tracking URI, say) in the traceback it writes, and a truncated file
on a full disk crashes torchrun's agent, losing every rank's report.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist


def report_and_exit(exc: Exception, redact=str) -> None:
    """Record the exception in torchelastic's error file (what the launcher's report reads), then
    exit 1. Local rank 0 shares the user's console: one line there instead of a traceback. `redact`
    masks the recipe's secrets: a message that held one is recorded as a RuntimeError with it masked.
    On a full disk (the error file and the console log live in the run dir) each of these may fail:
    then the rank still exits 1, and the launcher reports from what is left (`failures.disk_full_note`).
    Without an error file (not under torchrun: the launcher's in-process world of 1) it re-raises."""
    masked = redact(f"{type(exc).__name__}: {exc}")
    if masked != f"{type(exc).__name__}: {exc}":
        exc = RuntimeError(masked)

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record(exc, Path(error_file), redact)
    if os.environ.get("LOCAL_RANK", "0") == "0" and error_file:
        rank = os.environ.get("RANK", "0")
        try:
            print(f"trainkit: rank {rank} failed: {type(exc).__name__}: "
                  f"{str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr, flush=True)
        except OSError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(1)
    if not error_file:
        raise exc
    try:  # the other ranks' logs keep the traceback
        traceback.print_exception(exc, file=sys.stderr)
        sys.stderr.flush()
    except OSError:
        pass
    sys.exit(1)


def record(exc: Exception, error_file: Path, redact=str) -> None:
    """torchelastic's error file, whole or not at all: a half-written one (ENOSPC) makes the agent
    itself crash on reading it (JSONDecodeError), losing every rank's report. torch writes the
    traceback of the exception being handled (`traceback.format_exc()`), which still holds the
    original message: every string in the file goes through `redact` before it stays."""
    from torch.distributed.elastic.multiprocessing.errors import get_error_handler

    try:
        get_error_handler().record_exception(exc)
        data = json.loads(error_file.read_text())
        masked = _map_strings(data, redact)
        if masked != data:
            error_file.write_text(json.dumps(masked))
    except (OSError, ValueError):
        error_file.unlink(missing_ok=True)


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value
