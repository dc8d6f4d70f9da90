"""The run directory has one owner, `trainkit/run_dir.py`: its layout table is what docs/running.md
shows, its records read back what they were written as, and no other module spells a run-directory
file name (a rename happens in one place)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from trainkit import run_dir
from trainkit.run_dir import (LAYOUT, WARMUP_STEPS, has_summary, last_metrics, measured_step_times, read_fatal,
                              read_metrics, read_summary, write_fatal, write_summary)

ROOT = Path(__file__).resolve().parent.parent
# names that mean only a run-directory file (not "reports" or "tracking", which are also recipe keys)
FILE_NAMES = {run_dir.RECIPE, run_dir.RESOLVED_RECIPE, run_dir.METRICS, run_dir.SUMMARY, run_dir.FATAL,
              run_dir.LOCK, run_dir.COMMAND, run_dir.ENVIRONMENT, run_dir.FAILURE, run_dir.BREAKDOWN,
              run_dir.BOTTLENECK, run_dir.VERDICT, run_dir.GPU, run_dir.RANK_ERROR, run_dir.RANK_STDOUT,
              run_dir.RANK_STDERR}


def layout_table() -> str:
    return "\n".join(f"| `{path}` | {what} |" for path, what in LAYOUT)


def test_docs_show_the_modules_layout():
    assert layout_table() in (ROOT / "docs" / "running.md").read_text(), \
        "docs/running.md's run directory table differs from trainkit.run_dir.LAYOUT; paste:\n" + layout_table()


def test_no_other_module_spells_a_run_directory_file_name():
    spelled = []
    for path in sorted([*(ROOT / "trainkit").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        if path == ROOT / "trainkit" / "run_dir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in FILE_NAMES:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, "use the names in trainkit/run_dir.py:\n" + "\n".join(spelled)


def test_records_read_back_as_written(tmp_path):
    summary = {"steps": 5, "global_batch": 16, "checkpoint": None}
    write_summary(tmp_path, summary)
    assert has_summary(tmp_path) and read_summary(tmp_path) == summary
    assert (tmp_path / "summary.json").read_text() == json.dumps(summary, indent=2) + "\n"

    write_fatal(tmp_path, FloatingPointError("loss is nan at step 3"))
    assert read_fatal(tmp_path) == {"error": "FloatingPointError", "message": "loss is nan at step 3"}
    run_dir.clear_fatal(tmp_path)
    assert read_fatal(tmp_path) is None


def test_metrics_readers(tmp_path):
    assert last_metrics(tmp_path) == {}
    rows = [{"step": s, "step_time_s": 0.1 * s} for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    assert last_metrics(tmp_path) == rows[-1]  # a line torn by a crash is skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(tmp_path) == rows
    assert measured_step_times(rows) == [r["step_time_s"] for r in rows[WARMUP_STEPS:]]


def test_one_warmup_definition():
    from trainkit.launch import tune
    from trainkit.analysis import bottleneck
    from trainkit.runtime import stats

    assert tune.WARMUP_STEPS is stats.WARMUP_STEPS is bottleneck.WARMUP_STEPS is WARMUP_STEPS
