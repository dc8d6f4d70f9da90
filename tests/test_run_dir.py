"""The run directory has one owner, `trainkit/run_dir.py`: its layout table is what docs/running.md
shows, its records read back what they were written as, and no other module spells a run-directory
file name (a rename happens in one place)."""

from __future__ import annotations

import ast
import json
import re
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


# run_dir.py's string constants that are not the name of anything in a run directory, and why
NOT_NAMES = {"LAUNCH_ID_VAR": "an environment variable of the workers", "DAMAGED_FATAL": "a message"}
# (file, literal) -> why it is not (yet) spelled through run_dir.py
PENDING: dict = {}  # (file, literal) -> why it is not yet a run_dir name; empty: every name is


def spellings() -> dict[str, str]:
    """Every literal that spells a run-directory name -> the run_dir constant it should use: the name; for a
    template (`memory-rank{rank}.json`) its glob (`memory-rank*.json`) and the text before its first field
    (`memory-rank`, an f-string's first part); a folder's or prefix's glob (`step-*`)."""
    out = {}
    for constant, value in vars(run_dir).items():
        if constant.isupper() and isinstance(value, str) and constant not in NOT_NAMES:
            forms = {value, value + "*"}
            if "{" in value:
                forms |= {re.sub(r"\{[^}]*\}", "*", value), value.split("{")[0]}
            out.update({form: constant for form in forms if form})
    return out


def spelled_names(tree: ast.AST, names: dict[str, str]) -> list[tuple[int, str, str]]:
    """(line, literal, constant) for each string literal in `tree` that spells a run-directory name. A name
    that is also a plain word (`checkpoints`, `live`, `model`, `rank`: a recipe key, a dict key) counts where
    it is a path component (an operand of `/`); a prefix (`step-`, `.tmp-`, `.before-`) also as the start of a
    longer literal (`"step-00000001"`)."""
    in_paths = {id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
                for side in (node.left, node.right)}
    prefixes = {value: constant for value, constant in names.items() if value.endswith("-")}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        text = node.value
        constant = names.get(text) or next((c for p, c in prefixes.items() if text.startswith(p)), None)
        if constant is None or (re.fullmatch(r"[A-Za-z_]+", text) and id(node) not in in_paths):
            continue
        found.append((node.lineno, text, constant))
    return found


def test_no_run_directory_name_is_spelled_outside_run_dir():
    """Every file and folder name run_dir.py defines (a constant added there later included) is spelled only
    there: trainkit/ and bench/ use the constant, so a rename happens in one place."""
    names, spelled = spellings(), []
    for path in sorted([*(ROOT / "trainkit").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        if where == "trainkit/run_dir.py":
            continue
        for line, text, constant in spelled_names(ast.parse(path.read_text()), names):
            if (where, text) not in PENDING:
                spelled.append(f"{where}:{line}: {text!r} (run_dir.{constant})")
    assert not spelled, "use the names in trainkit/run_dir.py:\n" + "\n".join(spelled)


def test_the_name_check_sees_each_way_a_name_is_spelled():
    """The forms issue 36 found outside run_dir.py, as they were written, and plain words left alone."""
    source = ('a = run_dir / "checkpoints" / "step-00000001" / "meta.json"\n'  # launcher, bench/export_memory.py
              'b = f"step-{step:08d}"\n'  # launcher.completed
              'c = (folder / "live").glob("memory-rank*.json")\n'  # bench/memory_plan.py
              'd = run_dir / f"{TRACKING}.before-{launch}"\n'  # the launcher's set-aside folders
              'e = tmp / f"rng-rank{rank:05d}.pt"\n'  # the checkpointer
              'f = {"model": 1, "checkpoints": 2, "live": recipe["tracking"]}\n')  # words, not paths: left alone
    found = {(text, constant) for _, text, constant in spelled_names(ast.parse(source), spellings())}
    assert found == {("checkpoints", "CHECKPOINTS"), ("step-00000001", "CHECKPOINT_PREFIX"),
                     ("meta.json", "CHECKPOINT_META"), ("step-", "CHECKPOINT_PREFIX"), ("live", "LIVE"),
                     ("memory-rank*.json", "RANK_MEMORY"), (".before-", "SET_ASIDE"), ("rng-rank", "CHECKPOINT_RNG")}


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


def test_one_rule_says_a_run_finished(tmp_path):
    """`run_dir.training_finished` is the rule (the launcher's `completed` asks it for one launch): the
    summary is there, newer than the launch, and names a complete checkpoint of the last step."""
    from trainkit.launch.launcher import completed

    folder = tmp_path / run_dir.CHECKPOINTS / run_dir.checkpoint_name(5)
    folder.mkdir(parents=True)
    launch = tmp_path / run_dir.LAUNCHES / "20260101-000000"
    launch.mkdir(parents=True)
    (launch / run_dir.COMMAND).write_text("trainkit run r.yaml\n")
    assert not run_dir.training_finished(tmp_path) and not completed(tmp_path, launch)  # no summary yet
    write_summary(tmp_path, {"steps": 5, "checkpoint": str(folder)})
    assert not run_dir.training_finished(tmp_path)  # the checkpoint has no meta.json: not complete
    run_dir.checkpoint_meta_path(folder).write_text("{}")
    assert run_dir.training_finished(tmp_path) and completed(tmp_path, launch) and completed(tmp_path, None)
    assert not run_dir.training_finished(tmp_path, since=run_dir.summary_path(tmp_path).stat().st_mtime + 1)
    write_summary(tmp_path, {"steps": 6, "checkpoint": str(folder)})
    assert not run_dir.training_finished(tmp_path)  # not the last step's checkpoint
    write_summary(tmp_path, {"steps": 5, "checkpoint": None})
    assert not run_dir.training_finished(tmp_path) and has_summary(tmp_path)
    assert not completed(tmp_path, tmp_path / "no-such-launch")
