"""The `parallel:` mesh at run time (issue 30): HSDP, FSDP x TP and TP train the tiny transformer (and
TP transformers' Llama) to the losses of one process, a checkpoint written on one mesh resumes on
another at the exact data position, each exports to the plain model, and the replica check sees a
drifted HSDP replica.

Every run here reads the same global batch of 4 sequences per step, so each is held to a one-process
reference of its model. The runs are trained by `trainkit.runtime.cell_runner` in three launches for
the whole module: one of 4 ranks (every 4-rank mesh, one after the other), one of 2 ranks beside it,
then one plain process (the references, and the resumes of the 4- and 2-rank checkpoints on one rank).

The 4-rank launch also trains the compatibility matrix's 2-D cells (HSDP and FSDP x TP, 2 x 2: the
grid's own recipes, `CELLS`) and resumes each from its step-2 checkpoint; held to their references
by the grid's checks, they are what records those cells as verified (TRAINKIT_GRID_RECORD=1), the
verification the doctor and the bottleneck advice ask before they offer HSDP or FSDP x TP.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from grid_runs import RUNNER, Outcome, _write_corpus, problems_of, record
from run_helpers import env_for, free_port
from trainkit.recipe.compatibility.grid import Cell, merge

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


STEPS = 3  # checkpoints at steps 2 and 3: a resume on another mesh starts from step 2
RTOL = 1e-5  # fp32: the same arithmetic split differently over the ranks (measured: see docs/strategies.md)
LAUNCH_TIMEOUT_S = 400

BASE = {
    "seed": 5,
    "model": {"name": "transformer", "init": "seeded",
              "args": {"vocab_size": 320, "dim": 32, "layers": 2, "heads": 2, "seq_len": 16}},
    "data": {"name": "text", "files": ["lm/train.txt"], "eval_files": ["lm/eval.txt"],
             "tokenizer": "lm/tokenizer.json", "generate": {"documents": 200, "seed": 0, "vocab_size": 300},
             "seq_len": 16, "batch_size": 4, "shuffle": True},
    "task": {"name": "causal_lm"},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "trainer": {"max_steps": STEPS, "log_every": 1, "grad_clip": 0.5, "eval_every": STEPS, "eval_steps": 2,
                "checkpoint": {"every": 2, "keep": 2}},
    "launch": {"timeout_s": 60},
    "tracking": {"enabled": False},
}


def _recipe(ranks: int, parallel: dict | None, batch_size: int, **extra) -> dict:
    """BASE on `ranks` ranks with the `parallel:` block given; `batch_size` per data-parallel rank."""
    out = json.loads(json.dumps(BASE))
    out["launch"]["nproc_per_node"] = ranks
    out["data"]["batch_size"] = batch_size
    out["strategy"] = {"name": "fsdp"} if parallel is not None else {"name": "ddp"}
    if parallel is not None:
        out["parallel"] = parallel
    for key, value in extra.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


# transformers' Llama: its plan leaves the norms whole, so its gradients live on two meshes (clipping)
HF_LLAMA = {"name": "hf_causal_lm", "init": "constructor", "args": {"config": {
    "model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 2, "max_position_embeddings": 32, "tie_word_embeddings": False}}}

# name -> recipe; the runs of one launch train in this order (the 4-rank ones with the `breakdown`
# monitor: communication per mesh dimension, test_communication_is_timed_per_mesh_dimension)
RUNS_4 = {
    "hsdp-2x2": _recipe(4, {"dp_replicate": 2, "dp_shard": 2}, 1, monitors=["breakdown"]),
    "fsdp-tp-2x2": _recipe(4, {"dp_shard": 2, "tp": 2}, 2, monitors=["breakdown"]),
}
RUNS_2 = {"tp-2": _recipe(2, {"dp_shard": 1, "tp": 2}, 4),
          "hf-llama-tp-2": _recipe(2, {"dp_shard": 1, "tp": 2}, 4, model=HF_LLAMA)}
RUNS_1 = {"reference": _recipe(1, None, 4), "hf-llama-reference": _recipe(1, None, 4, model=HF_LLAMA)}
REFERENCE = {"hf-llama-tp-2": "hf-llama-reference"}  # the one-process run each is held to; else "reference"
# resumed on another mesh: name -> (the run whose step-2 checkpoint it starts from, its recipe)
RESHARDS = {
    "hsdp-2x2-to-fsdp-4": ("hsdp-2x2", _recipe(4, {"dp_shard": 4}, 1)),
    "tp-2-to-1": ("tp-2", _recipe(1, {"tp": 1}, 4)),
    "hsdp-2x2-to-1": ("hsdp-2x2", _recipe(1, {"tp": 1}, 4)),  # 4 ranks -> 1, data-parallel 4 -> 1
}

# the matrix's 2-D cells, trained as the grid trains a cell (its recipe, its one-process reference)
CELLS = {"cell-hsdp-2x2": Cell("fsdp", "transformer", "fp32", "none", "seeded", "dp_replicate-dp_shard"),
         "cell-fsdp-tp-2x2": Cell("fsdp", "transformer", "fp32", "none", "seeded", "dp_shard-tp"),
         # LoRA adapters on a transformers Llama under HSDP (the Hugging Face family last in the launch)
         "cell-hsdp-2x2-lora": Cell("fsdp", "hf-llama", "fp32", "lora", "constructor", "dp_replicate-dp_shard")}


def _cell_runs(folder: Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """({name: recipe} of the 4-rank launch: each cell, then the cell resumed from its step-2
    checkpoint, as the cell runner's resume check; {name: recipe} of the one process: the references)."""
    four, one = {}, {}
    for name, cell in CELLS.items():
        assert cell.world == 4, cell
        step2 = folder / name / "checkpoints" / "step-00000002"
        four[name] = cell.recipe()
        four[f"{name}-resumed"] = merge(cell.recipe(), {"trainer": {"resume": str(step2)}})
        one[f"{name}-reference"] = cell.reference()[0]
    return four, one


def _write_run(folder: Path, name: str, recipe: dict) -> Path:
    run_dir = folder / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump({**recipe, "name": name}, sort_keys=False))
    return run_dir


def _launch(folder: Path, ranks: int, run_dirs: list[Path], device_env: dict) -> None:
    """Train `run_dirs` in one launch (checkpoints kept: the reshard runs resume from them)."""
    spec = folder / f"cells-{ranks}.json"
    spec.write_text(json.dumps({"run_dirs": [str(p) for p in run_dirs], "resume": False, "keep_checkpoints": True,
                                "reports": True}))  # reports/: what `trainkit report` reads
    head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--master_port", str(free_port()), "-m"] if ranks > 1 else [sys.executable, "-m"]
    with open(folder / f"cells-{ranks}.log", "w") as log:
        proc = subprocess.Popen([*head, RUNNER, str(spec)], cwd=folder, env=env_for(folder, **device_env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def train_mesh_runs(folder: Path, *, device_env: dict, side_by_side: bool) -> None:
    """Train every run of this module under `folder`: the 4-rank launch (beside the 2-rank one when
    `side_by_side`: on the CPU they share the cores; on GPUs each rank needs its own), the 2-rank one,
    then the one process (it resumes checkpoints of both). The GPU tier calls this too."""
    _write_corpus(folder)
    launches = {4: dict(RUNS_4), 2: dict(RUNS_2), 1: dict(RUNS_1)}
    cells_four, cells_one = _cell_runs(folder)
    for name, (source, recipe) in RESHARDS.items():
        step2 = folder / source / "checkpoints" / "step-00000002"
        ranks = recipe["launch"]["nproc_per_node"]
        launches[ranks][name] = {**recipe, "trainer": {**recipe["trainer"], "resume": str(step2)}}
    launches[4].update(cells_four)
    launches[1].update(cells_one)
    dirs = {ranks: [_write_run(folder, name, r) for name, r in runs.items()] for ranks, runs in launches.items()}
    four = threading.Thread(target=_launch, args=(folder, 4, dirs[4], device_env))
    four.start()
    if not side_by_side:
        four.join()
    _launch(folder, 2, dirs[2], device_env)
    four.join()  # the one process resumes checkpoints of both
    _launch(folder, 1, dirs[1], device_env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run of this module trained on the CPU (gloo); the folder holding their run directories."""
    folder = tmp_path_factory.mktemp("mesh")
    train_mesh_runs(folder, device_env={"CUDA_VISIBLE_DEVICES": ""}, side_by_side=True)
    return folder


def _result(folder: Path, name: str) -> dict:
    path = folder / name / "cell-result.json"
    if not path.is_file():
        logs = "\n".join(p.read_text()[-4000:] for p in sorted(folder.glob("cells-*.log")))
        raise AssertionError(f"{name}: no result (its launch ended before it)\n{logs}")
    result = json.loads(path.read_text())
    assert "error" not in result and "refused" not in result, f"{name}: {result}"
    return result


def _losses(folder: Path, name: str) -> dict[int, float]:
    return {int(k): v for k, v in _result(folder, name)["losses"].items()}


def _metrics(folder: Path, name: str) -> dict[int, dict]:
    """metrics.jsonl's row of each step."""
    rows = [json.loads(line) for line in (folder / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "step" in r}


def _assert_close(got: dict[int, float], want: dict[int, float], what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: steps {sorted(got)} != {sorted(want)}"
    for step in want:
        off = abs(got[step] - want[step]) / abs(want[step])
        assert math.isfinite(got[step]) and off <= RTOL, (
            f"{what}: {got[step]} at step {step} differs from the one-process {want[step]} by {off:.2e}")


@pytest.mark.parametrize("name", [*RUNS_4, *RUNS_2])
def test_mesh_trains_like_one_process(runs, name):
    check_trains_like_one_process(runs, name)


def check_trains_like_one_process(runs: Path, name: str) -> None:
    """HSDP 2x2, FSDP x TP 2x2 and TP 2 (the transformer and transformers' Llama): every step's loss and clipped gradient norm (grad_clip 0.5
    acts on every step), and the evaluation, equal one process's; the evaluation counts each token
    once (a tensor-parallel group's ranks read the same batch)."""
    one = REFERENCE.get(name, "reference")
    reference, got = _metrics(runs, one), _metrics(runs, name)
    _assert_close(_losses(runs, name), _losses(runs, one), name)
    for key in ("grad_norm", "eval_loss"):
        _assert_close({s: r[key] for s, r in got.items() if key in r},
                      {s: r[key] for s, r in reference.items() if key in r}, f"{name} {key}")
    assert got[STEPS]["eval_tokens"] == reference[STEPS]["eval_tokens"], name


# how many pieces each rank's share of a weight is: dp_shard x tp (HSDP's replicas hold the same pieces)
PIECES = {"hsdp-2x2": 2, "fsdp-tp-2x2": 4, "tp-2": 2, "hsdp-2x2-to-fsdp-4": 4, "tp-2-to-1": 1, "hsdp-2x2-to-1": 1,
          "hf-llama-tp-2": 2}
QUERY_WEIGHT = {"hf-llama-tp-2": "model.model.model.layers.0.self_attn.q_proj.weight"}


@pytest.mark.parametrize("name", list(PIECES))
def test_each_rank_holds_its_share_of_the_mesh(runs, name):
    check_share_of_each_rank(runs, name)


def check_share_of_each_rank(runs: Path, name: str) -> None:
    """The sharded checkpoint records the pieces the ranks held: a projection weight in dp_shard x tp
    pieces (so HSDP shards within a replica group only, and tensor parallel really split the layer)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = runs / name / "checkpoints" / f"step-{STEPS:08d}"
    key = QUERY_WEIGHT.get(name, "model.layers.0.attention.wq.weight")
    chunks = FileSystemReader(str(folder)).read_metadata().state_dict_metadata[key].chunks
    assert len(chunks) == PIECES[name], f"{name}: {[tuple(c.sizes) for c in chunks]}"


@pytest.mark.parametrize("name", list(RESHARDS))
def test_checkpoint_resumes_on_another_mesh(runs, name):
    check_resumes_on_another_mesh(runs, name)


def check_resumes_on_another_mesh(runs: Path, name: str) -> None:
    """A step-2 checkpoint of one mesh, loaded on another, redoes step 3 with the same batch and the
    same model: its loss is the original run's and one process's step 3."""
    source = RESHARDS[name][0]
    losses = _losses(runs, name)
    assert sorted(losses) == [STEPS], f"{name} trained steps {sorted(losses)}: it did not resume from step 2"
    _assert_close(losses, {STEPS: _losses(runs, source)[STEPS]}, f"{name} against {source}")
    _assert_close(losses, {STEPS: _losses(runs, "reference")[STEPS]}, f"{name} against one process")


@pytest.mark.parametrize("name", [*RUNS_4, *RUNS_2, *RESHARDS])
def test_export_consolidates_the_plain_model(runs, name):
    check_export(runs, name)


def check_export(runs: Path, name: str) -> None:
    """`trainkit export` of an HSDP / TP / resharded checkpoint: the plain transformer's state_dict,
    loaded strict, holding the one-process run's final weights (each tensor within RTOL of its norm:
    AdamW's first steps divide by tiny second moments, so single elements say little)."""
    from trainkit.recipe import resolve
    from trainkit.runtime.export import consolidated_state_dict
    from trainkit.runtime.model import build_model

    _, state = consolidated_state_dict(runs / name / "checkpoints" / f"step-{STEPS:08d}")
    model = build_model(resolve(runs / name / "recipe.yaml").recipe.model)
    model.load_state_dict(state, strict=True)
    one = REFERENCE.get(name, "reference")
    _, reference = consolidated_state_dict(runs / one / "checkpoints" / f"step-{STEPS:08d}")
    for key, want in reference.items():
        off = ((state[key].double() - want.double()).norm() / want.double().norm()).item()
        assert off <= RTOL, f"{name}: {key} differs from one process's by {off:.2e} of its norm"


def test_communication_is_timed_per_mesh_dimension(runs):
    check_communication_per_dimension(runs)


def _mesh_comm(runs: Path, name: str) -> list[dict]:
    """Every rank's communication per mesh dimension, per step, as the run's evidence holds it."""
    return json.loads((runs / name / "reports" / "breakdown.json").read_text())["mesh_comm"]


def check_communication_per_dimension(runs: Path) -> None:
    """The `breakdown` monitor times each mesh dimension's collectives on every rank: FSDP x TP 2x2 has
    its tensor-parallel layers' collectives on "tp" and FSDP's all-gathers and reduce-scatters on
    "dp_shard"; HSDP 2x2 has "dp_shard" and the replicas' all-reduce on "dp_replicate", and nothing on
    "tp" (it has no tensor parallel): the figures follow the mesh. They are logged at each log step,
    and `trainkit report` shows them per dimension and names the costliest. DDP's gradient columns
    stay unmeasured under FSDP (they read 0 ms before)."""
    from run_helpers import trainkit

    fsdp_tp, hsdp = _mesh_comm(runs, "fsdp-tp-2x2"), _mesh_comm(runs, "hsdp-2x2")
    phases = json.loads((runs / "fsdp-tp-2x2" / "reports" / "breakdown.json").read_text())["per_rank"]
    assert all("comm" not in r for r in phases), phases  # DDP's gradient timer has nothing to time: not 0 ms
    assert len(fsdp_tp) == len(hsdp) == 4, (fsdp_tp, hsdp)
    for dims in fsdp_tp:
        # "dp_shard_tp": the flattened dimension over which DTensor reduces the clipped gradient norm
        for dim in ("tp", "dp_shard", "dp_shard_tp"):
            assert dims[dim]["s"] > 0 and dims[dim]["bytes"] > 0 and dims[dim]["count"] >= 1, dims
        assert "dp_replicate" not in dims, dims
    for dims in hsdp:
        assert "tp" not in dims and dims["dp_shard"]["s"] > 0 and dims["dp_replicate"]["s"] > 0, dims
    logged, logged_hsdp = _metrics(runs, "fsdp-tp-2x2")[STEPS], _metrics(runs, "hsdp-2x2")[STEPS]
    assert logged["breakdown/comm_tp_s"] > 0 and logged["breakdown/comm_dp_shard_s"] > 0, logged
    assert "breakdown/comm_tp_s" not in logged_hsdp and logged_hsdp["breakdown/comm_dp_replicate_s"] > 0, logged_hsdp
    report = trainkit(runs, "report", str(runs / "fsdp-tp-2x2"), timeout=120)
    assert report.returncode == 0, report.stderr
    rows = {line.split("|")[1].strip(): line for line in report.stdout.splitlines() if line.startswith("| ")}
    assert {"tp", "dp_shard"} <= set(rows) and "dp_replicate" not in rows, report.stdout
    assert all(float(rows[dim].split("|")[2]) > 0 for dim in ("tp", "dp_shard")), report.stdout  # ms per step
    costliest = max(fsdp_tp[0], key=lambda d: sum(r[d]["s"] for r in fsdp_tp))
    assert f"communication per mesh dimension: {costliest} costs most" in report.stdout, report.stdout


@pytest.mark.parametrize("name", list(CELLS))
def test_the_2d_cell_follows_its_reference_resumes_and_exports(runs, name):
    check_cell(runs, name)


def cell_outcome(runs: Path, name: str) -> Outcome:
    """The cell's run as the grid's cell runner reports one: its losses, those after the resume from
    step 2 (steps 1-2 of the original timeline, then the resumed run's step 3), and the export of
    the final checkpoint loaded strict into the plain model; beside its reference's losses."""
    from trainkit.recipe import resolve
    from trainkit.runtime.export import consolidated_state_dict
    from trainkit.runtime.model import build_model

    result = {"losses": _losses(runs, name)}
    resumed = _losses(runs, f"{name}-resumed")
    result["resumed_from"] = "step-00000002" if sorted(resumed) == [STEPS] else f"nothing (steps {sorted(resumed)})"
    result["resumed_losses"] = {**{s: v for s, v in result["losses"].items() if s < STEPS}, **resumed}
    final = runs / f"{name}-resumed" / "checkpoints" / f"step-{STEPS:08d}"
    _, state = consolidated_state_dict(final)
    model = build_model(resolve(runs / name / "recipe.yaml").recipe.model)
    model.load_state_dict(state, strict=True)
    finite = all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())
    result["export"] = {"checkpoint": final.name, "finite": bool(finite)}
    return Outcome(CELLS[name], result, _result(runs, f"{name}-reference"))


def check_cell(runs: Path, name: str, *, recording: bool = True) -> None:
    """The compatibility matrix's 2-D cell (HSDP or FSDP x TP, 2 x 2) meets the grid's checks: each
    step's loss within the fp32 tolerance of its one-process reference, the resume from step 2 redoing
    step 3 exactly, the export loading strict; with TRAINKIT_GRID_RECORD=1 it is recorded verified on
    CPU in docs/compatibility-results.json (what the mesh advice reads)."""
    outcome = cell_outcome(runs, name)
    problems = problems_of(outcome)
    if recording and os.environ.get("TRAINKIT_GRID_RECORD") and not problems:
        record([outcome], {}, kind="cpu", device=f"CPU ({platform.machine()}), gloo, {outcome.cell.world} processes",
               command="TRAINKIT_GRID_RECORD=1 pytest tests/test_parallel_mesh_runs.py")
    assert not problems, problems


def check_all(runs: Path) -> None:
    """Every check of this module on every run (the GPU tier's one test)."""
    for name in [*RUNS_4, *RUNS_2]:
        check_trains_like_one_process(runs, name)
    for name in PIECES:
        check_share_of_each_rank(runs, name)
    for name in RESHARDS:
        check_resumes_on_another_mesh(runs, name)
    for name in [*RUNS_4, *RUNS_2, *RESHARDS]:
        check_export(runs, name)
    check_communication_per_dimension(runs)
    for name in CELLS:
        check_cell(runs, name, recording=False)  # the CPU's record is the CPU test's


def test_mfu_credits_each_tensor_parallel_rank_with_its_share(tmp_path):
    """The throughput monitor's FLOPs per micro-batch (behind tflops_per_rank and MFU) on a rank of a
    TP 2 group are half the model's: the two ranks split every layer of one data-parallel group's work."""
    from types import SimpleNamespace

    from trainkit.monitors.base import MonitorContext, RunFacts
    from trainkit.runtime.components import build_task
    from trainkit.monitors.throughput import ThroughputMonitor
    from trainkit.recipe import resolve

    path = _write_run(tmp_path, "mfu", {**_recipe(2, {"dp_shard": 1, "tp": 2}, 4),
                                        "monitors": [{"name": "throughput"}]}) / "recipe.yaml"
    recipe = resolve(path).recipe

    def flops(ranks_per_batch: int) -> float:
        strategy = SimpleNamespace(splits_model=False, ranks_per_batch=ranks_per_batch, data_parallel_size=1)
        ctx = MonitorContext(rank=0, local_rank=0, world_size=2, node_rank=0, hostname="h", device=torch.device("cpu"),
                             run_dir=tmp_path, run=RunFacts.of(recipe, build_task(recipe, torch.device("meta"))),
                             strategy=strategy, model=None)
        monitor = ThroughputMonitor(recipe.monitors[0], ctx)
        monitor.on_run_start()
        return ctx.facts["flops_per_microbatch"]

    assert flops(2) == pytest.approx(flops(1) / 2)


def test_hsdp_replica_check_sees_a_replica_that_drifted(tmp_path):
    """The end-of-run replica check under HSDP 2x2 (`trainkit run`): rank 1 alone moves its shard of
    the first weight after the last step; the ranks of its replica (0, 1) agree with each other and
    differ from the other replica's (2, 3), and the run warns. (Every rank's digest used to name
    every rank's shards, so a drifted HSDP replica went unseen.)"""
    from run_helpers import summary, trainkit, write_recipe
    from strategy_runs import SEEDED_MLP

    path = write_recipe(tmp_path, "hsdp", SEEDED_MLP, strategy={"name": "fsdp", "wrap": ["Linear"]},
                        parallel={"dp_replicate": 2, "dp_shard": 2}, launch={"nproc_per_node": 4},
                        trainer={"max_steps": 2, "checkpoint": {"every": 100}})
    result = trainkit(tmp_path, "run", str(path), CUDA_VISIBLE_DEVICES="",
                      TRAINKIT_FAULT_DIVERGE="rank=1,step=2,what=param")
    assert result.returncode == 0, result.output[-4000:]
    digests = summary(tmp_path / "runs" / "hsdp")["replica_digests"]
    assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2], digests
    assert "model replicas differ across ranks" in result.stderr
