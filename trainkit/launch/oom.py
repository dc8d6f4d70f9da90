"""Out of memory, said as such by the launcher: which rank, during what, its peak and its limit, and
what the memory plan says would fit.

A rank the kernel's OOM killer ends dies by SIGKILL without a word: torchrun reports only "killed by
SIGKILL". Two facts make it an out-of-memory: the OOM killer's count (the memory cgroup's
`oom_kill`, else the host's /proc/vmstat) rose during the launch, and the rank died by SIGKILL. What
it was doing and how much it held come from its record (RUN_DIR/live/memory-rank<R>.json,
`runtime.memory_watch`). An OOM is deterministic (the same recipe on the same memory fails at the same
place), so restarts stop, as for the fatal marker.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

from ..run_dir import LIVE, RANK_MEMORY
from ..runtime.memory_limits import oom_kills

OUT_OF_MEMORY = "OutOfMemory"  # the fatal record's `error` for an out-of-memory failure


def kills_now() -> Optional[int]:
    """The OOM killer's count, taken when a launch starts."""
    return oom_kills()


def _records(run_dir: Path) -> list[dict]:
    out = []
    for path in sorted((Path(run_dir) / LIVE).glob(RANK_MEMORY.format(rank="*"))):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return out


def killed(run_dir: Path, kills_before: Optional[int], exitcode: Optional[int], pid: Optional[int]) -> Optional[dict]:
    """The fatal record for a rank the OOM killer ended (None when this failure was not one)."""
    if exitcode != -signal.SIGKILL or kills_before is None:
        return None
    after = oom_kills()
    if after is None or after <= kills_before:
        return None
    record = next((r for r in _records(run_dir) if r.get("pid") == pid), None)
    if record is None:
        who, where = f"a rank (pid {pid})", ""
    else:
        who = f"rank {record['rank']} (pid {pid})"
        where = (f" during {record['phase']}; its peak so far {_gib(record.get('peak_bytes'))} of "
                 f"{_gib(record.get('limit_bytes'))} ({record.get('limit')})")
    return {"error": OUT_OF_MEMORY,
            "message": f"out of memory: {who} was killed by the kernel's OOM killer (SIGKILL){where}"}


def advice(recipe) -> str:
    """The memory plan's lines for an out-of-memory report: the prediction and what would lower it."""
    try:
        from ..doctor.resources import memory_verdict

        verdict = memory_verdict(recipe)
    except Exception:  # the report matters more than its advice
        verdict = None
    if verdict is None:
        return "memory plan: `trainkit plan RECIPE` (docs/memory.md)"
    lines = [f"memory plan: predicted {_gib(verdict.plan.per_rank)} per rank, {_gib(verdict.budget)} per rank here "
             f"({verdict.budget_how}); `trainkit plan` shows the parts (docs/memory.md)"]
    if verdict.advice:
        lines.append("changes that lower it (predicted per rank):")
        lines += [f"  {a.text}" for a in verdict.advice]
    return "\n".join(lines)


def is_out_of_memory(fatal: Optional[dict]) -> bool:
    return bool(fatal) and fatal.get("error") == OUT_OF_MEMORY


def _gib(n) -> str:
    return "unknown" if not isinstance(n, (int, float)) else f"{n / (1 << 30):.2f} GiB"


def marker_or_kill(run_dir: Path, kills_before: Optional[int], failed: Optional[tuple]) -> Optional[dict]:
    """What stops torchrun's restarts: the ranks' fatal marker, or a rank the OOM killer ended
    (`failed`: the agent's (exitcode, local rank, pid) of the first failure)."""
    from ..run_dir import read_fatal

    fatal = read_fatal(run_dir)
    if fatal is not None or not failed:
        return fatal
    return killed(run_dir, kills_before, failed[0], failed[2])


def explain(report: str, err, run_dir: Path, kills_before: Optional[int], recipe) -> str:
    """torchrun's failure report, led by the out-of-memory explanation and the plan's advice when a
    rank ran out (killed by the OOM killer, or its own MemoryError / CUDA OOM: the fatal marker)."""
    from ..run_dir import read_fatal

    found = read_fatal(run_dir)
    if not is_out_of_memory(found):
        found = next((k for f in err.failures.values()
                      if (k := killed(run_dir, kills_before, f.exitcode, f.pid)) is not None), None)
    if found is None:
        return report
    return f"trainkit: training failed: {found['message']}\n{advice(recipe)}\n{report}"
