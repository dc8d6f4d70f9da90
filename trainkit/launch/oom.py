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

from ..run_dir import LIVE, LOGS, RANK_ERROR, RANK_MEMORY, write_fatal
from ..runtime.memory_limits import oom_kills
from ..runtime.memory_watch import OutOfMemory

OUT_OF_MEMORY = OutOfMemory.__name__  # the fatal record's `error` for an out-of-memory failure


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


def killed(run_dir: Path, kills_before: Optional[int], pid: Optional[int] = None) -> Optional[dict]:
    """The fatal record for a rank the OOM killer ended during this launch, None when none was.

    The count of OOM kills must have risen since the launch began, and a rank must have died without
    a word: SIGKILL leaves no error.json. The first failure torchrun sees is often not that rank but
    a peer whose collective broke when it died, so the silent rank is found from the ranks' own
    records (`pid`, when the caller knows the SIGKILLed process, picks it directly)."""
    after = oom_kills()
    if kills_before is None or after is None or after <= kills_before:
        return None
    records = _records(run_dir)
    record = next((r for r in records if pid is not None and r.get("pid") == pid), None) or \
        next((r for r in records if not _reported(run_dir, r)), None)
    if record is None:
        return None
    where = (f" during {record['phase']}; its peak so far {_gib(record.get('peak_bytes'))} of "
             f"{_gib(record.get('limit_bytes'))} ({record.get('limit')})")
    message = f"out of memory: rank {record['rank']} (pid {record.get('pid')}) was killed by the kernel's OOM " \
              f"killer (SIGKILL){where}"
    try:  # for `trainkit report`, and for ranks a restart would start (none: the agent is stopped)
        write_fatal(run_dir, OutOfMemory(message))
    except OSError:
        pass
    return {"error": OUT_OF_MEMORY, "message": message}


def _reported(run_dir: Path, record: dict) -> bool:
    """Did this rank leave an error.json (an exception it could report) in the newest attempt?"""
    from .failures import _rank_folder

    folder = _rank_folder(Path(run_dir) / LOGS, record.get("local_rank", record.get("rank", 0)))
    return folder is not None and (folder / RANK_ERROR).is_file()


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
    (`failed`: the agent's (exitcode, local rank, pid) of the first failure it saw)."""
    from ..run_dir import read_fatal

    fatal = read_fatal(run_dir)
    if fatal is not None:
        return fatal
    return killed(run_dir, kills_before, failed[2] if failed and failed[0] == -signal.SIGKILL else None)


def explain(report: str, err, run_dir: Path, kills_before: Optional[int], recipe) -> str:
    """torchrun's failure report, led by the out-of-memory explanation and the plan's advice when a
    rank ran out (killed by the OOM killer, or its own MemoryError / CUDA OOM: the fatal marker)."""
    from ..run_dir import read_fatal

    found = read_fatal(run_dir)
    if not is_out_of_memory(found):
        victim = next((f.pid for f in err.failures.values() if f.exitcode == -signal.SIGKILL), None)
        found = killed(run_dir, kills_before, victim)
    if found is None:
        return report
    return f"trainkit: training failed: {found['message']}\n{advice(recipe)}\n{report}"


def report_lines(run_dir: Path) -> list[str]:
    """What `trainkit report` says about a run that ran out of memory: the explanation, and the GPU
    memory histories its ranks dumped (open them at https://pytorch.org/memory_viz)."""
    from ..run_dir import CUDA_OOM_SNAPSHOT, read_fatal, report_path

    fatal = read_fatal(run_dir)
    if not is_out_of_memory(fatal):
        return []
    lines = [f"## Out of memory\n\n{fatal['message']}\n"]
    snapshots = sorted(report_path(run_dir, "").glob(CUDA_OOM_SNAPSHOT.format(rank="*")))
    for path in snapshots:
        lines.append(f"- GPU memory history (allocator snapshot at the OOM): {path} -- drag it into "
                     f"https://pytorch.org/memory_viz")
    lines.append("\n`trainkit plan RECIPE` shows the memory plan and what would fit (docs/memory.md).\n")
    return lines


def in_process_note(run_dir: Path) -> str:
    """For the world-size-1 worker that ran in the launcher: the plan's advice after its own OOM."""
    from ..recipe import RecipeError, resolve
    from ..run_dir import RECIPE, read_fatal

    if not is_out_of_memory(read_fatal(run_dir)):
        return ""
    try:
        return "\n" + advice(resolve(Path(run_dir) / RECIPE).recipe)
    except RecipeError:
        return ""
