"""Turn torchelastic's ChildFailedError into a short report a person can act on.

torchrun prints only the last attempt's root cause, with full tracebacks. We print which rank failed
first, its exception (from the `error.json` its `@record`-decorated main wrote), and the last lines
of its log, plus where the full logs are.
"""

from __future__ import annotations

import json
from pathlib import Path

COLLATERAL = ("Connection closed by peer", "Connection reset", "Gloo", "NCCL", "Broken pipe", "timed out",
              "Timed out", "SIGTERM")


def _tail(path: Path, n: int = 12) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line for line in lines if line.strip()][-n:]


def _exception(failure) -> tuple[str, list[str]]:
    """(one-line exception, traceback tail) from the failure's error.json, if it wrote one."""
    try:
        data = json.loads(Path(failure.error_file).read_text())
        message = data["message"]
        if isinstance(message, dict):
            text = message.get("message", "")
            trace = message.get("extraInfo", {}).get("py_callstack", "")
        else:
            text, trace = str(message), ""
        return text.strip().splitlines()[-1] if text.strip() else "", trace.strip().splitlines()[-6:]
    except (OSError, ValueError, KeyError, TypeError):
        if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
            return f"killed by {failure.signal_name()}", []
        return f"exited with code {failure.exitcode} without a Python exception (e.g. os._exit or a crash)", []


def _rank_folder(log_dir: Path, local_rank: int):
    """LOG_DIR/<run id>_*/attempt_<last>/<local rank>/ of the newest launch (torchelastic's layout)."""
    launches = sorted((p for p in log_dir.glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    if not launches:
        return None
    attempts = sorted(launches[-1].glob("attempt_*"), key=lambda p: int(p.name.split("_")[-1]))
    return attempts[-1] / str(local_rank) if attempts else None


def summarize(err, log_dir: Path, max_restarts: int) -> str:
    """The failure report printed when restarts are exhausted."""
    def order(item):
        rank, f = item
        text, _ = _exception(f)
        return (any(c in text for c in COLLATERAL), f.timestamp, rank)  # a peer-death error is a symptom

    rank, first = sorted(err.failures.items(), key=order)[0]
    text, trace = _exception(first)
    lines = [f"trainkit: training failed ({max_restarts} restart(s) allowed, all used): "
             f"rank {rank} (local rank {first.local_rank}, pid {first.pid}) failed first",
             f"  error: {text}"]
    folder = _rank_folder(log_dir, first.local_rank)
    log = None
    if folder is not None:
        for name in ("stderr.log", "stdout.log"):
            if (folder / name).is_file() and (folder / name).stat().st_size:
                log = folder / name
                break
    tail = _tail(log) if log else trace
    if tail:
        lines.append(f"  last lines of {log if log else 'its traceback'}:")
        lines += [f"    {line}" for line in tail]
    others = sorted(r for r in err.failures if r != rank)
    if others:
        lines.append(f"  also failed: rank(s) {', '.join(map(str, others))}")
    lines.append(f"  full logs: {log_dir}")
    return "\n".join(lines)
