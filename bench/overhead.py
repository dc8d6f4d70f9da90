"""Side-by-side overhead benchmarks, 2 processes on CPU (gloo), measured alternately in one run.

    python bench/overhead.py framework   # trainkit run vs a plain hand-written torchrun DDP script
    python bench/overhead.py framework --monitors  # ... and trainkit with every monitor but the profiler
    python bench/overhead.py tracking    # MLflow tracking off vs SQLite vs a real `mlflow server`
    python bench/overhead.py monitors    # no monitors vs all built-in monitors except the profiler
    python bench/overhead.py monitors --each   # ... and each monitor alone
    python bench/overhead.py framework --compile   # both sides compiled: DDP(torch.compile(m)) / performance.compile
    python bench/overhead.py compile     # trainkit, a conv model (small_cnn): eager vs performance.compile
    python bench/overhead.py compiled-gap   # where the compiled pair's gap is not: the launcher, DDP's buckets
    python bench/overhead.py log-every --steps 440 --repeats 7   # ONE process, tracked: log_every 10 vs 1
    python bench/overhead.py log-every --steps 440 --repeats 3 --before   # ... and log_every 1 with torch's
                                         # default intra-op pool (what world size 1 used before runtime/threads.py)

Each configuration trains the same MLP on the same synthetic data for --steps steps, --repeats times,
alternating configurations so machine noise hits them alike. Reported per configuration: the median
steady-state seconds per step (wall time from step --warmup to the last step, divided by the steps)
and the time from the command to the first finished step; then ratios against the first one: the
ratio of the medians, and the median (min-max) of the per-repeat ratios (each repeat runs every
configuration back to back, so a pair shares the machine's state).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from trainkit.processes import WORKER
from trainkit.run_dir import metrics_path, read_metrics, read_summary

REPO = Path(__file__).resolve().parent.parent
PLAIN = Path(__file__).resolve().parent / "plain_ddp.py"
MODEL = {"in_features": 3072, "hidden": 2048, "depth": 3, "num_classes": 10}
BATCH = 32


ALL_MONITORS = ("system", "gpu", "throughput", "breakdown", "memory", "stragglers")
CONV = {"name": "small_cnn", "args": {"num_classes": 10, "width": 32}}
# the one-process case: a digits-sized MLP (8x8 inputs, 26k parameters), tracked to SQLite
DIGITS = {"model": {"name": "mlp", "args": {"in_features": 64, "hidden": 128, "depth": 2, "num_classes": 10}},
          "data": {"name": "synthetic", "num_samples": 1797, "shape": [1, 8, 8], "num_classes": 10,
                   "batch_size": 64, "shuffle": True}}


def recipe(folder: Path, name: str, steps: int, log_every: int, **extra) -> Path:
    data = {
        "name": name, "seed": 0,
        "model": {"name": "mlp", "args": MODEL},
        "data": {"name": "synthetic", "num_samples": 8192, "shape": [3, 32, 32], "num_classes": 10,
                 "batch_size": BATCH, "shuffle": True},
        "strategy": {"name": "ddp"}, "precision": "fp32",
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "trainer": {"max_steps": steps, "log_every": log_every, "checkpoint": {"every": None, "keep": 1},
                    "resume": "never"},
        "launch": {"nproc_per_node": 2, "run_dir": str(folder / "runs")},
        "tracking": {"enabled": False},
    }
    for key, value in extra.items():
        data[key] = value
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_trainkit(folder: Path, path: Path, name: str, warmup: int, env: dict) -> tuple[float, float]:
    start = time.time()
    res = subprocess.run([sys.executable, "-m", "trainkit.cli", "run", str(path)], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        sys.exit(f"trainkit run failed:\n{res.stdout}\n{res.stderr}")
    return run_timing(folder / "runs" / name, warmup, start)


def run_timing(run_dir: Path, warmup: int, start: float) -> tuple[float, float]:
    """(steady-state s/step from step `warmup` on, command to first step) of a finished trainkit run,
    from its metrics.jsonl and summary.json; the metrics file is removed so the next repeat starts clean."""
    rows = read_metrics(run_dir)
    by_step = {r["step"]: r["time"] for r in rows}
    first, last = min(s for s in by_step if s >= warmup), max(by_step)
    summary = read_summary(run_dir)
    metrics_path(run_dir).unlink()
    return (by_step[last] - by_step[first]) / (last - first), summary["first_step_at"] - start


def run_worker_under_torchrun(folder: Path, name: str, warmup: int, env: dict) -> tuple[float, float]:
    """trainkit's training worker on a run dir `trainkit run` prepared, launched by plain torchrun
    instead of `trainkit run` (its launcher, lock, agent settings and log redirection left out)."""
    run_dir = folder / "runs" / name
    env = {k: v for k, v in env.items() if k != "TRAINKIT_LAUNCHER_PID"}
    start = time.time()
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", WORKER, str(run_dir)], cwd=folder, env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        sys.exit(f"worker under torchrun failed:\n{res.stdout}\n{res.stderr}")
    return run_timing(run_dir, warmup, start)


def run_plain(folder: Path, steps: int, warmup: int, log_every: int, env: dict,
              compiled: bool = False, extra: tuple = ()) -> tuple[float, float]:
    out = folder / "plain.json"
    start = time.time()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(PLAIN),
           "--steps", str(steps), "--batch", str(BATCH), "--log-every", str(log_every), "--out", str(out),
           "--model", json.dumps(MODEL)] + (["--compile"] if compiled else []) + list(extra)
    res = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        sys.exit(f"plain script failed:\n{res.stdout}\n{res.stderr}")
    times = {int(k): v for k, v in json.loads(out.read_text())["times"].items()}
    first, last = min(s for s in times if s >= warmup), max(times)
    return (times[last] - times[first]) / (last - first), json.loads(out.read_text())["first_step_at"] - start


def start_server(folder: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{folder}/server.db", "--default-artifact-root", str(folder / "art"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    for _ in range(180):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    sys.exit("mlflow server did not start")


def one_process_logging(folder: Path, steps: int, warmup: int, env: dict, before: bool) -> dict:
    """World size 1 runs in the launcher's process beside its MLflow delivery thread: log_every 10
    against 1 (docs/benchmarks.md, "One process: log_every 1 vs 10"), OMP_NUM_THREADS unset as a user
    runs it; with `before`, also log_every 1 with torch's default pool, the size runtime/threads.py
    reduces it from."""
    env = {k: v for k, v in env.items() if k != "OMP_NUM_THREADS"}
    uri = f"sqlite:///{folder}/mlflow.db"

    def one(name: str, log_every: int, run_env: dict):
        path = recipe(folder, name, steps, log_every, **DIGITS, tracking={"experiment": "bench", "uri": uri},
                      launch={"nproc_per_node": 1, "run_dir": str(folder / "runs")})
        return lambda: run_trainkit(folder, path, name, warmup, run_env)

    configs = {"log_every 10": one("le10", 10, env), "log_every 1": one("le1", 1, env)}
    if before:  # OMP_NUM_THREADS set is kept by trainkit: set to torch's default pool, it undoes the fix
        pool = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()
        configs[f"log_every 1, torch's default pool ({pool}, before)"] = one(
            "le1-before", 1, {**env, "OMP_NUM_THREADS": pool})
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compare", choices=["framework", "tracking", "monitors", "compile", "compiled-gap",
                                            "log-every"])
    parser.add_argument("--before", action="store_true",
                        help="log-every: also log_every 1 with torch's default intra-op pool (OMP_NUM_THREADS unset "
                             "before runtime/threads.py; set here to that pool's size)")
    parser.add_argument("--compile", action="store_true", help="framework: both sides compiled")
    parser.add_argument("--each", action="store_true", help="monitors: also each monitor alone")
    parser.add_argument("--monitors", action="store_true",
                        help="framework: also trainkit with every monitor but the profiler")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="trainkit-bench-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(folder))
    env.pop("MLFLOW_TRACKING_URI", None)
    server = None
    steps, le = args.steps, args.log_every

    def tk(name, **extra):
        path = recipe(folder, name, steps, le, **extra)
        return lambda: run_trainkit(folder, path, name, args.warmup, env)

    if args.compare == "framework":
        c = args.compile
        configs = {f"plain torchrun DDP script{' (compiled)' if c else ''}":
                   lambda: run_plain(folder, steps, args.warmup, le, env, compiled=c),
                   f"trainkit run{' (performance.compile)' if c else ''}":
                   tk("framework", **({"performance": {"compile": True}} if c else {}))}
        if args.monitors:  # the goal holds "with and without monitors": trainkit + monitors vs plain
            configs[f"trainkit run + {'+'.join(ALL_MONITORS)}"] = tk(
                "framework-mon", monitors=list(ALL_MONITORS), **({"performance": {"compile": True}} if c else {}))
        # trainkit keeps freed host memory on the CPU (performance.host_allocator: auto); the plain script
        # with the same malloc settings shows what the framework itself costs, allocator equal
        configs[f"plain script{' (compiled)' if c else ''}, host allocator retain"] = lambda: run_plain(
            folder, steps, args.warmup, le, env, compiled=c, extra=("--host-allocator", "retain"))
    elif args.compare == "compiled-gap":  # all compiled; the first config is the plain script, as in framework
        configs = {"plain torchrun DDP script (compiled)": lambda: run_plain(folder, steps, args.warmup, le, env, True),
                   "trainkit run (performance.compile)": tk("gap", performance={"compile": True}),
                   # after `trainkit run` made the run dir: is the gap in the launcher or in the worker?
                   "trainkit's worker under plain torchrun": lambda: run_worker_under_torchrun(
                       folder, "gap", args.warmup, env),
                   # trainkit passes bucket_cap_mb=25 explicitly, which drops DDP's 1 MiB first bucket
                   "plain script, bucket_cap_mb=25 explicit": lambda: run_plain(
                       folder, steps, args.warmup, le, env, True, ("--bucket-cap-mb", "25"))}
    elif args.compare == "log-every":
        configs = one_process_logging(folder, steps, args.warmup, env, args.before)
    elif args.compare == "compile":
        configs = {"small_cnn eager": tk("eager", model=CONV),
                   "small_cnn performance.compile": tk("compiled", model=CONV, performance={"compile": True})}
    elif args.compare == "tracking":
        server, uri = start_server(folder)
        configs = {"tracking off": tk("off"),
                   "tracking -> SQLite": tk("sqlite", tracking={"experiment": "bench", "uri": f"sqlite:///{folder}/mlflow.db"}),
                   "tracking -> mlflow server": tk("server", tracking={"experiment": "bench", "uri": uri})}
    else:
        configs = {"no monitors": tk("plainmon"),
                   "+".join(ALL_MONITORS): tk("allmon", monitors=list(ALL_MONITORS))}
        if args.each:  # which monitor costs what: each one alone, in the same alternation
            configs.update({f"{m} alone": tk(f"only-{m}", monitors=[m]) for m in ALL_MONITORS})
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in configs}
    try:
        for _ in range(args.repeats):
            for name, fn in configs.items():
                results[name].append(fn())
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
    base = statistics.median(s for s, _ in results[next(iter(results))])
    base_first = statistics.median(f for _, f in results[next(iter(results))])
    model = f"{CONV['name']} {CONV['args']}" if args.compare == "compile" else f"MLP {MODEL}"
    if args.compare == "log-every":
        print(f"log-every: {steps} steps, steady state from step {args.warmup}, {args.repeats} alternating repeats, "
              f"1 process (in the launcher's), tracked to SQLite, MLP {DIGITS['model']['args']}, batch 64")
    else:
        print(f"{args.compare}: {steps} steps, steady state from step {args.warmup}, log_every {le}, "
              f"{args.repeats} alternating repeats, 2 processes (gloo, CPU), {model}, batch {BATCH}/rank")
    print(f"{'configuration':<52} {'s/step (median)':>16} {'ratio':>7} {'per-repeat ratio: median (min-max)':>36} "
          f"{'to 1st step s':>14} {'ratio':>7}")
    base_values = results[next(iter(results))]
    for name, values in results.items():
        step = statistics.median(s for s, _ in values)
        first = statistics.median(f for _, f in values)
        pairs = [s / b for (s, _), (b, _) in zip(values, base_values)]
        spread = f"{statistics.median(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f})"
        print(f"{name:<52} {step:>16.4f} {step / base:>7.3f} {spread:>36} {first:>14.2f} {first / base_first:>7.2f}")
    equal = next((n for n in results if n.endswith("host allocator retain")), None)
    if equal is not None:  # the framework's own cost: trainkit against the plain script, allocator equal
        print(f"\nper-repeat ratio against '{equal}' (same malloc settings on both sides):")
        for name, values in results.items():
            if name.startswith("trainkit"):
                pairs = [s / b for (s, _), (b, _) in zip(values, results[equal])]
                print(f"  {name:<50} {statistics.median(pairs):.3f} ({min(pairs):.3f}-{max(pairs):.3f})")


if __name__ == "__main__":
    main()
