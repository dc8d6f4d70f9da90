"""Precision and loss scaling, and where a rank runs (device + process-group backend).

fp16 runs on the CPU (torch's CPU GradScaler and fp16 autocast), so every loss-scaling path is
checked here without a GPU: a planted overflow (an inf gradient) must skip the step, back a dynamic
scale off, leave a fixed scale exactly where it is, and the scaler's state must survive a
checkpoint. `accelerator_for` is checked over strategies x CUDA x backend x offload with recipes
built by the resolver; no process group is needed.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from run_helpers import mlp_recipe, summary, trainkit
from trainkit.recipe import resolve
from trainkit.runtime.accelerator import Accelerator, AcceleratorError, accelerator_for
from trainkit.runtime.precision import Precision
from trainkit.strategies.base import Strategy

CPU = torch.device("cpu")


# --------------------------------------------------------------------------- loss scaling on the CPU
def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(precision: Precision, model: nn.Module, optimizer, *, overflow: bool = False) -> None:
    """One optimizer step the way the loop does it (strategy.forward_backward + optimizer_step),
    with an inf planted in a gradient after backward when `overflow`."""
    strategy = Strategy(None, device=CPU, precision=precision)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    strategy.forward_backward(model, x, y, nn.functional.cross_entropy, precision, grad_accum_steps=1,
                              last_micro_step=True)
    if overflow:
        model.weight.grad[0, 0] = float("inf")
    strategy.optimizer_step(model, optimizer, precision, max_norm=1.0)


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_fp16_autocast_and_a_grad_scaler_run_on_the_cpu():
    """Guards fp16 on CPU: Precision used to refuse any non-CUDA device for fp16."""
    precision = Precision("fp16", CPU, "dynamic")
    assert precision.scaler is not None and precision.scale == 65536.0
    with precision.autocast():
        assert nn.Linear(4, 3)(torch.randn(2, 4)).dtype == torch.float16
    model, optimizer = _model_and_optimizer()
    before = _weights(model)
    _step(precision, model, optimizer)
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))  # a clean step updates
    assert precision.scale == 65536.0


def test_dynamic_scale_skips_an_overflowing_step_and_backs_off():
    """Guards the dynamic GradScaler path: inf gradient -> weights unchanged, scale halves."""
    precision = Precision("fp16", CPU, "dynamic")
    model, optimizer = _model_and_optimizer()
    before = _weights(model)
    _step(precision, model, optimizer, overflow=True)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert precision.scale == 32768.0


def test_fixed_scale_skips_an_overflowing_step_and_never_changes():
    """Guards the fixed loss scale: torch refuses growth/backoff factors of 1.0 (the old code died
    with "The growth factor must be > 1.0."); an overflow must skip the step and leave the scale
    exactly as set, and a run of clean steps long enough to grow a dynamic scale must not grow it."""
    precision = Precision("fp16", CPU, 128.0)
    model, optimizer = _model_and_optimizer()
    before = _weights(model)
    _step(precision, model, optimizer, overflow=True)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert precision.scale == 128.0
    _step(precision, model, optimizer)
    assert all(not torch.equal(a, b) for a, b in zip(before, _weights(model)))
    assert precision.scale == 128.0

    # One clean step short of the growth interval: a dynamic scale doubles on the next clean step
    # (checked on a dynamic scaler with the same state), the fixed one stays.
    for p in (precision, dynamic := Precision("fp16", CPU, "dynamic")):
        state = p.state_dict() | {"_growth_tracker": p.state_dict()["growth_interval"] - 1}
        p.load_state_dict(state)
        _step(p, *_model_and_optimizer())
    assert dynamic.scale == 65536.0 * 2
    assert precision.scale == 128.0


@pytest.mark.parametrize("loss_scale", ["dynamic", 256.0])
def test_scaler_state_round_trips_through_state_dict(loss_scale):
    """Guards resume: the scale (after a back-off for dynamic) and growth tracker come back."""
    precision = Precision("fp16", CPU, loss_scale)
    model, optimizer = _model_and_optimizer()
    _step(precision, model, optimizer, overflow=True)
    _step(precision, model, optimizer)
    saved = precision.state_dict()
    assert saved["scale"] == (32768.0 if loss_scale == "dynamic" else 256.0)
    restored = Precision("fp16", CPU, loss_scale)
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved and restored.scale == saved["scale"]
    _step(restored, *_model_and_optimizer(), overflow=True)
    assert restored.scale == (16384.0 if loss_scale == "dynamic" else 256.0)


def test_no_torch_scaler_when_the_strategy_scales_the_loss_itself():
    """Guards DeepSpeed fp16: a strategy that owns loss scaling gets no GradScaler (the worker
    passes scaler=not owns_loss_scaling), and a fixed scale no longer builds a failing one."""
    from trainkit.recipe.blocks import DDPOptions, DeepSpeedOptions, FSDPOptions, PipelineOptions

    assert DeepSpeedOptions(name="deepspeed").capabilities().owns_loss_scaling
    assert not any(o.capabilities().owns_loss_scaling for o in (
        DDPOptions(name="ddp"), FSDPOptions(name="fsdp"), PipelineOptions(name="pipeline")))
    for scale in ("dynamic", 1024.0):
        precision = Precision("fp16", CPU, scale, scaler=False)
        assert precision.scaler is None and precision.scale is None and precision.state_dict() == {}
        assert precision.dtype == torch.float16
    assert Precision("fp32", CPU).scaler is None and Precision("bf16", CPU).scaler is None


# --------------------------------------------------------------------------- fp16 end to end on the CPU
@pytest.mark.distributed
def test_fp16_run_on_cpu_finishes_with_a_finite_loss(tmp_path):
    """Guards `trainkit run` with precision fp16 on the CPU: preflight used to refuse it, and a
    fixed loss_scale crashed every rank building its GradScaler. The scale in the last checkpoint
    is the fixed value exactly. Under FSDP with CPU offload and clipping (DTensor gradients: a sharded
    overflow check and norm). DDP's fp16 with a fixed and a dynamic scale are grid cells
    (ddp__*__fp16-fixed/-dynamic: losses, resume, export), not launches here; a dynamic scale's state
    round trip is test_scaler_state_round_trips_through_state_dict (in-process)."""
    path = mlp_recipe(tmp_path, "fp16-fsdp-fixed", precision="fp16",
                      strategy={"name": "fsdp", "wrap": [], "cpu_offload": True},
                      trainer={"max_steps": 4, "log_every": 1, "loss_scale": 1024.0, "grad_clip": 1.0,
                               "checkpoint": {"every": 4, "keep": 1}})
    result = trainkit(tmp_path, "run", str(path), timeout=180)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / "fp16-fsdp-fixed"
    final = summary(run_dir)["final_loss"]
    assert final is not None and math.isfinite(final)
    trainer_state = torch.load(run_dir / "checkpoints" / "step-00000004" / "trainer.pt", weights_only=False)
    assert trainer_state["scaler"]["scale"] == 1024.0


# --------------------------------------------------------------------------- device and backend
STRATEGIES = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "fsdp-offload": {"name": "fsdp", "cpu_offload": True},
    "pipeline": {"name": "pipeline", "microbatches": 2},
    "deepspeed": {"name": "deepspeed", "zero_stage": 2},
    "deepspeed-offload": {"name": "deepspeed", "zero_stage": 2, "offload_optimizer": "cpu"},
}


def _recipe(tmp_path, strategy: str, backend: str):
    path = mlp_recipe(tmp_path, f"{strategy}-{backend}", strategy=STRATEGIES[strategy],
                      launch={"nproc_per_node": 2, "backend": backend})
    return resolve(path).recipe


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("backend", ["auto", "gloo", "nccl"])
@pytest.mark.parametrize("cuda", [True, False], ids=["cuda", "no-cuda"])
def test_accelerator_picks_device_and_backend(tmp_path, strategy, backend, cuda):
    """Guards the one decision of device and init_process_group backend: gloo means the CPU even
    on a GPU machine (the worker used to take cuda:LOCAL_RANK whenever CUDA was visible), nccl
    without CUDA is a clear error, and FSDP's CPU offload adds a CPU backend to nccl (its norm
    and digest collectives move CPU tensors)."""
    recipe = _recipe(tmp_path, strategy, backend)
    if backend == "nccl" and not cuda:
        with pytest.raises(AcceleratorError, match="nccl needs CUDA"):
            accelerator_for(recipe, cuda_available=cuda, local_rank=1)
        return
    acc = accelerator_for(recipe, cuda_available=cuda, local_rank=1)
    if backend == "gloo" or not cuda:
        assert acc == Accelerator("cpu", "gloo", 1)
        assert acc.device == torch.device("cpu") and acc.device_backend == "gloo"
    else:
        expected = "cuda:nccl,cpu:gloo" if strategy == "fsdp-offload" else "nccl"
        assert acc == Accelerator("cuda", expected, 1)
        assert acc.device == torch.device("cuda", 1) and acc.device_backend == "nccl"


def test_preflight_counts_gpus_only_when_the_recipe_runs_on_them(tmp_path, monkeypatch):
    """Guards preflight using accelerator_for: on a 1-GPU machine, 2 gloo ranks run on the CPU
    (no GPU-count error) while 2 auto (nccl) ranks need 2 GPUs; nccl without CUDA is an error."""
    from trainkit.runtime import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    errors = lambda r: [f for f in preflight._devices(r) if f[2] == "error"]  # noqa: E731
    assert errors(_recipe(tmp_path, "ddp", "gloo")) == []
    [(path, message, _)] = errors(_recipe(tmp_path, "ddp", "auto"))
    assert path == ("launch", "nproc_per_node") and "only 1 GPU(s)" in message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    [(path, message, _)] = errors(_recipe(tmp_path, "ddp", "nccl"))
    assert path == ("launch", "backend") and "nccl needs CUDA" in message
    fp16 = mlp_recipe(tmp_path, "fp16", precision="fp16")
    assert errors(resolve(fp16).recipe) == []  # fp16 on the CPU: a warning (slow), not an error



def test_doctor_counts_gpus_only_when_the_recipe_runs_on_them(tmp_path, monkeypatch):
    """Guards `trainkit doctor` following accelerator_for: 2 gloo ranks on a 1-GPU machine run on
    the CPU (passes), 2 auto ranks need 2 GPUs (fails)."""
    from trainkit.doctor.devices import gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    on_cpu = gpus(resolve(mlp_recipe(tmp_path, "gloo", launch={"nproc_per_node": 2, "backend": "gloo"})))
    assert on_cpu.status == "pass" and "gloo runs the ranks on the CPU" in on_cpu.detail
    on_gpu = gpus(resolve(mlp_recipe(tmp_path, "auto", launch={"nproc_per_node": 2, "backend": "auto"})))
    assert on_gpu.status == "fail" and "only 1 GPU(s)" in on_gpu.detail

# --------------------------------------------------------------------------- FSDP mixed precision
_FSDP_DTYPES = """
import json, os, sys, tempfile, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from trainkit.models import mlp
from trainkit.recipe.blocks import FSDPOptions
from trainkit.strategies.fsdp import apply_fsdp
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = mlp(in_features=8, hidden=16, num_classes=4, depth=2)
seen = {}
for name, m in model.named_children():
    m.register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, str(out.dtype)))
apply_fsdp(model, init_device_mesh("cpu", (1,)), FSDPOptions(name="fsdp"), sys.argv[1])
out = model(torch.randn(2, 8))
out.float().sum().backward()
print(json.dumps({"blocks": seen, "root": str(out.dtype),
                  "grads": sorted({str(p.grad.dtype) for p in model.parameters()})}))
dist.barrier(); dist.destroy_process_group()
sys.stdout.flush(); os._exit(0)  # no interpreter finalization racing gloo's threads (as the worker leaves)
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_fsdp_blocks_keep_the_compute_dtype_and_only_the_root_output_is_fp32(precision):
    """Guards the torchtitan-style policy: blocks used to cast every output to fp32 (a round trip
    per boundary); now each wrapped Linear returns bf16/fp16, the root returns fp32, and the
    gradients of the fp32 master parameters stay fp32. One gloo rank, in a child process."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FSDP_DTYPES, precision], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    compute = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}[precision]
    assert [seen["blocks"][k] for k in ("1", "3", "5")] == [compute] * 3  # the three wrapped Linears
    assert seen["root"] == "torch.float32"
    assert seen["grads"] == ["torch.float32"]


@pytest.mark.slow
def test_loss_scaling_overflow_steps_are_skipped_not_counted_as_divergence(tmp_path):
    """Guards fp16 + grad_clip (issue 26): a step the GradScaler skips for inf gradients has an inf
    clipped norm by design (torch documents early overflows as expected); the non-finite guard counted
    it and stopped the run (NonFiniteError). A scale so large that every step overflows: the run
    finishes and logs no inf gradient norm."""
    path = mlp_recipe(tmp_path, "overflow", precision="fp16", launch={"nproc_per_node": 1},
                      trainer={"max_steps": 3, "log_every": 1, "loss_scale": 1.0e30, "grad_clip": 1.0,
                               "checkpoint": {"every": 3, "keep": 1}})
    result = trainkit(tmp_path, "run", str(path), timeout=180)
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / "overflow"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert not [r for r in rows if "grad_norm" in r and not math.isfinite(r["grad_norm"])]
    assert math.isfinite(summary(run_dir)["final_loss"])


def test_resume_restores_the_rng_of_this_ranks_gpu_even_where_fewer_gpus_are_visible(monkeypatch):
    """Issue 26: a checkpoint held every visible GPU's RNG state and resume restored them all, so a
    process seeing fewer GPUs than the saver raised IndexError (torch's cuda/random.py). Now a rank
    saves and restores its own device's state; an old checkpoint's list restores the current device's."""
    from trainkit.runtime import checkpoint

    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: (_ for _ in ()).throw(
        IndexError("list index out of range")))  # what torch does with more states than devices
    base = {"torch": torch.get_rng_state(), "python": __import__("random").getstate()}
    saved_by_an_8_gpu_process = [torch.full((16,), i, dtype=torch.uint8) for i in range(8)]
    checkpoint.set_rng_state({**base, "cuda": saved_by_an_8_gpu_process})
    checkpoint.set_rng_state({**base, "cuda": torch.full((16,), 7, dtype=torch.uint8)})
    assert [int(s[0]) for s in restored] == [0, 7]
