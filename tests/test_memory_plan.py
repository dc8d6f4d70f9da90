"""The memory plan before launch and out-of-memory explained (issue 28, items 2 and 3).

The limits are real: a memory cgroup (what a container's `--memory` or a Kubernetes limit is), made
by the test (root, as on the test machines and in CI; skipped where no memory cgroup can be made).
Inside it the kernel's OOM killer ends a rank with SIGKILL, as it does for a user.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from run_helpers import Result, env_for, mlp_recipe, trainkit, wait_for

GiB = 1 << 30
MiB = 1 << 20
# ~50M parameters: DDP with AdamW needs ~1.6 GiB a rank, FSDP over 2 ranks ~1.1 GiB (the plan's figures)
BIG_MLP = {"name": "mlp", "args": {"in_features": 4096, "hidden": 4096, "depth": 3, "num_classes": 4}}


@contextmanager
def memory_cgroup(limit: int):
    """A memory cgroup limited to `limit` bytes (v1 or v2); yields the file that takes a process in."""
    v1 = Path("/sys/fs/cgroup/memory")
    folder = (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / f"trainkit-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        folder.mkdir()
        (folder / ("memory.limit_in_bytes" if v1.is_dir() else "memory.max")).write_text(str(limit))
    except OSError as exc:
        pytest.skip(f"needs a memory cgroup this test can create (root, cgroup memory controller): {exc}")
    try:
        yield folder / "cgroup.procs"
    finally:
        for _ in range(100):  # the processes are gone once their parent reaped them
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def in_cgroup(procs: Path, *args: str) -> list[str]:
    """A command line that joins the cgroup, then becomes `args` (the same pid)."""
    return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *args]


def trainkit_in(procs: Path, tmp: Path, *args: str, timeout: float = 120) -> Result:
    proc = subprocess.run(in_cgroup(procs, sys.executable, "-m", "trainkit.cli", *args), cwd=tmp,
                          env=env_for(tmp), capture_output=True, text=True, timeout=timeout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


@pytest.mark.slow
def test_plan_shows_memory_and_a_run_that_cannot_fit_is_refused_naming_what_fits(tmp_path, capsys):
    """Guards item 2: `trainkit plan` prints each rank's predicted memory part by part; in a 3 GiB
    container the same recipe (DDP, 2 ranks) does not fit, and `run` says so before any worker
    starts, reading the cgroup's limit (the host has far more), with the changes that fit and their
    figures."""
    from trainkit.cli import main

    recipe = mlp_recipe(tmp_path, "big", model=BIG_MLP, optimizer={"name": "adamw", "lr": 1e-3},
                        data={"shape": [4096]}, trainer={"max_steps": 2})
    assert main(["plan", str(recipe)]) == 0
    plan = capsys.readouterr().out
    for part in ("memory per rank:", "parameters:", "gradients:", "optimizer state:", "gradient buckets:",
                 "activations:", "runtime:", "available:"):
        assert part in plan, plan
    assert "x 2 x 4 B / 1" in plan  # AdamW: two fp32 moments per parameter, not sharded under DDP

    with memory_cgroup(3 * GiB) as procs:
        run = trainkit_in(procs, tmp_path, "run", str(recipe))
    row = next((line for line in run.stderr.splitlines() if "memory" in line and "will not fit" in line), "")
    assert run.returncode == 2 and "not started" in run.stderr and "cgroup" in row, run.output
    assert "strategy.name=fsdp" in run.stderr and "(fits)" in run.stderr, run.stderr
    assert not (tmp_path / "runs" / "big" / "logs").exists()  # nothing started


HOG = """
import os, sys, time
open('/proc/self/oom_score_adj', 'w').write('-1000')  # never the OOM killer's choice: a rank is
chunks, total = [], int(sys.argv[1])
while total > 0:
    chunks.append(bytearray(b'\\x01') * (16 << 20)); total -= 16 << 20
time.sleep(600)
"""


@pytest.mark.distributed
def test_a_rank_killed_by_the_oom_killer_is_reported_as_out_of_memory_without_restarts(tmp_path, capsys):
    """Guards item 3: a rank the kernel's OOM killer ends (SIGKILL, in a memory cgroup) is reported
    as out of memory -- which rank, during which step, its peak and the cgroup's limit, and the
    memory plan's advice -- and torchrun's 2 allowed restarts are not spent repeating it.

    The recipe fits (the launch's memory check passes); once the ranks train, another process in
    the same container takes the memory that was left, as a data loader or a second job would."""
    recipe = mlp_recipe(tmp_path, "oom", trainer={"max_steps": 100000, "log_every": 1000,
                                                   "checkpoint": {"every": 100000}},
                        launch={"nproc_per_node": 2, "max_restarts": 2, "timeout_s": 60})
    run_dir = tmp_path / "runs" / "oom"
    limit = int(2.5 * GiB)
    with memory_cgroup(limit) as procs:
        launcher = subprocess.Popen(in_cgroup(procs, sys.executable, "-m", "trainkit.cli", "run", str(recipe)),
                                    cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
        hog = None
        try:
            rank_records = [run_dir / "live" / f"memory-rank{r}.json" for r in (0, 1)]
            wait_for(lambda: all(p.is_file() and '"step' in p.read_text() for p in rank_records), 120,
                      "both ranks to train")
            for record in rank_records:  # the ranks are the OOM killer's first choice, not the launcher
                Path(f"/proc/{json.loads(record.read_text())['pid']}/oom_score_adj").write_text("1000")
            usage_file = procs.parent / ("memory.usage_in_bytes" if procs.parent.parent.name == "memory"
                                         else "memory.current")
            to_take = limit - int(usage_file.read_text()) + 256 * MiB  # more than is left: someone must go
            hog = subprocess.Popen(in_cgroup(procs, sys.executable, "-c", HOG, str(to_take)))
            try:
                out, err = launcher.communicate(timeout=60)
            except subprocess.TimeoutExpired as exc:
                raise AssertionError(f"{exc.output}\n{exc.stderr}") from None
        finally:
            for p in (launcher, hog):
                if p is not None and p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL) if p is launcher else p.kill()
                    p.wait()
    report = out + err
    assert launcher.returncode != 0, report
    assert "out of memory: rank" in report and "killed by the kernel's OOM killer (SIGKILL)" in report, report
    assert "during step " in report, report
    assert "of 2.50 GiB (the memory cgroup's limit" in report, report
    assert "memory plan: predicted" in report and "changes that lower it" in report, report
    assert "restart 1" not in report, report  # a deterministic OOM does not burn the restarts
    failure = next((run_dir / "launches").glob("*/failure.txt")).read_text()
    assert "out of memory" in failure
    from trainkit.cli import main

    assert main(["report", str(run_dir)]) == 1  # a failed run: no bottleneck report, but why it failed
    assert "Out of memory" in capsys.readouterr().out


def test_activations_too_big_for_any_host_get_checkpointing_and_accumulation_as_advice(tmp_path, capsys):
    """Guards the activation trace and its advice: a ResNet-18 at micro-batch 8192 on 224x224 images
    saves far more for backward than any host has (traced on the meta device, nothing allocated), so
    `trainkit plan` says it will not fit and lists activation checkpointing and a smaller micro-batch
    with more accumulation (the same global batch), each with its figure, the latter fitting; the
    doctor's memory check fails naming the one that fits."""
    from trainkit.cli import main

    recipe = mlp_recipe(tmp_path, "wide", model={"name": "torchvision.resnet18", "args": {"num_classes": 4}},
                        data={"shape": [3, 224, 224], "batch_size": 8192, "num_samples": 16384})
    assert main(["plan", str(recipe)]) == 0
    plan = capsys.readouterr().out
    assert "WILL NOT FIT" in plan, plan
    figure = lambda line: float(line.split(": ")[1].split(" GiB")[0])  # noqa: E731
    predicted = float(plan.split("memory per rank: ")[1].split(" GiB")[0])
    checkpointing = next(line for line in plan.splitlines() if "performance.activation_checkpointing=full" in line)
    assert figure(checkpointing) < 0.8 * predicted, checkpointing  # the stem's activations stay (not a block)
    smaller = next(line for line in plan.splitlines() if "data.batch_size=" in line and "(fits)" in line)
    batch, accum = smaller.split("data.batch_size=")[1].split(",")[0], smaller.split("grad_accum_steps=")[1].split(":")[0]
    assert int(batch) * int(accum) == 8192, smaller  # the same global batch
    assert main(["doctor", str(recipe)]) == 1
    assert f"data.batch_size={batch}" in capsys.readouterr().out


@pytest.mark.slow
def test_an_allocation_refused_under_an_address_space_limit_is_reported_as_out_of_memory(tmp_path):
    """Guards the rank's own OOM report: under `ulimit -v` (RLIMIT_AS, set with prlimit) torch's CPU
    allocator refuses the model's parameters (a RuntimeError, "DefaultCPUAllocator: can't allocate
    memory") while it builds the model or fills the optimizer state at step 1 (which one depends on
    the process's virtual size); the run says out of memory on rank 0 during that phase, with the
    limit, and leaves the fatal marker (no restart repeats it)."""
    recipe = mlp_recipe(tmp_path, "as", model={"name": "mlp", "args": {"in_features": 4096, "hidden": 4096,
                                                                        "depth": 6, "num_classes": 4}},
                        data={"shape": [4096]}, optimizer={"name": "adamw", "lr": 1e-3},
                        launch={"nproc_per_node": 1}, trainer={"max_steps": 2})
    proc = subprocess.run(["prlimit", f"--as={5 * 10**9}", sys.executable, "-m", "trainkit.cli", "run", str(recipe)],
                          cwd=tmp_path, env=env_for(tmp_path), capture_output=True, text=True, timeout=120)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 1, report
    assert re.search(r"out of memory on rank 0 during (build|step 1): peak [0-9.]+ GiB of 4\.66 GiB \(the "
                     r"address-space limit", report) and "can't allocate memory" in report, report
    assert "memory plan: predicted" in report, report
    assert "OutOfMemory" in (tmp_path / "runs" / "as" / "fatal.json").read_text()
