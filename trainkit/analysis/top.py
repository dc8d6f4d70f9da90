"""`trainkit top RUN_DIR`: a live console view of a training run, refreshed from its files.

Reads what the run writes anyway -- `metrics.jsonl` (rank 0's log steps: loss, samples/s, the
`system` and `gpu` monitors' values) and `live/breakdown.json` (every rank's step phases, written by
the `breakdown` monitor at each log step) -- so it works from any shell that sees the run directory,
costs the run nothing, and needs no server. Light: no torch import.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Optional

from ..run_dir import ENVIRONMENT, LAUNCHES, RECIPE, RESOLVED_RECIPE, has_summary, last_metrics, live_breakdown_path

PHASES = (("step", "total"), ("data wait", "data_wait"), ("forward", "forward"), ("backward", "backward"),
          ("optimizer", "optimizer"), ("exposed comm", "comm_exposed"))


class NotARunDir(ValueError):
    pass


def check_run_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise NotARunDir(f"{run_dir} is not a folder")
    if not (run_dir / RECIPE).is_file():
        raise NotARunDir(f"{run_dir} is not a trainkit run directory (no recipe.yaml; `trainkit run` writes one "
                         f"into runs/NAME)")


def snapshot(run_dir: Path) -> dict:
    """Everything one frame shows, from the run's files."""
    out = {"metrics": last_metrics(run_dir), "per_rank": [], "done": has_summary(run_dir)}
    live = live_breakdown_path(run_dir)
    try:
        out["per_rank"] = json.loads(live.read_text())["per_rank"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        out["max_steps"] = int(re.search(r"^\s*max_steps:\s*(\d+)", (run_dir / RESOLVED_RECIPE).read_text(),
                                         re.M).group(1))
    except (OSError, AttributeError):
        out["max_steps"] = None
    return out


def _launch_host(run_dir: Path) -> str:
    """The machine of the newest launch (its recorded environment): rank 0's host without the breakdown monitor."""
    recorded = sorted((run_dir / LAUNCHES).glob(f"*/{ENVIRONMENT}"))
    try:
        return json.loads(recorded[-1].read_text()).get("hostname", "-") if recorded else "-"
    except (OSError, ValueError):
        return "-"


def _ms(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def render(run_dir: Path, snap: dict):
    """A rich renderable for one frame."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    m = snap["metrics"]
    step = m.get("step")
    age = time.time() - m["time"] if "time" in m else None
    state = "finished" if snap["done"] else "training" if m else "starting"
    head = Text(f"{run_dir.name}  {state}  step {step if step is not None else '-'}"
                f"{'/' + str(snap['max_steps']) if snap.get('max_steps') else ''}  "
                f"loss {_num(m.get('loss'), '{:.4f}')}  samples/s {_num(m.get('samples_per_s'))}"
                f"{f'  (updated {age:.0f}s ago)' if age is not None else ''}", style="bold")
    ranks = Table(title="per rank (ms, mean over the last log interval)", expand=False)
    for col in ["rank", "host", *[p for p, _ in PHASES], "GPU %", "GPU mem MB"]:
        ranks.add_column(col, justify="right")
    rows = snap["per_rank"] or ([{"rank": 0, "host": _launch_host(run_dir), "total": m.get("step_time_s"),
                                  "data_wait": m.get("data_wait_s")}] if m else [])
    for r in rows:
        g = f"gpu/rank{r['rank']}/"
        ranks.add_row(str(r["rank"]), r.get("host") or "-", *[_ms(r.get(k)) for _, k in PHASES],
                      _num(m.get(g + "utilization_percent"), "{:.0f}"), _num(m.get(g + "memory_used_mb"), "{:.0f}"))
    nodes = Table(title="per node", expand=False)
    for col in ("node", "CPU %", "workers RSS MB", "memory used %"):
        nodes.add_column(col, justify="right")
    for n in sorted({int(k.split("/")[1][4:]) for k in m if re.match(r"system/node\d+/", k)}):
        p = f"system/node{n}/"
        nodes.add_row(str(n), _num(m.get(p + "cpu_percent"), "{:.0f}"), _num(m.get(p + "workers_rss_mb"), "{:.0f}"),
                      _num(m.get(p + "memory_used_percent"), "{:.0f}"))
    hint = Text("" if snap["per_rank"] else "(per-rank phases need the `breakdown` monitor; CPU/memory the `system` "
                "monitor; GPU the `gpu` monitor)", style="dim")
    return Group(head, ranks, nodes, hint)


def top(run_dir: Path, interval: float = 1.0, once: bool = False, console=None) -> int:
    """Refresh until the run finishes (or Ctrl-C); `once`: print one frame."""
    from rich.console import Console
    from rich.live import Live

    check_run_dir(run_dir)
    console = console or Console()
    if once:
        console.print(render(run_dir, snapshot(run_dir)))
        return 0
    try:
        with Live(render(run_dir, snapshot(run_dir)), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                snap = snapshot(run_dir)
                live.update(render(run_dir, snap))
                if snap["done"]:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
