"""`trainkit bench scaling`: run one recipe (or a hand-written torchrun script) at several world
sizes and report weak scaling -- the batch per device stays fixed, so N processes do N times the
work of one and ideal throughput is N times one process's.

Throughput is the global batch over the median step time of the steady-state steps (the first
`warmup` steps -- start-up, compilation, allocator warm-up -- are left out). Writes scaling.json,
scaling.md (a table: samples/s, speedup, efficiency) and scaling.png (measured speedup against
ideal, and a reference series when given) to the output folder, and logs them to MLflow.

A script gets `--steps S --log-every 1 --batch B --out FILE` and writes `{"times": {step: unix
time}}` to FILE (bench/plain_ddp.py follows this contract).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ..processes import CLI
from ..run_dir import read_metrics


@dataclass
class Point:
    nproc: int
    step_time_s: float  # median of the steady-state steps
    spread_s: tuple[float, float]  # min, max of those steps
    global_batch: int
    samples_per_s: float = 0.0
    speedup: float = 0.0
    efficiency: float = 0.0


class ScalingError(RuntimeError):
    pass


def step_times(times: dict, warmup: int) -> list[float]:
    """Durations of the steps after `warmup` from {step: completion time}."""
    steps = sorted((int(k), float(v)) for k, v in times.items())
    durations = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(steps, steps[1:]) if a[0] >= warmup]
    if not durations:
        raise ScalingError(f"no steady-state steps: {len(steps)} steps timed, warm-up {warmup}; use more --steps")
    return durations


def finish(points: list[Point]) -> list[Point]:
    base = next((p for p in points if p.nproc == min(q.nproc for q in points)), None)
    for p in points:
        p.samples_per_s = p.global_batch / p.step_time_s
        p.speedup = p.samples_per_s / base.samples_per_s * base.nproc if base else 0.0
        p.efficiency = p.speedup / p.nproc
    return points


def _run(cmd: list[str], cwd: Path, timeout: float) -> None:
    env = dict(os.environ)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise ScalingError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")


def measure_recipe(recipe: Path, overrides: list[str], nproc: int, steps: int, batch: int, work: Path,
                   warmup: int, timeout: float) -> Point:
    """`trainkit run` with nproc processes on one node, every step logged; times from metrics.jsonl."""
    name = f"scaling-n{nproc}"
    _run([sys.executable, "-m", CLI, "run", str(recipe), *overrides, f"name={name}",
          f"launch.nproc_per_node={nproc}", "launch.nnodes=1", f"trainer.max_steps={steps}", "trainer.log_every=1",
          "trainer.eval_every=null", "trainer.resume=never", f"launch.run_dir={work}", "tracking.enabled=false"],
         cwd=work, timeout=timeout)
    rows = read_metrics(work / name)
    durations = step_times({r["step"]: r["time"] for r in rows}, warmup)
    return Point(nproc, statistics.median(durations), (min(durations), max(durations)), batch * nproc)


def measure_script(script: Path, nproc: int, steps: int, batch: int, work: Path, warmup: int,
                   timeout: float) -> Point:
    out = work / f"script-n{nproc}.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
          "--steps", str(steps), "--log-every", "1", "--batch", str(batch), "--out", str(out)],
         cwd=work, timeout=timeout)
    durations = step_times(json.loads(out.read_text())["times"], warmup)
    return Point(nproc, statistics.median(durations), (min(durations), max(durations)), batch * nproc)


def table(points: list[Point], title: str) -> str:
    lines = [f"### {title}", "", "| processes | global batch | s/step (median) | min..max | samples/s | speedup | "
             "efficiency |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for p in points:
        lines.append(f"| {p.nproc} | {p.global_batch} | {p.step_time_s:.4f} | {p.spread_s[0]:.4f}..{p.spread_s[1]:.4f} "
                     f"| {p.samples_per_s:.1f} | {p.speedup:.2f} | {p.efficiency:.0%} |")
    return "\n".join(lines) + "\n"


def plot(points: list[Point], path: Path, title: str, reference: Optional[dict[int, float]] = None,
         reference_label: str = "reference") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted({p.nproc for p in points} | set(reference or {}))
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=110)
    ax.plot(xs, xs, "--", color="grey", label="ideal (linear)")
    if reference:
        rx = sorted(reference)
        ax.plot(rx, [reference[n] for n in rx], "s-", color="tab:orange", label=reference_label)
    ax.plot([p.nproc for p in points], [p.speedup for p in points], "o-", color="tab:blue", label="measured")
    for p in points:
        ax.annotate(f"{p.speedup:.2f}", (p.nproc, p.speedup), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set_xlabel("processes (batch per process fixed)")
    ax.set_ylabel("speedup over 1 process")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_yticks(xs, [str(x) for x in xs])
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def log_to_mlflow(folder: Path, points: list[Point], *, experiment: str, uri: Optional[str], run_name: str) -> str:
    import mlflow

    if uri:
        from ..tracking import credentials

        mlflow.set_tracking_uri(credentials.use(uri))  # only this server's credentials go to it
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=run_name) as run:
        for p in points:
            mlflow.log_metrics({"samples_per_s": p.samples_per_s, "speedup": p.speedup, "efficiency": p.efficiency,
                                "step_time_s": p.step_time_s}, step=p.nproc)
        for name in ("scaling.json", "scaling.md", "scaling.png"):
            mlflow.log_artifact(str(folder / name), artifact_path="scaling")
        return run.info.run_id


def bench_scaling(*, recipe: Optional[Path], script: Optional[Path], nprocs: list[int], steps: int, warmup: int,
                  batch: Optional[int], out: Optional[Path], overrides: list[str], reference: dict[int, float],
                  reference_label: str, mlflow_log: bool, timeout: float = 600) -> tuple[Path, list[Point]]:
    """Measure each world size in turn; write and log the results. Returns (folder, points)."""
    from ..recipe import resolve

    experiment, uri, title = "trainkit-bench", None, ""
    if recipe is not None:
        r = resolve(recipe, overrides).recipe
        batch = r.data.batch_size * r.trainer.grad_accum_steps
        experiment, uri = r.tracking.experiment, r.tracking.uri
        title = f"{r.name}: weak scaling, {r.model.name}, batch {batch}/process"
        out = out or Path(r.launch.run_dir) / f"{r.name}-scaling"
    else:
        batch = batch or 32
        title = f"{script.name}: weak scaling, batch {batch}/process"
        out = out or Path("runs") / f"{script.stem}-scaling"
    out.mkdir(parents=True, exist_ok=True)
    points = []
    with tempfile.TemporaryDirectory(prefix="trainkit-scaling-") as tmp:
        for n in nprocs:
            work = Path(tmp) / f"n{n}"
            work.mkdir()
            if recipe is not None:
                points.append(measure_recipe(recipe.resolve(), overrides, n, steps, batch, work, warmup, timeout))
            else:
                points.append(measure_script(script.resolve(), n, steps, batch, work, warmup, timeout))
            print(f"trainkit: bench scaling: {n} process(es): {points[-1].step_time_s:.4f} s/step (median)", flush=True)
    finish(points)
    (out / "scaling.json").write_text(json.dumps({"title": title, "steps": steps, "warmup": warmup,
                                                  "points": [asdict(p) for p in points],
                                                  "reference": {"label": reference_label, "speedup": reference}},
                                                 indent=2) + "\n")
    (out / "scaling.md").write_text(table(points, title))
    plot(points, out / "scaling.png", title, reference, reference_label)
    if mlflow_log:
        run_id = log_to_mlflow(out, points, experiment=experiment, uri=uri, run_name=out.name)
        print(f"trainkit: bench scaling: logged to MLflow run {run_id}", flush=True)
    return out, points


def parse_reference(text: Optional[str]) -> dict[int, float]:
    """'1:1,2:1.8,4:3.5' -> {1: 1.0, 2: 1.8, 4: 3.5}."""
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        n, _, s = part.partition(":")
        out[int(n)] = float(s)
    return out
