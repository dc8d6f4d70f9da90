"""`trainkit run`: preflight, the run directory, then the workers under torchrun's elastic agent.

Run directory: RUN_DIR = <launch.run_dir>/<name>/, stable per recipe name so `resume: auto` finds the
previous launch's checkpoints. Its files and their names: `trainkit.run_dir` (LAYOUT). The composed
recipe.yaml keeps `${oc.env:...}` references unresolved: each worker resolves them from its own
environment, so no secret is ever written to disk.

World size 1 runs the same worker code in this process (no torchrun, no restarts).

Workers never outlive this process: it exports TRAINKIT_LAUNCHER_PID and each worker asks the
kernel for SIGKILL when its parent dies (see `trainkit.runtime.parent_watch.die_with_launcher`).
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
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Optional, Sequence

from .. import cluster, doctor
from ..recipe import drift, secrets
from ..recipe.launch_plan import run_dir_for, torchrun_command
from ..recipe.problems import format_problems
from ..recipe.schema import Recipe
from .rank_values import environment_set, values_differing_by_rank
from ..run_dir import (CHECKPOINTS, COMMAND, ENVIRONMENT, FAILURE, LAUNCHES, LOGS, RECIPE, RESOLVED_RECIPE,
                       LAUNCH_ID_VAR, TRACKING, clear_fatal, read_fatal, set_aside_path, training_finished,
                       write_json)
from ..runtime import preflight, threads
from ..runtime.accelerator import accelerator_for
from ..tracking import run as tracking
from ..tracking.delivery import BackgroundDelivery, deliver
from . import desync, failures, hang_watch, oom, rendezvous_store, startup
from .lock import LaunchLock, LockHeld, describe, job_identity

COMPLETED = "interrupted after training completed; final checkpoint and summary are complete"
# environment.json records these variables (a secret-looking name keeps its name, not its value)
RECORDED_ENV = ("CUDA_", "NCCL_", "OMP_", "TORCH_", "MASTER_", "PET_", "SLURM_", "TRAINKIT_")


def newest_valid(ckpt_dir: Path, warn: bool = True) -> Optional[Path]:
    from ..runtime.checkpoint import newest_valid as newest  # torch: imported where the work is

    return newest(ckpt_dir, warn=warn)

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


def prepare_run_dir(resolved, recipe_path: str, overrides: Sequence[str], start_fresh: bool,
                    rendezvous: Optional[rendezvous_store.Rendezvous] = None) -> tuple[Path, Path]:
    """Create RUN_DIR and this launch's record; returns (run_dir, launch_dir). `start_fresh` (the
    resume decision for `resume: never`): the previous checkpoints and MLflow spool are set aside."""
    import yaml

    recipe = resolved.recipe
    run_dir = run_dir_for(recipe)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    launch_dir, n = run_dir / LAUNCHES / stamp, 1
    (run_dir / LAUNCHES).mkdir(parents=True, exist_ok=True)
    while True:  # several nodes may launch in the same second on a shared run dir
        try:
            launch_dir.mkdir()
            break
        except FileExistsError:
            n += 1
            launch_dir = run_dir / LAUNCHES / f"{stamp}-{n}"
    clear_fatal(run_dir)  # a new launch is a deliberate retry
    ckpts = run_dir / CHECKPOINTS
    if start_fresh and ckpts.is_dir() and any(ckpts.iterdir()):
        aside = set_aside_path(run_dir, CHECKPOINTS, launch_dir.name)
        ckpts.rename(aside)
        print(f"trainkit: resume: never: moved the previous checkpoints to {aside}")
    spool = run_dir / TRACKING
    if start_fresh and spool.is_dir():
        spool.rename(set_aside_path(run_dir, TRACKING, launch_dir.name))  # a fresh MLflow run
    source = resolved.redact_text(recipe_path + (" " + " ".join(overrides) if overrides else ""))
    composed = ("# Composed by trainkit from " + source + "\n# ${oc.env:...} references are resolved by each "
                "worker from its environment; recipe.resolved.yaml shows the values (secrets as ***)\n"
                + yaml.safe_dump(secrets.redact(resolved.raw, ()), sort_keys=False))
    shown = "# Resolved by trainkit from " + source + " (secrets shown as ***)\n" + \
        yaml.safe_dump(resolved.redacted(), sort_keys=False)
    for folder in (run_dir, launch_dir):
        (folder / RECIPE).write_text(composed)
        (folder / RESOLVED_RECIPE).write_text(shown)
    command = ["trainkit", "run", recipe_path, *overrides]
    lines = [shlex.join(command)]
    if (recipe.world_size or 2) > 1:
        lines.append(shlex.join(_torchrun_command(recipe, run_dir, rendezvous)))
    (launch_dir / COMMAND).write_text(resolved.redact_text("\n".join(lines)) + "\n")
    write_json(launch_dir / ENVIRONMENT, _environment())
    return run_dir, launch_dir


# --------------------------------------------------------------------------- launch
def run(resolved, recipe_path: str, overrides: Sequence[str] = (), accept_changes: bool = False) -> int:
    """Validate runtime inputs, take the run directory, create this launch's record, train.
    Returns the process exit code. Nothing is written before the checks pass."""
    resolved, detected = _with_cluster(resolved)
    if detected is None:
        return 2
    code = _check_before_launch(resolved, recipe_path)
    if code:
        return code
    differing = values_differing_by_rank(recipe_path, overrides, resolved)
    if differing:
        print("trainkit: not started: recipe value(s) depend on the rank's environment, so the ranks would not "
              "train the recipe that was validated and logged:\n  " + "\n  ".join(differing) + "\n  Give every "
              "rank the same value (resolve it before launch, e.g. from a variable of the launching shell).",
              file=sys.stderr, flush=True)
        return 2
    recipe = resolved.recipe
    la = recipe.launch
    lock = LaunchLock(run_dir_for(recipe), job_identity(la.nnodes, la.rdzv_id or recipe.name, la.rdzv_endpoint),
                      single_node=str(la.nnodes) in ("1", "1:1"))
    try:
        got = lock.acquire()  # the first write into the run directory
    except LockHeld as held:
        print(f"trainkit: not started: {lock.folder} is in use by another launch: {describe(held.holder)} "
              f"(lock: {held.path}).\n  Wait for it to finish, stop it (kill {held.holder.get('pid')} on "
              f"{held.holder.get('host')}), or run this one elsewhere with name=OTHER or launch.run_dir=OTHER.",
              file=sys.stderr, flush=True)
        return 2
    try:
        if got.how == "took over":
            print(f"trainkit: warning: took over the lock of a previous launch ({describe(got.previous or {})}): "
                  f"{got.reason}", file=sys.stderr, flush=True)
        if got.how != "joined":  # we are the only launch here: a run left open by a dead one is closed now
            close_run_left_open(lock.folder, announce=True)
            os.environ[LAUNCH_ID_VAR] = lock.data["launch"]  # the workers watch this launch's heartbeat
        return _launch(resolved, recipe_path, overrides, accept_changes,
                       tracking_job=lock.job if detected.found else None,
                       wait_for_run_s=60.0 if detected.values.get("node_rank") not in (None, 0) else 0.0)
    finally:
        lock.release()


def _with_cluster(resolved):
    """A PyTorchJob pod or a SLURM step decides nnodes, node_rank and the rendezvous (docs/clusters.md):
    returns (resolved with those values, what was detected), or (resolved, None) after printing why
    the launch cannot start."""
    import torch  # the GPUs this node's workers will see

    try:
        detected = cluster.detect_here(resolved, gpus=torch.cuda.device_count())
    except cluster.ClusterError as err:
        print(f"trainkit: not started: {resolved.redact_text(str(err))}", file=sys.stderr, flush=True)
        return resolved, None
    if detected.found:
        print(resolved.redact_text(detected.announcement()), flush=True)
        for note in detected.notes:
            print(f"trainkit: note: {note}", flush=True)
    applied = cluster.applied(resolved, detected)
    if detected.found:  # the cluster's node count and ranks change the world the recipe was validated for
        from ..recipe import rules
        from ..recipe.problems import Problem

        refused = [Problem(applied.locate(path), ".".join(map(str, path)), message)
                   for path, message in rules.check(applied.recipe)]
        if refused:
            print("\n".join(str(p) for p in applied.redact_problems(refused)), file=sys.stderr)
            print(f"trainkit: not started: the recipe is valid as written, but not with the world this cluster gives "
                  f"it ({applied.recipe.world_size or '?'} ranks); fix the values named above", file=sys.stderr,
                  flush=True)
            return resolved, None
    return applied, detected


def _check_before_launch(resolved, recipe_path: str) -> int:
    """The runtime checks and the quick environment checks; 2 if the run cannot start. Writes nothing."""
    problems = resolved.redact_problems(preflight.check(resolved))
    errors = [p for p in problems if p.severity == "error"]
    if problems:
        print(format_problems(problems), file=sys.stderr)
    if errors:
        print(f"trainkit: not started: {len(errors)} problem(s) in {recipe_path}", file=sys.stderr)
        return 2
    failed = doctor.before_launch(resolved)  # the quick environment checks: port, GPUs, shm, fds, disk
    if failed:
        print(f"trainkit: not started: {failed} environment check(s) failed (all checks: trainkit doctor "
              f"{recipe_path})", file=sys.stderr)
        return 2
    return 0


def _launch(resolved, recipe_path: str, overrides: Sequence[str], accept_changes: bool,
            tracking_job: Optional[str] = None, wait_for_run_s: float = 0.0) -> int:
    recipe = resolved.recipe
    from ..runtime.resume import decide_at_launch  # torch (checkpoint files): imported where the work is

    decision = decide_at_launch(resolved, run_dir_for(recipe), accept_changes)
    if decision.exit_code is not None:
        return decision.exit_code
    in_process = recipe.world_size == 1
    with nullcontext() if in_process else rendezvous_store.served(recipe) as rendezvous:
        return _train(resolved, recipe_path, overrides, decision, rendezvous, tracking_job, wait_for_run_s)


def _train(resolved, recipe_path: str, overrides: Sequence[str], decision,
           rendezvous: Optional[rendezvous_store.Rendezvous], tracking_job: Optional[str], wait_for_run_s: float) -> int:
    """This launch's record, its MLflow run, the workers (in this process or under torchrun), the close."""
    recipe = resolved.recipe
    run_dir, launch_dir = prepare_run_dir(resolved, recipe_path, overrides, decision.start_fresh, rendezvous)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # restarts are flaky without it (pytorch#135712)
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's C++ chatter is not for the console
    os.environ["TRAINKIT_LAUNCHER_PID"] = str(os.getpid())  # workers die with this process
    in_process = recipe.world_size == 1
    print(f"trainkit: run {recipe.name}: {recipe.world_size or recipe.launch.nnodes} process(es)"
          f"{' in-process' if in_process else ''}, run dir {run_dir}", flush=True)
    environment = json.loads((launch_dir / ENVIRONMENT).read_text())
    where = tracking.open_run(resolved, run_dir, launch_dir, environment, job=tracking_job, wait_s=wait_for_run_s)
    if where and decision.accepted:
        tracking.continue_in_new_run(run_dir, decision.step, resolved.redacted(), drift.summary(decision.accepted))
    delivery = None
    if where:
        print(f"trainkit: tracking: {where}", flush=True)
        delivery = BackgroundDelivery(run_dir, announce=True)  # in this process: never on the workers' time
    try:
        code, reason = _run_in_process(run_dir, launch_dir, resolved.redact_text, delivery is not None) if in_process else \
            _run_torchrun(recipe, run_dir, launch_dir, resolved.redact_text, rendezvous)
    except BaseException:
        if delivery is not None:
            delivery.close(timeout=5.0)
        raise
    with _closing_first():
        if delivery is not None:
            delivery.close(timeout=5.0)
        return _close(recipe, run_dir, launch_dir, where, code, resolved.redact_text(reason))


def _close(recipe: Recipe, run_dir: Path, launch_dir: Path, where: Optional[str], code: int, reason: str) -> int:
    if code != 0:
        (launch_dir / FAILURE).write_text(reason + "\n")
    if where:
        from .artifacts import model_artifacts  # torch: imported where the work is

        status = "FINISHED" if code == 0 else "KILLED" if code > 128 else "FAILED"
        artifacts, tags = model_artifacts(recipe, run_dir, status)
        tags = {**tags, **hang_watch.tags(run_dir, since=(launch_dir / COMMAND).stat().st_mtime)}
        closed = tracking.close_run(run_dir, launch_dir, status, reason or "completed", artifacts, tags,
                                    timeout=recipe.tracking.close_wait_s)
        print(f"trainkit: {closed}", flush=True)
    if code == 0:
        from .next_steps import next_steps

        print(next_steps(recipe, run_dir, tracked=bool(where)), flush=True)
    return code


@contextmanager
def _closing_first():
    """Training is over: a first Ctrl-C/SIGTERM now lets the run record close (bounded by the
    delivery timeouts) instead of leaving it RUNNING; a second one stops at once."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen = []

    def later(signum, frame):
        if seen:
            raise KeyboardInterrupt
        seen.append(signum)
        print(f"trainkit: {signal.Signals(signum).name}: training is over; closing the run record first "
              f"(again to stop now)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, later) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def completed(run_dir: Path, launch_dir: Optional[Path]) -> bool:
    """Did that launch finish training? `run_dir.training_finished`, counting only a summary written
    after the launch started (its command file)."""
    try:
        since = (launch_dir / COMMAND).stat().st_mtime if launch_dir is not None else None
    except OSError:
        return False
    return training_finished(run_dir, since)


def latest_launch(run_dir: Path) -> Optional[Path]:
    launches = [p for p in (run_dir / LAUNCHES).glob("*") if (p / COMMAND).is_file()]
    return max(launches, key=lambda p: (p / COMMAND).stat().st_mtime) if launches else None


def close_run_left_open(run_dir: Path, announce: bool) -> Optional[str]:
    """Close the MLflow run a dead launch left RUNNING (its status from what the run dir proves),
    and deliver. Called with no live launch in `run_dir`: a record cut mid-line is then a tear, and a
    run a torn spool left open is closed saying so (the launch may not have died at all)."""
    if not (run_dir / TRACKING).is_dir():
        return None
    from ..tracking import recovery

    launch_dir = latest_launch(run_dir)
    finished = completed(run_dir, launch_dir)
    torn = recovery.repair(run_dir)
    if torn and tracking.open_status(run_dir) == "RUNNING":
        status, why = recovery.close_left_open(run_dir, launch_dir, finished), \
            "the MLflow run was left open by a torn tracking spool"
    else:
        status, why = tracking.close_dead_launch_run(run_dir, launch_dir, finished), \
            f"the previous launch ({launch_dir.name if launch_dir else '?'}) died without closing its MLflow run"
    if not (status or torn):
        return None
    pending, error = deliver(run_dir)  # best effort now; what fails waits in the spool for the next delivery
    for line in recovery.report(run_dir)[0] if torn and announce else ():
        print(f"trainkit: tracking: {line}", file=sys.stderr, flush=True)
    if status and torn:
        recovery.closed(run_dir)  # announced here once the server holds it, not again by `trainkit sync`
    if status and announce:
        print(f"trainkit: tracking: {why}; " + (f"marked {status}" if not pending else
              f"{status} spooled, not delivered yet ({error}): `trainkit sync {run_dir}` delivers it"),
              file=sys.stderr, flush=True)
    return status


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_in_process(run_dir: Path, launch_dir: Path, redact=str, delivering: bool = False) -> tuple[int, str]:
    """World size 1: the worker's own code, in this process, under the same env contract as torchrun;
    its intra-op threads leave the delivery thread (when `delivering`) a core (`runtime.threads`)."""
    from ..runtime import stop_signals, worker  # torch: imported where the work is

    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RESTART_COUNT": "0"}
    try:
        with environment_set(env), threads.sharing_the_launcher_process(delivering):
            return worker.main([str(run_dir)]), ""
    except stop_signals.StopRequested as stop:
        return _stopped(stop.signum, run_dir, launch_dir)
    except Exception as exc:
        reason = redact(f"training failed: {type(exc).__name__}: {exc}{oom.in_process_note(run_dir)}")
        print(f"trainkit: {reason}", file=sys.stderr)
        return 1, reason


def _torchrun_command(recipe: Recipe, run_dir: Path, rendezvous: Optional[rendezvous_store.Rendezvous]) -> list[str]:
    """The torchrun command of this launch: the planned one, joining the store trainkit serves."""
    command = torchrun_command(recipe, run_dir)
    return rendezvous.torchrun_command(command) if rendezvous else command


def _run_torchrun(recipe: Recipe, run_dir: Path, launch_dir: Path, redact=str,
                  rendezvous: Optional[rendezvous_store.Rendezvous] = None) -> tuple[int, str]:
    """torchrun's agent in this process; `redact` masks secrets in the failure report it prints."""
    import torch
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if "OMP_NUM_THREADS" not in os.environ:  # torchrun would set 1 and warn; share the cores instead
        os.environ["OMP_NUM_THREADS"] = str(threads.per_rank(recipe.launch.nproc_per_node))
    cmd = _torchrun_command(recipe, run_dir, rendezvous)
    # bounded by launch.join_timeout_s; without a trainkit-served rendezvous (None: torch's agent may host
    # the store itself, on this very node) there is nothing to wait for before torchrun
    unreachable = startup.unreachable(recipe, socket.gethostname()) if rendezvous is not None else None
    if unreachable:
        print(f"trainkit: {unreachable}", file=sys.stderr, flush=True)
        return 1, unreachable
    if rendezvous is not None and rendezvous.gloo_interface:  # gloo's pair sockets stay on loopback too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", rendezvous.gloo_interface)
    kills_before = oom.kills_now()  # a rank the OOM killer ends is an out-of-memory failure, not a restart
    backend = accelerator_for(recipe, cuda_available=torch.cuda.is_available()).backend
    os.environ.update(hang_watch.flight_recorder_env(run_dir, os.environ, backend))  # torch's Flight Recorder (the hang report)
    os.environ.update(desync.debug_env(recipe.launch.debug_collectives, os.environ))  # torch's collective checks
    watch = hang_watch.HangWatch(run_dir, recipe.launch.hang_timeout_s, recipe.launch.timeout_s, backend)
    announcer = failures.RestartAnnouncer(run_dir / LOGS, lambda: newest_valid(run_dir / CHECKPOINTS, warn=False),
                                          fatal_marker=lambda: oom.marker_or_kill(run_dir, kills_before,
                                                                                  announcer.failed),
                                          max_restarts=recipe.launch.max_restarts, hang=lambda: watch.hang)
    try:
        with announcer, watch:
            torchrun.run(torchrun.parse_args(cmd[1:]))
    except ChildFailedError as err:
        hang = watch.hang_of({f.pid for f in err.failures.values()})
        report = redact(hang.failure_report(recipe.launch.max_restarts) if hang else oom.explain(
            failures.summarize(err, run_dir / LOGS, recipe.launch.max_restarts), err, run_dir, kills_before, recipe))
        mismatch = desync.explain({rank: failure.message for rank, failure in err.failures.items()})
        report = f"{report}\n{mismatch}" if mismatch else report  # both sides, after the first failure's error
        print(report, file=sys.stderr)
        return 1, _with_disk_full_note(report, run_dir)
    except SignalException as exc:
        if announcer.fatal is not None:  # a rank's failure no restart can fix: the agent was stopped for it
            reason = redact(f"training failed: {announcer.fatal['message']}; not restarting (a restart would "
                            f"repeat it; worker logs: {run_dir / LOGS})"
                            + (f"\n{oom.advice(recipe)}" if oom.is_out_of_memory(announcer.fatal) else ""))
            mismatch = desync.explain({"marker": announcer.fatal["message"]})  # the marking rank's own error
            reason = f"{reason}\n{mismatch}" if mismatch else reason
            print(f"trainkit: {reason}", file=sys.stderr, flush=True)
            return 1, _with_disk_full_note(reason, run_dir)
        return _stopped(int(exc.sigval), run_dir, launch_dir)
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT, run_dir, launch_dir)
    except Exception as exc:  # the agent itself failed (e.g. an unreadable error file on a full disk)
        reason = startup.rendezvous_failed(exc, recipe, socket.gethostname())
        if reason:
            print(f"trainkit: {redact(reason)}", file=sys.stderr, flush=True)
            return 1, redact(reason)
        reason = redact(f"torchrun's agent failed: {type(exc).__name__}: {exc}")
        print(f"trainkit: {reason} (worker logs: {run_dir / LOGS})", file=sys.stderr)
        return 1, _with_disk_full_note(reason, run_dir)
    return 0, ""


def _with_disk_full_note(report: str, run_dir: Path) -> str:
    """Say that the checkpoint disk is full when the ranks' own report could not (it lives there too)."""
    note = failures.disk_full_note(run_dir / CHECKPOINTS)
    if note is None or "no space left on the disk holding" in report:
        return report
    print(note, file=sys.stderr, flush=True)
    return f"{report}\n{note}"


def _stopped(signum: int, run_dir: Path, launch_dir: Path) -> tuple[int, str]:
    if completed(run_dir, launch_dir):  # the signal came after the last checkpoint and summary.json
        print(f"trainkit: {signal.Signals(signum).name}: {COMPLETED}", file=sys.stderr, flush=True)
        return 0, f"{COMPLETED} ({signal.Signals(signum).name})"
    latest: Optional[Path] = newest_valid(run_dir / CHECKPOINTS, warn=False)
    where = f"newest complete checkpoint: {latest} (resume: auto continues from it)" if latest else \
        "no complete checkpoint was written"
    reason = f"stopped by {signal.Signals(signum).name}: workers terminated; {where}"
    print(f"trainkit: {reason}", file=sys.stderr, flush=True)
    return 128 + int(signum), reason
