"""GPU tier (`pytest -m gpu`): the compatibility grid on CUDA with nccl, the GPU-only cases of
issue 26, and what the monitors measure on real CUDA devices. Every test skips cleanly without CUDA
(and the 2-rank ones with fewer than 2 GPUs); run them on a GPU node with

    pytest -m gpu tests/test_gpu.py          # TRAINKIT_GRID_RECORD=1 also records the grid's results
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from grid_runs import problems_of, record, run_alone, run_grid
from run_helpers import mlp_recipe, trainkit, write_recipe
from trainkit.recipe.compatibility import declared_cells, statuses

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

WIDE = {"name": "mlp", "args": {"in_features": 1024, "hidden": 4096, "depth": 6, "num_classes": 10}}
DATA = {"batch_size": 64, "num_samples": 4096, "shape": [1024], "num_classes": 10}


def metrics(tmp_path, name) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]


@needs_cuda
@needs_two
def test_nccl_ddp_comm_time_is_positive_and_exposed_at_most_in_flight(tmp_path):
    """Guards device-timed communication under nccl: comm measured from CUDA events is > 0 (a host
    timestamp in the future callback measured ~0) and exposed comm never exceeds in-flight comm."""
    recipe = mlp_recipe(tmp_path, "nccl", model=WIDE, data=DATA, strategy={"name": "ddp", "bucket_cap_mb": 4},
                        launch={"backend": "nccl"}, trainer={"max_steps": 20, "log_every": 5},
                        monitors=["breakdown"])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    per_rank = json.loads((tmp_path / "runs" / "nccl" / "reports" / "breakdown.json").read_text())["per_rank"]
    assert len(per_rank) == 2
    for r in per_rank:
        assert r["comm"] > 1e-5, r
        assert 0.0 <= r["comm_exposed"] <= r["comm"] + 1e-6, r
        # DDP overlaps its 4 MiB buckets with the rest of backward: part of comm must be hidden (a
        # measurement counting every in-flight second as exposed would pass the bound above)
        assert r["comm_exposed"] < 0.9 * r["comm"], r
    rows = metrics(tmp_path, "nccl")
    assert any("breakdown/comm_exposed_s" in row for row in rows)


@needs_cuda
def test_nvml_metrics_are_sampled_between_log_steps(tmp_path):
    """Guards the gpu monitor's NVML sampler on a real GPU: utilisation, memory and their min/max
    over the interval's samples reach the metric log."""
    recipe = mlp_recipe(tmp_path, "nvml", model=WIDE, data=DATA, launch={"nproc_per_node": 1},
                        trainer={"max_steps": 30, "log_every": 10}, monitors=[{"name": "gpu", "interval_s": 0.05}])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    row = metrics(tmp_path, "nvml")[-1]
    for key in ("utilization_percent", "utilization_percent_max", "memory_used_mb"):
        assert f"gpu/rank0/{key}" in row, sorted(row)
    assert row["gpu/rank0/memory_used_mb"] > 0


def matmul_rate(dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul on this GPU: what the device reaches in practice, so its
    peak lies between this and a small multiple of it."""
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ a
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ a
    end.record()
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (start.elapsed_time(end) / 1e3)


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_mfu_is_between_0_and_1(tmp_path, precision):
    """Guards MFU's peak table on this GPU: the device name matches a peak for what runs (fp32 without
    TF32, bf16 tensor cores), so MFU is reported and is a fraction in (0, 1]; and the peak it implies
    (achieved FLOP/s / MFU, achieved counted here independently: 6 x parameters x samples per second
    for an MLP) is at least what a large matmul reaches on this GPU and less than 2.5x it -- a peak
    table off by 2x either way fails."""
    recipe = mlp_recipe(tmp_path, f"mfu{precision}", model=WIDE, data=DATA, precision=precision,
                        launch={"nproc_per_node": 1}, trainer={"max_steps": 30, "log_every": 10},
                        monitors=["throughput"])
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    row = metrics(tmp_path, f"mfu{precision}")[-1]
    assert "throughput/mfu" in row, f"no peak known for {torch.cuda.get_device_name()}: {sorted(row)}"
    assert 0.0 < row["throughput/mfu"] <= 1.0
    from trainkit.models import mlp

    params = sum(p.numel() for p in mlp(**WIDE["args"]).parameters())
    achieved = 6 * params * row["throughput/samples_per_s"]
    assert achieved / 1e12 == pytest.approx(row["throughput/tflops_per_rank"], rel=0.1), row
    implied_peak = achieved / row["throughput/mfu"]
    measured = matmul_rate(torch.float32 if precision == "fp32" else torch.bfloat16)
    assert measured <= 1.05 * implied_peak < 2.5 * measured, (implied_peak / 1e12, measured / 1e12)


@needs_cuda
def test_fsdp_cpu_offload_with_a_seeded_batchnorm_model_trains_on_the_gpu(tmp_path):
    """Issue 26 (GPU only): seeded init under FSDP cpu_offload left BatchNorm buffers on the CPU
    (`to_empty(device=cpu)` after fully_shard had moved them to CUDA), and the first forward failed.
    The buffers now live on the compute device; the run trains in bf16."""
    recipe = mlp_recipe(tmp_path, "offload-bn", model={"name": "torchvision.resnet18", "args": {"num_classes": 4},
                                                       "init": "seeded"},
                        data={"name": "synthetic", "shape": [3, 32, 32], "num_classes": 4, "batch_size": 8},
                        strategy={"name": "fsdp", "cpu_offload": True}, precision="bf16",
                        launch={"nproc_per_node": 1, "backend": "nccl"}, trainer={"max_steps": 3, "log_every": 1})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert all(r["loss"] == r["loss"] for r in metrics(tmp_path, "offload-bn") if "loss" in r)


@needs_cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="float8 needs compute capability 8.9+")
def test_float8_follows_bf16_on_the_gpu(tmp_path, corpus):
    """Issue 40 item 2 on a GPU with float8 tensor cores: the built-in transformer (dim 256) with
    `performance.float8` follows the bf16 run over 40 steps within 5% of each logged loss (float8
    rounds matmul inputs to 3 mantissa bits; on the CPU the bound is 1e-2 over 6 steps) and learns."""
    from lm_runs import tiny_lm

    preset = {**tiny_lm(corpus), "precision": "bf16", "optimizer": {"name": "adamw", "lr": 1e-3},
              "model": {"name": "transformer", "args": {"vocab_size": 320, "dim": 256, "layers": 4, "heads": 4,
                                                          "seq_len": 32}, "init": "seeded"},
              "trainer": {"max_steps": 40, "log_every": 10}, "launch": {"nproc_per_node": 1}}
    runs = {}
    for name, perf in (("bf16", {}), ("float8", {"float8": True})):
        path = write_recipe(tmp_path, name, preset, performance=perf)
        result = trainkit(tmp_path, "run", str(path))
        assert result.returncode == 0, result.output[-4000:]
        runs[name] = [r["loss"] for r in metrics(tmp_path, name) if "loss" in r]
    assert "float8: 28 of 29 Linear layers" in result.output, result.output[-3000:]
    for a, b in zip(runs["float8"], runs["bf16"]):
        assert abs(a - b) <= 0.05 * abs(b), runs
    assert runs["float8"][-1] < runs["float8"][0]


@needs_cuda
def test_jpegs_decoded_on_the_gpu_match_the_loaders_and_are_faster(tmp_path):
    """Issue 40 item 4: `data.decode: device` on CUDA (nvJPEG, one batched call) gives the loader path's
    batch within JPEG decoder tolerance (the decoders' IDCT and chroma upsampling differ), and decodes
    faster than one loader process. Prints both rates for docs/benchmarks.md."""
    import time

    from trainkit.recipe.blocks import ImageFolderData
    from trainkit.runtime.data import STD, build_imagefolder
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(tmp_path / "imgs", classes=4, per_class=64, size=256, seed=0)
    made = {d: build_imagefolder(ImageFolderData(name="imagefolder", root=str(root), batch_size=64, decode=d),
                                 split="train", seed=0) for d in ("loader", "device")}
    jpegs = [i for i, (path, _) in enumerate(made["loader"].samples) if str(path).endswith(".jpg")]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    on_host = torch.stack([made["loader"][i][0] for i in jpegs])
    host_rate = len(jpegs) / (time.perf_counter() - t0)
    torch.manual_seed(0)
    batch = made["device"].collate([made["device"][i] for i in jpegs])[0]
    batch.to("cuda")  # nvJPEG's handle and the kernels, once
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    on_gpu = batch.to("cuda")
    torch.cuda.synchronize()
    gpu_rate = len(jpegs) / (time.perf_counter() - t0)
    apart = ((on_gpu.cpu() - on_host) * torch.tensor(STD).view(1, 3, 1, 1) * 255).abs()
    print(f"decode: {len(jpegs)} JPEGs 256 px -> 224 px crops; loader process (PIL + transforms) "
          f"{host_rate:.0f} images/s, device (nvJPEG + transforms) {gpu_rate:.0f} images/s; levels apart: "
          f"mean {apart.mean():.3f}, over 12: {(apart > 12).float().mean():.2%}, max {apart.max():.1f}")
    assert apart.mean() < 2.0 and (apart > 12).float().mean() < 0.01
    assert gpu_rate > host_rate


@needs_cuda
def test_a_jpeg_with_broken_scan_data_is_not_decoded_silently_on_the_gpu(tmp_path):
    """(Written without a GPU at hand.) docs/performance.md's promise for `data.decode: device`: a JPEG whose
    header and end marker read but whose scan data is broken is treated as the loader treats it -- named
    when PIL refuses it, else decoded to PIL's pixels -- not turned into other pixels by nvJPEG without a
    word (its batched call reports one status per batch; the hardware decoder of A100/H100/H200 decodes
    baseline JPEGs). A batch of good JPEGs carries the broken one."""
    import random

    from trainkit.recipe.blocks import ImageFolderData
    from trainkit.runtime.data import STD, build_imagefolder
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    root = make_imagefolder(tmp_path / "imgs", classes=1, per_class=16, size=256, seed=3)
    broken = sorted((root / "class_00").glob("*.jpg"))[0]
    data = bytearray(broken.read_bytes())
    scan = data.index(b"\xff\xda") + 20  # inside the scan, past its header; no 0xFF written: no marker made
    rng = random.Random(0)
    data[scan:scan + 400] = bytes(rng.randrange(0, 0xFF) for _ in range(400))
    broken.write_bytes(bytes(data))
    made = {d: build_imagefolder(ImageFolderData(name="imagefolder", root=str(root), val_root=str(root), batch_size=16,
                                                 decode=d, image_size=224), split="eval", seed=0)
            for d in ("loader", "device")}
    files = [str(path) for path, _ in made["device"].samples]
    jpegs = [i for i, f in enumerate(files) if f.endswith(".jpg")]
    batch = made["device"].collate([made["device"][i] for i in jpegs])[0]
    try:
        host = made["loader"][files.index(str(broken))][0]
    except Exception as refused:  # PIL refuses it: the device path must name it, not train on it
        with pytest.raises(RuntimeError, match=f"unreadable image {broken}"):
            batch.to("cuda")
        print(f"broken JPEG: PIL refused it ({refused}); the device path named it")
        return
    on_gpu = batch.to("cuda")[jpegs.index(files.index(str(broken)))].cpu()
    apart = ((on_gpu - host) * torch.tensor(STD).view(3, 1, 1) * 255).abs()
    print(f"broken JPEG: PIL decoded it; the device's pixels are {apart.mean():.2f} levels from PIL's on average")
    assert apart.mean() < 2.0, "nvJPEG decoded a broken JPEG to other pixels than PIL's, without an error"


@needs_cuda
def test_an_imagefolder_run_decoding_on_the_gpu_trains_with_pinned_loader_workers(tmp_path):
    """data.decode: device through the whole run on CUDA: workers reading bytes, the pin-memory thread
    passing the encoded batch through, nvJPEG in the step and in evaluation, bf16 and channels_last."""
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    make_imagefolder(tmp_path / "imgs", classes=4, per_class=16, size=64, seed=1)
    recipe = mlp_recipe(tmp_path, "gpu-decode", model={"name": "small_cnn", "args": {"num_classes": 4, "width": 8}},
                        data={"name": "imagefolder", "root": "imgs", "val_root": "imgs", "image_size": 48,
                              "batch_size": 16, "num_workers": 2, "pin_memory": True, "decode": "device"},
                        precision="bf16", performance={"channels_last": True}, launch={"nproc_per_node": 1},
                        optimizer={"name": "sgd", "lr": 0.02, "momentum": 0.9},
                        trainer={"max_steps": 20, "log_every": 5, "eval_every": 10, "eval_steps": 2})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output[-4000:]
    rows = [r for r in metrics(tmp_path, "gpu-decode") if "loss" in r]
    assert rows[-1]["loss"] < rows[0]["loss"], rows
    assert any("eval_accuracy" in r for r in metrics(tmp_path, "gpu-decode"))


# --------------------------------------------------------------------------- the grid on CUDA
@needs_cuda
@needs_two
def test_the_compatibility_grid_on_cuda_with_nccl(tmp_path):
    """Every cell `validate` accepts (tests/test_compatibility.py's grid) on 2 GPUs with nccl: trains,
    follows its reference within its precision's tolerance, resumes, exports -- or is refused by
    `trainkit run`'s preflight on this machine. With TRAINKIT_GRID_RECORD=1 the outcomes are recorded
    as the GPU column of docs/compatibility.md."""
    cells = [s.cell for s in statuses(declared_cells()) if not s.refused]
    outcomes = run_grid(tmp_path, cells, timeout=3000)
    failures = {o.cell.id: why for o in outcomes if (why := problems_of(o))}
    if os.environ.get("TRAINKIT_GRID_RECORD"):
        record(outcomes, failures, kind="gpu", device=f"{torch.cuda.get_device_name()} x2, nccl",
               command="TRAINKIT_GRID_RECORD=1 pytest -m gpu tests/test_gpu.py")
    assert not failures, json.dumps(failures, indent=1)[-20000:]


@needs_cuda
def test_the_compatibility_grid_on_one_cuda_device(tmp_path):
    """Every accepted cell that neither splits the model nor lays out a mesh, in one process on one GPU: the CUDA kernels,
    autocast, loss scaling, FSDP/ZeRO on a CUDA device, compile through Triton, channels_last -- train,
    resume exactly and export, or a clear preflight refusal (no reference: one process checks the
    device, the 2-GPU test above checks the collectives). TRAINKIT_GRID_RECORD=1 records the outcomes
    as docs/compatibility.md's `gpu-1` kind; TRAINKIT_GRID_TIMEOUT_S bounds the launch (the cells not
    reached then fail as "no result")."""
    cells = [s.cell for s in statuses(declared_cells()) if not s.refused and not s.cell.strategy.startswith("pipeline")
             and s.cell.mesh == "none"]  # a mesh needs its ranks
    outcomes = run_alone(tmp_path, cells, timeout=float(os.environ.get("TRAINKIT_GRID_TIMEOUT_S", 3000)))
    failures = {o.cell.id: why for o in outcomes if (why := problems_of(o))}
    if os.environ.get("TRAINKIT_GRID_RECORD"):
        record(outcomes, failures, kind="gpu-1", device=f"{torch.cuda.get_device_name()} x1, torch {torch.__version__}",
               command="TRAINKIT_GRID_RECORD=1 pytest -m gpu tests/test_gpu.py -k one_cuda_device")
    assert not failures, json.dumps(failures, indent=1)[-20000:]


# --------------------------------------------------------------------------- GPU-only cases of issue 26
@needs_cuda
def test_fp16_with_a_huge_fixed_loss_scale_skips_overflowing_steps_instead_of_stopping(tmp_path):
    """A fixed scale of 1e30 overflows fp16 gradients on every step: the scaler skips each step, and
    the non-finite guard excuses a step the scaler skipped (an inf clipped norm stopped such runs)."""
    recipe = mlp_recipe(tmp_path, "overflow", model=WIDE, data=DATA, precision="fp16",
                        launch={"nproc_per_node": 1, "backend": "nccl"},
                        trainer={"max_steps": 4, "log_every": 1, "grad_clip": 1.0, "loss_scale": 1e30})
    result = trainkit(tmp_path, "run", str(recipe))
    assert result.returncode == 0, result.output
    assert "non-finite" not in result.output.lower(), result.output
    losses = [r["loss"] for r in metrics(tmp_path, "overflow") if "loss" in r]
    assert len(losses) == 4 and all(v == v and abs(v) != float("inf") for v in losses), losses


@needs_cuda
@needs_two
def test_resume_on_a_process_that_sees_fewer_gpus_than_the_saver(tmp_path):
    """A checkpoint saved by a process seeing 2 GPUs resumes in one seeing 1: the RNG state restored is
    the rank's own device's (restoring every saved GPU's state raised IndexError)."""
    recipe = mlp_recipe(tmp_path, "fewer", launch={"nproc_per_node": 1, "backend": "nccl"},
                        trainer={"max_steps": 4, "log_every": 1, "checkpoint": {"every": 2, "keep": 2}})
    first = trainkit(tmp_path, "run", str(recipe), CUDA_VISIBLE_DEVICES="0,1")
    assert first.returncode == 0, first.output
    shutil.rmtree(tmp_path / "runs" / "fewer" / "checkpoints" / "step-00000004")
    again = trainkit(tmp_path, "run", str(recipe), CUDA_VISIBLE_DEVICES="0")
    assert again.returncode == 0, again.output
    assert "resumed from" in again.output and "step-00000002" in again.output


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_meshes_on_cuda_with_nccl(tmp_path):
    """tests/test_parallel_mesh_runs.py on 4 GPUs (issue 30): HSDP 2x2, FSDP x TP 2x2 and TP 2 equal one
    GPU's losses, a checkpoint resumes on another mesh, and each exports to the plain model."""
    from test_parallel_mesh_runs import check_all, train_mesh_runs

    train_mesh_runs(tmp_path, device_env={}, side_by_side=False)
    check_all(tmp_path)


@needs_cuda
@needs_two
def test_a_hang_under_nccl_has_the_flight_recorder_section_and_nccls_own_dumps(tmp_path):
    """Issue 29, the GPU side of tests/test_run_hang.py (never run on the project's CPU-only CI
    machines; written without a GPU at hand: run it on a 2-GPU node). Rank 1 sleeps inside the
    backward of step 6 under nccl. The same hook and collection path as on gloo: hang.md's Flight
    Recorder section names rank 1 missing from an nccl all-reduce of the MLP's gradient bucket,
    from reports/flight-recorder/rank<R>; and NCCL's own record (ProcessGroupNCCL's ring, with
    TORCH_FR_BUFFER_SIZE and TORCH_NCCL_DUMP_ON_TIMEOUT from the launcher) is fetched from each rank
    as reports/nccl-trace-rank<R>, which torch's fr_trace reads and in which it finds rank 1 missing."""
    import subprocess
    import sys

    recipe = mlp_recipe(tmp_path, "nccl-hang", launch={"nproc_per_node": 2, "backend": "nccl", "timeout_s": 120,
                                                         "hang_timeout_s": 5},
                        trainer={"max_steps": 40, "log_every": 2, "checkpoint": {"every": 4, "keep": 2}})
    result = trainkit(tmp_path, "run", str(recipe), timeout=300,
                      TRAINKIT_FAULT_HANG="rank=1,step=6,where=backward,how=sleep")
    assert result.returncode == 1 and "hang: no rank made progress" in result.stderr, result.output
    reports = tmp_path / "runs" / "nccl-hang" / "reports"
    report = (reports / "hang.md").read_text()
    assert report.startswith("# Hang: rank 1 is behind at step 6"), report
    # the blame comes from NCCL's record (issue 41, item 1): rank 0 enqueued the bucket's all-reduce
    # and its host ran on; rank 1, asleep before it, issued one collective fewer
    assert "NCCL Flight Recorder: the other ranks of process group 0" in report, report
    assert "rank 1 issued only up to #" in report, report
    section = report.split("## Flight Recorder", 1)[1].split("\n## ", 1)[0]
    assert "- ranks {1} did not join nccl:all_reduce #" in section, section
    assert sorted(p.name for p in (reports / "flight-recorder").glob("rank*")) == ["rank0", "rank1"]
    assert "The backend's own record of ranks 0, 1" in section, section
    assert (reports / "nccl-trace-rank0").exists() and (reports / "nccl-trace-rank1").exists()
    native = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(reports),
                             "-p", "nccl-trace-rank"], capture_output=True, text=True, timeout=120)
    assert native.returncode == 0 and "missing ranks: {1}" in native.stdout + native.stderr, native


@needs_cuda
@needs_two
def test_what_a_rank_holds_outside_torchs_allocator_is_near_the_plans_runtime_and_nccl_lines(tmp_path):
    """Issue 41, item 3, on 2 GPUs (written without a GPU at hand; run it on a 2-GPU node). What a process
    holds beyond torch's caching allocator -- nvidia-smi's figure for its pid (or, where it cannot list
    a container's pids, its GPU's used memory: one rank per GPU) minus torch's reserved bytes, after the
    last step -- for one rank alone (the CUDA context: the plan's "runtime" line) and for each of two
    DDP ranks under NCCL (the context and the world's communicator): the one rank's within a factor of 2
    of the runtime line, and what the second run adds within a factor of 2 of the plan's "NCCL buffers"
    line. The figures are printed for docs/memory.md."""
    from trainkit.recipe.memory_plan import ModelSizes, plan, setting_of
    from trainkit.recipe.resolver import resolve

    def outside(ranks: int) -> tuple[list[int], dict]:
        probe = tmp_path / f"gpu-memory-{ranks}"
        probe.mkdir()
        recipe = mlp_recipe(tmp_path, f"nccl-memory-{ranks}", model=WIDE, data=DATA,
                            launch={"nproc_per_node": ranks, "backend": "nccl"},
                            trainer={"max_steps": 6, "log_every": 2, "checkpoint": {"every": 100}})
        result = trainkit(tmp_path, "run", str(recipe), timeout=300, TRAINKIT_FAULT_PROBE_GPU_MEMORY=str(probe))
        assert result.returncode == 0, result.output[-4000:]
        held = []
        for rank in range(ranks):
            seen = json.loads((probe / f"gpu-rank{rank}.json").read_text())
            used = seen["process_used"] if seen["process_used"] is not None else seen["device_used"]
            assert seen["step"] == 6 and not seen["contexts_on_other_gpus"], seen  # no stray context
            held.append(used - seen["reserved"])
            print(f"{ranks} rank(s), rank {rank}: outside torch's allocator {held[-1] / 2**20:.0f} MiB {seen}")
        anything = ModelSizes(parameters=1, buffer_bytes=0, largest_unit=1, activation_bytes=None)
        parts = {p.name: p for p in plan(anything, setting_of(resolve(recipe).recipe, "cuda")).parts}
        return held, parts

    (alone,), one = outside(1)
    pair, two = outside(2)
    assert "NCCL buffers" not in one and "(world " in two["NCCL buffers"].how, two
    runtime, nccl = one["runtime"].bytes, two["NCCL buffers"].bytes
    added = min(pair) - alone
    print(f"plan: runtime {runtime / 2**20:.0f} MiB, NCCL {nccl / 2**20:.0f} MiB; seen: alone "
          f"{alone / 2**20:.0f} MiB, the communicator adds {added / 2**20:.0f} MiB")
    assert runtime / 2 < alone < runtime * 2, (alone, runtime)
    assert nccl / 2 < added < nccl * 2, (added, nccl, pair, alone)


@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs")
def test_tensor_parallel_dropout_is_one_mask_per_tp_group_another_per_replica_and_replays(tmp_path):
    """Issue 41, item 4, on 4 GPUs (written without a GPU at hand): dp_replicate 2 x tp 2, each rank seeded
    as a worker seeds it (tests/gpu_tensor_parallel_dropout.py). The two ranks of a tensor-parallel group
    draw one mask for a replicated activation, each by itself, the two replicas different ones (without
    trainkit's seeding DTensor's tracker broadcasts rank 0's state: one mask everywhere), and restoring
    the checkpoint's RNG state replays the next mask."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from run_helpers import env_for, free_port

    out = tmp_path / "masks"
    out.mkdir()
    script = Path(__file__).resolve().parent / "gpu_tensor_parallel_dropout.py"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
                             str(free_port()), str(script), str(out)], env=env_for(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-4000:]
    seen = [json.loads((out / f"masks-rank{r}.json").read_text()) for r in range(4)]
    per_replica = {}
    for s in seen:
        per_replica.setdefault(s["replica"], set()).add((s["replicated"], s["first"]))
    # the group's ranks drew the replicated activation's mask alike, each by itself
    assert sorted(per_replica) == [0, 1] and all(len(m) == 1 for m in per_replica.values()), seen
    (own_0, whole_0), (own_1, whole_1) = per_replica[0].pop(), per_replica[1].pop()
    assert own_0 != own_1 and whole_0 != whole_1, seen  # the replicas drop different units
    assert all(s["again"] == s["second"] != s["first"] for s in seen), seen


def test_bf16_is_not_advised_on_a_gpu_that_only_emulates_it(monkeypatch):
    """(Runs without a GPU too: the capability is faked.) A V100/T4 answers torch.cuda.is_bf16_supported() True (emulation) and False with
    including_emulation=False: the advice's environment must say bf16 is not fast there."""
    from trainkit.analysis.evidence import describe_env

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert describe_env("cuda", "nccl")["bf16"] is False


CUDA_RANK_WORK = """
import torch, torch.nn.functional as F
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
(x @ x).sum().item()  # cuBLAS
img = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
F.conv2d(img, torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16), padding=1).sum().item()  # cuDNN
torch.cuda.synchronize()
with open("/proc/self/smaps_rollup") as f:
    print({l.split(":")[0]: int(l.split()[1]) << 10 for l in f if l.startswith(("Rss:", "Pss:", "Private_Dirty:"))})
"""


@needs_cuda
def test_a_cuda_ranks_host_memory_is_within_the_figure_jobs_ask_for():
    """Issue 41, item 5 (written without a GPU at hand): the cluster writers count a CUDA rank's own process
    on the host as CUDA_PROCESS_HOST_BYTES (2 GiB, an upper estimate). A process that has run cuBLAS and
    cuDNN holds, on the host, its proportional share of pages (Pss: torch's and CUDA's libraries, the
    context's host allocations) within that figure. The figures are printed for docs/clusters.md."""
    import ast
    import subprocess
    import sys

    from trainkit.doctor.resources import CUDA_PROCESS_HOST_BYTES

    done = subprocess.run([sys.executable, "-c", CUDA_RANK_WORK], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    figures = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    print(f"a CUDA process's host memory: {({k: f'{v / 2**20:.0f} MiB' for k, v in figures.items()})}")
    assert figures["Pss"] <= CUDA_PROCESS_HOST_BYTES, figures
