"""The first DeepSpeed run on a machine compiles DeepSpeed's CPU communication op (~30 s): the console
says so before the compiler starts, naming the folder that keeps the result
(strategies/deepspeed_ops.py says why it cannot be built at install time)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

from run_helpers import MLP, env_for, write_recipe

pytestmark = pytest.mark.distributed
ANNOUNCEMENT = "trainkit: building DeepSpeed's CPU communication op"


def first_line_with(proc: subprocess.Popen, text: str, timeout: float) -> tuple[str, list[str]]:
    """The first stdout line of `proc` holding `text` (or '' at timeout or exit), and the lines before it."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if not ready:
            continue
        line = proc.stdout.readline()
        if not line:
            return "", seen
        if text in line:
            return line, seen
        seen.append(line)
    return "", seen


def test_the_first_deepspeed_run_says_it_is_compiling_the_comm_op(tmp_path):
    """Guards the announcement (remove `announce_build()` from the strategy and no such line comes
    before the compiler runs): with an empty extension cache, local rank 0 prints the line with the
    cache folder before DeepSpeed has built anything there. The run is stopped at the line: the
    compilation itself is not this test's business."""
    cache = tmp_path / "torch_extensions"
    recipe = write_recipe(tmp_path, "ds-first", MLP, strategy={"name": "deepspeed", "zero_stage": 1},
                          launch={"nproc_per_node": 1})
    env = env_for(tmp_path, TORCH_EXTENSIONS_DIR=str(cache), DS_ACCELERATOR="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        line, before = first_line_with(proc, ANNOUNCEMENT, timeout=180)
        built = sorted(p.name for p in cache.rglob("*.so"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert line, "no announcement before the build:\n" + "".join(before[-40:])
    assert f"into {cache / 'deepspeed_shm_comm'}" in line and "once per machine" in line
    assert built == [], f"the op was already built when the line came: {built}"
    assert not any("built successfully" in b for b in before)
