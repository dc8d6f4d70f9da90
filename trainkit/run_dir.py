"""The run directory: its layout, the names of its files and the readers/writers of its records.

Every module that writes or reads a run's files (the worker, monitors, the launcher, tracking's
artifact list, `report`, `top`, `tune`, `bench scaling`, bench/) names them through here, so a file is
renamed or re-shaped in one place (`trainkit compare` reads MLflow, not run directories). Bottom layer, standard library only: the recipe layer, the launcher and `trainkit top` use it
without importing torch. Where RUN_DIR is for a recipe (`<launch.run_dir>/<name>`) is a recipe fact:
`trainkit.recipe.launch_plan.run_dir_for`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

# --------------------------------------------------------------------------- RUN_DIR/
RECIPE = "recipe.yaml"  # the composed recipe the workers read; `${oc.env:...}` left for each worker
RESOLVED_RECIPE = "recipe.resolved.yaml"  # the resolved recipe for people, secrets as ***
METRICS = "metrics.jsonl"  # one JSON object per logged step (rank 0), appended by every launch
SUMMARY = "summary.json"  # written by rank 0 at the end, after the final checkpoint
FATAL = "fatal.json"  # a failure no restart can fix (NaN, full disk); cleared by each launch
FATAL_RESERVED = ".fatal.json.reserved"  # FATAL's blocks, allocated by each launch while the disk has room
LOCK = "launch.lock"  # the live launch (launch/lock.py)
LOCK_HEARTBEAT_S = 10.0  # how often the launch holding LOCK refreshes its heartbeat
LAUNCH_ID_VAR = "TRAINKIT_LAUNCH_ID"  # set for a launch's workers: the lock's `launch` they belong to
CHECKPOINTS = "checkpoints"  # step-NNNNNNNN/ folders (runtime/checkpoint_layout.py)
LOGS = "logs"  # torchrun's --log-dir: <rdzv-id>_*/attempt_<n>/<local rank>/{stdout,stderr}.log, error.json
LAUNCHES = "launches"  # <timestamp>/: one folder per launch
REPORTS = "reports"  # the bottleneck report and the evidence it reasons from
LIVE = "live"  # what `trainkit top` reads while the run trains
TRACKING = "tracking"  # the MLflow spool (tracking/spool.py)
PROFILER = "profiler"  # the profiler monitor's traces
TENSORBOARD = "tensorboard"  # the tensorboard monitor's default event folder
MODEL = "model"  # the saved MLflow model (tracking.log_model)
ADAPTER = "adapter"  # a LoRA run's PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
SLURM = "slurm"  # the sbatch script's job logs (`trainkit slurm`)

# RUN_DIR/checkpoints/: read by runtime/checkpoint_layout.py and runtime/resume.py, written by runtime/checkpoint.py
CHECKPOINT_PREFIX = "step-"  # step-NNNNNNNN/: one checkpoint, named by its step (`checkpoint_name`)
CHECKPOINT_TMP = ".tmp-"  # .tmp-step-NNNNNNNN/: a save in progress, or one that failed
CHECKPOINT_ABANDONED = "abandoned-"  # abandoned-step-NNNNNNNN-<time>/: newer than the one a resume started from
CHECKPOINT_META = "meta.json"  # written last: the step and every file's sha256; a folder without it is no checkpoint
CHECKPOINT_RECIPE = "recipe.json"  # the resolved recipe that trained up to this checkpoint (the drift check)
CHECKPOINT_RNG = "rng-rank{rank:05d}.pt"  # each rank's RNG state
CHECKPOINT_TRAINER = "trainer.pt"  # the loop's state: step, epoch, position in the epoch, scheduler, scaler
SET_ASIDE = ".before-"  # checkpoints.before-<launch>/, tracking.before-<launch>/: set aside by `resume: never`

# RUN_DIR/launches/<timestamp>/ (beside its own recipe.yaml and recipe.resolved.yaml)
COMMAND = "command.txt"  # the trainkit and torchrun command lines
ENVIRONMENT = "environment.json"  # the recorded environment (secret-looking values dropped)
FAILURE = "failure.txt"  # why the launch failed, when it did

# RUN_DIR/logs/<rdzv-id>_*/attempt_<n>/<local rank>/: torchelastic's names, read by launch/failures.py
RANK_ERROR = "error.json"  # the rank's exception (TORCHELASTIC_ERROR_FILE, written by runtime/error_file.py)
RANK_STDOUT = "stdout.log"
RANK_STDERR = "stderr.log"

# RUN_DIR/reports/ (and RUN_DIR/live/BREAKDOWN)
BREAKDOWN = "breakdown.json"  # the evidence: per-rank step phases, env, wall times, GPU busy
BOTTLENECK = "bottleneck.md"  # the bottleneck report for people
VERDICT = "verdict.json"  # the verdict and advice as tags (tracking turns them into MLflow run tags)
GPU = "gpu.json"  # the gpu monitor's utilisation over the run
MESH_COMM = "mesh-comm.json"  # the breakdown monitor's communication per mesh dimension over the run
CUDA_OOM_SNAPSHOT = "cuda-oom-rank{rank}.pickle"  # the allocator's history when a rank ran out of GPU memory
CUDA_MEMORY_SNAPSHOT = "cuda-memory-rank{rank}.pickle"  # the memory monitor's allocator history at the end

# RUN_DIR/live/
RANK_MEMORY = "memory-rank{rank}.json"  # each rank's phase, peak memory and limit (the OOM report reads it)
RANK_PROGRESS = "progress-rank{rank}.json"  # each rank's step and phase, rewritten in place (the hang watch)
RANK_STACKS = "stacks-rank{rank}.txt"  # each rank's Python stacks, dumped on SIGUSR1 (the hang report)
LOADER_STACKS = "stacks-rank{rank}-loader-{pid}.txt"  # a rank's DataLoader worker's stacks, on SIGUSR1 too
HANG = "hang.md"  # RUN_DIR/reports/: which rank was behind, where each rank was, their stacks
NCCL_TRACE = "nccl-trace-rank"  # RUN_DIR/reports/ prefix of NCCL's Flight Recorder dumps (rank appended)
FLIGHT_RECORDER = "flight-recorder"  # RUN_DIR/reports/ folder of every rank's Flight Recorder dump at a hang
FLIGHT_RECORDER_DUMP = "rank"  # ... each dump's name: this prefix, then the rank (fr_trace's `-p` prefix)
FLIGHT_RECORDER_ANALYSIS = "analysis.txt"  # ... torch's fr_trace's output on them

WARMUP_STEPS = 2  # the first steps of a launch pay for allocation, autotuning and worker start-up: no
#                   step statistics (metrics.jsonl's step_time_s, the report's medians) before step 3

# (path in RUN_DIR, what it holds): docs/running.md shows this table (tests/test_run_dir.py)
LAYOUT = (
    (RECIPE, "the composed recipe the workers read (latest launch); `${oc.env:...}` references stay "
             "unresolved: each worker resolves them from its environment"),
    (RESOLVED_RECIPE, "the resolved recipe for people, secrets as `***` (docs/security.md)"),
    (METRICS, "one JSON object per logged step (rank 0), appended by every launch"),
    (SUMMARY, "final loss, samples/s, eval, checkpoint, per-rank parameter digests (written at the end); two "
              "durations: `loop_s`, the training loop's seconds (samples/s is measured over them), and "
              "`wall_times.wall_s`, this launch's process from start to the report (startup and shutdown included)"),
    (FATAL, "a failure no restart can fix (NaN, full disk, out of memory): restarts stop; cleared by the next "
            "launch"),
    (FATAL_RESERVED, "the fatal marker's space, allocated by each launch so a rank can write it on a full disk"),
    (LOCK, "the launch that runs here now (removed when it ends)"),
    (f"{CHECKPOINTS}/{CHECKPOINT_PREFIX}00000050/", "one checkpoint per saved step (see below)"),
    (f"{LOGS}/<rdzv-id>_*/attempt_<n>/<local rank>/", f"{RANK_STDOUT}, {RANK_STDERR}, {RANK_ERROR} (torchelastic)"),
    (f"{LAUNCHES}/<timestamp>/", f"{RECIPE}, {RESOLVED_RECIPE}, {COMMAND} (trainkit + torchrun command), "
                                 f"{ENVIRONMENT} (secret-looking variables keep their name, not their value), "
                                 f"{FAILURE} (why it failed)"),
    (f"{REPORTS}/", f"{BREAKDOWN} (the evidence), {BOTTLENECK} (the report), {VERDICT} (run tags), "
                    f"{GPU} (gpu monitor), {MESH_COMM} (breakdown monitor, with a mesh), "
                    f"cuda-memory-rank<R>.pickle (memory monitor snapshots), "
                    f"cuda-oom-rank<R>.pickle (the GPU memory history of a rank that ran out, docs/memory.md)"),
    (f"{LIVE}/{BREAKDOWN}", "every rank's step phases of the last log interval, for `trainkit top`"),
    (f"{LIVE}/memory-rank<R>.json", "each rank's phase (build, step N, checkpoint N, end), peak memory and limit: "
                                    "what the out-of-memory report says"),
    (f"{LIVE}/progress-rank<R>.json, {LIVE}/stacks-rank<R>.txt, {LIVE}/stacks-rank<R>-loader-<pid>.txt",
     "each rank's step and phase (the hang watch reads it) and its stacks, and its DataLoader workers', when a "
     "hang was declared"),
    (f"{REPORTS}/{HANG}, {REPORTS}/{FLIGHT_RECORDER}/{FLIGHT_RECORDER_DUMP}<R>, "
     f"{REPORTS}/{FLIGHT_RECORDER}/{FLIGHT_RECORDER_ANALYSIS}, {REPORTS}/{NCCL_TRACE}<R>",
     "the hang report (docs/running.md, 'When a run hangs'); each rank's Flight Recorder dump at the hang and "
     "torch's analysis of them; NCCL's own Flight Recorder dumps"),
    (f"{TRACKING}/", "the MLflow spool: what is still to be delivered"),
    (f"{PROFILER}/", "profiler monitor traces"),
    (f"{TENSORBOARD}/", "tensorboard monitor events"),
    (f"{MODEL}/", "the saved MLflow model (`tracking.log_model`)"),
    (f"{SLURM}/", "the SLURM job's output (`trainkit slurm`)"),
    ("metrics.rewound-<time>-<step>.jsonl", "metrics of steps a restart or resume redid, set aside"),
    (f"{CHECKPOINTS}{SET_ASIDE}<launch>/, {TRACKING}{SET_ASIDE}<launch>/",
     "set aside by a launch with `trainer.resume: never`"),
)


def write_json(path: Path, data: Any, indent: Optional[int] = 2) -> None:
    """One JSON document per file, ending in a newline (the run directory's record format)."""
    Path(path).write_text(json.dumps(data, indent=indent) + "\n")


def read_json(path: Path) -> Any:
    """A JSON record; OSError if it is missing, ValueError if it is not JSON (cut short by a crash)."""
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- summary.json
def summary_path(run_dir: Path) -> Path:
    return Path(run_dir) / SUMMARY


def write_summary(run_dir: Path, summary: dict) -> None:
    write_json(summary_path(run_dir), summary)


def read_summary(run_dir: Path) -> dict:
    return read_json(summary_path(run_dir))


def has_summary(run_dir: Path) -> bool:
    """Rank 0 wrote the end-of-training summary (whether training finished: `training_finished`)."""
    return summary_path(run_dir).is_file()


def training_finished(run_dir: Path, since: Optional[float] = None) -> bool:
    """Did training finish in RUN_DIR? The one rule: its summary (written after the final checkpoint) is
    there, complete, written after `since` (a launch's start time: an earlier launch's summary does not
    count), and names a complete checkpoint (its CHECKPOINT_META) of the last step."""
    try:
        summary = read_summary(run_dir)
        if since is not None and summary_path(run_dir).stat().st_mtime < since:
            return False  # an earlier launch's summary
    except (OSError, ValueError):
        return False
    if not summary.get("checkpoint"):
        return False
    name = Path(summary["checkpoint"]).name  # the path may be relative to the launch's folder: look here
    return name == checkpoint_name(int(summary.get("steps", -1))) and \
        checkpoint_meta_path(Path(run_dir) / CHECKPOINTS / name).is_file()


# --------------------------------------------------------------------------- checkpoints/
def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of `step` (step-00000050)."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_meta_path(folder: Path) -> Path:
    """A checkpoint folder's CHECKPOINT_META: there only once every file is written."""
    return Path(folder) / CHECKPOINT_META


def set_aside_path(run_dir: Path, name: str, launch: str) -> Path:
    """Where a launch with `trainer.resume: never` moves RUN_DIR/NAME (CHECKPOINTS, TRACKING) of the runs
    before it."""
    return Path(run_dir) / f"{name}{SET_ASIDE}{launch}"


# --------------------------------------------------------------------------- metrics.jsonl
def metrics_path(run_dir: Path) -> Path:
    return Path(run_dir) / METRICS


def read_metrics(run_dir: Path) -> list[dict]:
    """Every logged step's record, in file order (a torn line raises ValueError)."""
    return [json.loads(line) for line in metrics_path(run_dir).read_text().splitlines() if line.strip()]


def last_metrics(run_dir: Path) -> dict:
    """The newest log step's metrics (the last complete line of metrics.jsonl), {} when there is none;
    reads only the file's tail, so a live view can call it every second."""
    path = metrics_path(run_dir)
    if not path.is_file():
        return {}
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


def rewound_metrics_path(metrics: Path, stamp: str, step: int) -> Path:
    """Where the lines of steps after `step` go when training continues from `step`."""
    return Path(metrics).with_name(f"metrics.rewound-{stamp}-{step}.jsonl")


def measured_step_times(rows: list[dict]) -> list[float]:
    """The logged mean step times after the warm-up steps (the loop logs none before them)."""
    return [r["step_time_s"] for r in rows if r.get("step_time_s") and r.get("step", 0) > WARMUP_STEPS]


# --------------------------------------------------------------------------- fatal.json
FATAL_BYTES = 4096


def reserve_fatal(run_dir: Path) -> None:
    """Allocate the fatal marker's space now, so a rank can still write it when the disk is full
    (the failure it most often reports). A disk already too full for 4 KiB is left to the write's
    own fallback."""
    try:
        with open(Path(run_dir) / FATAL_RESERVED, "wb") as fh:
            fh.write(b" " * FATAL_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError:
        pass


def write_fatal(run_dir: Path, exc: BaseException) -> None:
    """Mark a failure no restart can fix: overwrite the reserved blocks in place (no allocation, so
    it fits on a full disk) and rename them to FATAL; without a reservation, an ordinary write.
    Raises OSError when the marker cannot be written at all."""
    import fcntl

    record = {"error": type(exc).__name__, "message": str(exc)[:FATAL_BYTES // 2]}
    data = json.dumps(record).encode()[:FATAL_BYTES]
    reserved = Path(run_dir) / FATAL_RESERVED
    try:
        fd = os.open(reserved, os.O_WRONLY)
    except OSError:
        write_json(Path(run_dir) / FATAL, record, indent=None)
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two ranks failing at once: one marker, whole
        os.pwrite(fd, data + b" " * (FATAL_BYTES - len(data)), 0)  # JSON then spaces: still one JSON value
        os.fsync(fd)
        os.rename(reserved, Path(run_dir) / FATAL)
    except FileNotFoundError:  # another rank renamed it first: its marker stands
        pass
    finally:
        os.close(fd)


DAMAGED_FATAL = "a failure no restart can fix ended the previous attempt (its marker is damaged, so the cause is unknown)"


def read_fatal(run_dir: Path) -> Optional[dict]:
    """{"error": exception class name, "message": ...} of the marked failure, or None. A marker that
    exists but cannot be read (cut short, empty) still means "fatal": the cause is unknown."""
    path = Path(run_dir) / FATAL
    if not path.is_file():
        return None
    try:
        found = read_json(path)
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or "message" not in found:
        return {"error": "unknown", "message": DAMAGED_FATAL}
    return found


def clear_fatal(run_dir: Path) -> None:
    """A new launch is a deliberate retry: remove the marker and reserve its space again."""
    (Path(run_dir) / FATAL).unlink(missing_ok=True)
    reserve_fatal(run_dir)


# --------------------------------------------------------------------------- reports/
def report_path(run_dir: Path, name: str) -> Path:
    """RUN_DIR/reports/NAME (BREAKDOWN, BOTTLENECK, VERDICT, GPU, or a monitor's own file)."""
    return Path(run_dir) / REPORTS / name


def read_evidence(run_dir: Path) -> dict:
    """reports/breakdown.json: what the bottleneck report of a finished run reasons from."""
    return read_json(report_path(run_dir, BREAKDOWN))


def live_breakdown_path(run_dir: Path) -> Path:
    return Path(run_dir) / LIVE / BREAKDOWN


def rank_memory_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LIVE / RANK_MEMORY.format(rank=rank)


def rank_progress_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LIVE / RANK_PROGRESS.format(rank=rank)


def rank_stacks_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LIVE / RANK_STACKS.format(rank=rank)


def loader_stacks_path(run_dir: Path, rank: int, pid) -> Path:
    """A DataLoader worker's stacks file; pid "*" globs every worker of that rank."""
    return Path(run_dir) / LIVE / LOADER_STACKS.format(rank=rank, pid=pid)


# --------------------------------------------------------------------------- launches/<timestamp>/
def launches_path(run_dir: Path) -> Path:
    return Path(run_dir) / LAUNCHES


def lock_heartbeat(run_dir: Path) -> Optional[tuple[str, float]]:
    """(launch id, heartbeat time) of RUN_DIR's lock, or None when there is none or it is unreadable."""
    try:
        held = read_json(Path(run_dir) / LOCK)
        return str(held["launch"]), float(held["heartbeat"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
