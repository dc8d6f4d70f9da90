"""`trainkit run`: preflight, the run directory, then the workers under torchrun's elastic agent.

Run directory (stable per recipe name, so `resume: auto` finds the previous launch's checkpoints):

    RUN_DIR = <launch.run_dir>/<name>/
      recipe.yaml              the composed recipe the workers read (latest launch); `${oc.env:...}`
                               references stay unresolved: each worker resolves them from its own
                               environment, so no secret is ever written to disk
      recipe.resolved.yaml     the resolved recipe for people, secrets shown as ***
      checkpoints/step-NNNNNNNN/
      metrics.jsonl            appended by every launch
      summary.json             written by rank 0 at the end
      logs/<rdzv-id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log, error.json   (torchelastic)
      launches/<timestamp>/    recipe.yaml, recipe.resolved.yaml, command.txt, environment.json of each
                               launch (environment.json: secret-looking variables' values dropped)

World size 1 runs the same worker code in this process (no torchrun, no restarts).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..recipe import secrets
from ..recipe.problems import format_problems
from ..recipe.schema import Recipe
from . import failures

WORKER_MODULE = "trainkit.runtime.worker"
# environment.json records these variables (a secret-looking name keeps its name, not its value)
RECORDED_ENV = ("CUDA_", "NCCL_", "OMP_", "TORCH_", "MASTER_", "PET_", "SLURM_", "TRAINKIT_")


def run_dir_for(recipe: Recipe) -> Path:
    return Path(recipe.launch.run_dir) / recipe.name


def torchrun_command(recipe: Recipe, run_dir: str | Path) -> list[str]:
    """The exact torchrun command line a launch uses (printed by `trainkit plan`)."""
    la = recipe.launch
    cmd = ["torchrun", f"--nnodes={la.nnodes}", f"--nproc-per-node={la.nproc_per_node}"]
    if la.nnodes in (1, "1") and la.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--rdzv-backend={la.rdzv_backend}", f"--rdzv-id={la.rdzv_id or recipe.name}"]
        if la.rdzv_endpoint:
            cmd.append(f"--rdzv-endpoint={la.rdzv_endpoint}")
        if la.node_rank is not None:
            cmd.append(f"--node-rank={la.node_rank}")
    cmd += [f"--max-restarts={la.max_restarts}", f"--monitor-interval={la.monitor_interval:g}",
            f"--log-dir={Path(run_dir) / 'logs'}"]
    quiet = [f"{r}:3" for r in range(1, la.nproc_per_node)]  # local rank 0 keeps the console
    if quiet:
        cmd.append(f"--redirects={','.join(quiet)}")
    return cmd + ["-m", WORKER_MODULE, str(run_dir)]


# --------------------------------------------------------------------------- run directory
def _environment() -> dict:
    import torch

    env = {
        "hostname": socket.gethostname(), "platform": platform.platform(), "python": sys.version.split()[0],
        "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_count": os.cpu_count(), "cwd": os.getcwd(),
        "env": secrets.redact_environment({k: v for k, v in os.environ.items() if k.startswith(RECORDED_ENV)}),
    }
    from importlib.metadata import PackageNotFoundError, version

    for package in ("torchvision", "deepspeed", "mlflow"):  # versions from metadata: no heavy imports
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def prepare_run_dir(resolved, recipe_path: str, overrides: Sequence[str]) -> tuple[Path, Path]:
    """Create RUN_DIR and this launch's record; returns (run_dir, launch_dir)."""
    import yaml

    recipe = resolved.recipe
    run_dir = run_dir_for(recipe)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    launch_dir, n = run_dir / "launches" / stamp, 1
    (run_dir / "launches").mkdir(parents=True, exist_ok=True)
    while True:  # several nodes may launch in the same second on a shared run dir
        try:
            launch_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            launch_dir = run_dir / "launches" / f"{stamp}-{n}"
    ckpts = run_dir / "checkpoints"
    if recipe.trainer.resume == "never" and ckpts.is_dir() and any(ckpts.iterdir()):
        aside = run_dir / f"checkpoints.before-{launch_dir.name}"
        ckpts.rename(aside)
        print(f"trainkit: resume: never: moved the previous checkpoints to {aside}")
    spool = run_dir / "tracking"
    if recipe.trainer.resume == "never" and spool.is_dir():
        spool.rename(run_dir / f"tracking.before-{launch_dir.name}")  # a fresh MLflow run
    source = resolved.redact_text(recipe_path + (" " + " ".join(overrides) if overrides else ""))
    composed = ("# Composed by trainkit from " + source + "\n# ${oc.env:...} references are resolved by each "
                "worker from its environment; recipe.resolved.yaml shows the values (secrets as ***)\n"
                + yaml.safe_dump(secrets.redact(resolved.raw, ()), sort_keys=False))
    shown = "# Resolved by trainkit from " + source + " (secrets shown as ***)\n" + \
        yaml.safe_dump(resolved.redacted(), sort_keys=False)
    for folder in (run_dir, launch_dir):
        (folder / "recipe.yaml").write_text(composed)
        (folder / "recipe.resolved.yaml").write_text(shown)
    command = ["trainkit", "run", recipe_path, *overrides]
    lines = [shlex.join(command)]
    if (recipe.world_size or 2) > 1:
        lines.append(shlex.join(torchrun_command(recipe, run_dir)))
    (launch_dir / "command.txt").write_text(resolved.redact_text("\n".join(lines)) + "\n")
    (launch_dir / "environment.json").write_text(json.dumps(_environment(), indent=2) + "\n")
    return run_dir, launch_dir


# --------------------------------------------------------------------------- launch
def run(resolved, recipe_path: str, overrides: Sequence[str] = ()) -> int:
    """Validate runtime inputs, create the run directory, train. Returns the process exit code."""
    from ..runtime import preflight
    from ..tracking import run as tracking

    problems = resolved.redact_problems(preflight.check(resolved))
    errors = [p for p in problems if p.severity == "error"]
    if problems:
        print(format_problems(problems), file=sys.stderr)
    if errors:
        print(f"trainkit: not started: {len(errors)} problem(s) in {recipe_path}", file=sys.stderr)
        return 2
    from .. import doctor

    failed = doctor.before_launch(resolved)  # the quick environment checks: port, GPUs, shm, fds, disk
    if failed:
        print(f"trainkit: not started: {failed} environment check(s) failed (all checks: trainkit doctor "
              f"{recipe_path})", file=sys.stderr)
        return 2
    recipe = resolved.recipe
    run_dir, launch_dir = prepare_run_dir(resolved, recipe_path, overrides)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # restarts are flaky without it (pytorch#135712)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's C++ chatter is not for the console
    in_process = recipe.world_size == 1
    print(f"trainkit: run {recipe.name}: {recipe.world_size or recipe.launch.nnodes} process(es)"
          f"{' in-process' if in_process else ''}, run dir {run_dir}", flush=True)
    environment = json.loads((launch_dir / "environment.json").read_text())
    where = tracking.open_run(resolved, run_dir, launch_dir, environment)
    delivery = None
    if where:
        from ..tracking.delivery import BackgroundDelivery

        print(f"trainkit: tracking: {where}", flush=True)
        delivery = BackgroundDelivery(run_dir, announce=True)  # in this process: never on the workers' time
    try:
        redact = resolved.redact_text
        code, reason = _run_in_process(run_dir, redact) if in_process else _run_torchrun(recipe, run_dir, redact)
    finally:
        if delivery is not None:
            delivery.close(timeout=5.0)
    reason = resolved.redact_text(reason)
    if code != 0:
        (launch_dir / "failure.txt").write_text(reason + "\n")
    if where:
        status = "FINISHED" if code == 0 else "KILLED" if code > 128 else "FAILED"
        print(f"trainkit: {tracking.close_run(run_dir, launch_dir, status, reason or 'completed', recipe)}", flush=True)
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_process(run_dir: Path, redact=str) -> tuple[int, str]:
    """World size 1: the worker's own code, in this process, under the same env contract as torchrun."""
    from ..runtime import worker

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RESTART_COUNT": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return worker.main([str(run_dir)]), ""
    except worker.StopRequested as stop:
        return _stopped(stop.signum, run_dir)
    except Exception as exc:
        reason = redact(f"training failed: {type(exc).__name__}: {exc}")
        print(f"trainkit: {reason}", file=sys.stderr)
        return 1, reason
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_torchrun(recipe: Recipe, run_dir: Path, redact=str) -> tuple[int, str]:
    """torchrun's agent in this process; `redact` masks secrets in the failure report it prints."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "OMP_NUM_THREADS" not in os.environ:  # torchrun would set 1 and warn; share the cores instead
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // recipe.launch.nproc_per_node))
    cmd = torchrun_command(recipe, run_dir)
    try:
        torchrun.run(torchrun.parse_args(cmd[1:]))
    except ChildFailedError as err:
        report = redact(failures.summarize(err, run_dir / "logs", recipe.launch.max_restarts))
        print(report, file=sys.stderr)
        return 1, report
    except SignalException as exc:
        return _stopped(int(exc.sigval), run_dir)
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT, run_dir)
    return 0, ""


def _stopped(signum: int, run_dir: Path) -> tuple[int, str]:
    from ..runtime.checkpoint import newest_valid

    latest: Optional[Path] = newest_valid(run_dir / "checkpoints", warn=False)
    where = f"newest complete checkpoint: {latest} (resume: auto continues from it)" if latest else \
        "no complete checkpoint was written"
    reason = f"stopped by {signal.Signals(signum).name}: workers terminated; {where}"
    print(f"trainkit: {reason}", file=sys.stderr, flush=True)
    return 128 + int(signum), reason
