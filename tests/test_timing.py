"""What the timing and monitors measure on a GPU, specified on the CPU: the CUDA parts sit behind a
small event interface (`record`, `synchronize`, `elapsed_time`) that these tests fake."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainkit.analysis.bottleneck import diagnose
from trainkit.monitors.gpu import Sampler
from trainkit.monitors.throughput import peak_tflops
from trainkit.recipe.blocks import PipelineOptions
from trainkit.runtime.loop import Loop
from trainkit.runtime.stats import RunStats
from trainkit.runtime.timing import Clock, CommTimer, DeviceEvents, ForwardMarks, comm_seconds, timed_hook
from trainkit.strategies.pipeline import PipelineStrategy, StageModule, plan_stages, stage_flops


class FakeCuda:
    """Stands in for torch.cuda: events stamped with perf_counter; counts synchronize calls."""

    def __init__(self):
        self.syncs = 0
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                self.t = time.perf_counter()

            def synchronize(self):
                fake.syncs += 1

            def elapsed_time(self, end):
                return (end.t - self.t) * 1000.0

        self.Event = Event


class FakeStrategy:
    """forward_backward sleeps; on the last micro-step two 'collectives' run through the comm timer."""

    def __init__(self, comm_timer=None):
        self.comm_timer = comm_timer
        if comm_timer is not None:
            comm_timer.bound = True  # as DDP's bind() when it registers its hook (the fake keeps its events)

    def forward_backward(self, model, x, y, loss_fn, precision, *, grad_accum_steps, last_micro_step):
        model(x)
        time.sleep(0.004)  # "backward"
        if last_micro_step and self.comm_timer is not None:
            src = self.comm_timer.source
            a = src.mark()
            time.sleep(0.003)  # overlapped with the rest of backward
            b = src.mark()
            time.sleep(0.002)
            self.comm_timer.add(a, src.mark())  # in flight 5 ms, 2 ms of it after the last bucket was ready
            self.comm_timer.add(b, src.mark())
        return torch.zeros(())

    def optimizer_step(self, model, optimizer, precision, grad_clip):
        time.sleep(0.002)
        return None


def fake_loop(cuda: FakeCuda, accum: int = 2) -> Loop:
    clock = Clock(torch.device("cpu"), precise=True, source=DeviceEvents(cuda))
    model = nn.Linear(4, 2)
    trainer = SimpleNamespace(grad_accum_steps=accum, on_nonfinite="stop", grad_clip=None)
    return Loop(trainer=trainer, run_name="timing", replica_batch=1, model=model, optimizer=None,
                scheduler=SimpleNamespace(step=lambda: None),
                strategy=FakeStrategy(CommTimer(DeviceEvents(cuda))), precision=SimpleNamespace(scaler=None),
                task=SimpleNamespace(to_device=lambda b: b, loss_fn=None), train_loader=None, eval_loader=None,
                checkpointer=None, device=torch.device("cpu"), clock=clock,
                forward_marks=ForwardMarks(model, clock))


def test_device_phases_are_resolved_once_per_log_interval_not_per_micro_step():
    """Guards: with CUDA events the loop never synchronizes inside a step (the breakdown monitor used
    to call `synchronize()` per micro-step and for the optimizer); RunStats resolves the interval's
    marks when the interval ends, and the resolved phases are the device's (here: the fake's) times."""
    cuda = FakeCuda()
    loop = fake_loop(cuda, accum=2)
    data = iter([(torch.zeros(3, 4), torch.zeros(3))] * 100)
    stats = RunStats()
    for _ in range(6):
        _, _, times = loop.train_step(data)
        stats.add(times)
    assert cuda.syncs == 0  # six steps of two micro-steps each: no device sync at all
    stats.interval_means()
    assert cuda.syncs > 0
    means = stats.means()
    assert means["steps"] == 4  # after the 2 warm-up steps
    assert 0.008 <= means["compute"] < 0.05  # two micro-steps of >= 4 ms each (+ 5 ms comm on the last)
    assert 0.002 <= means["optimizer"] < 0.03
    assert means["forward"] < means["compute"]
    assert 0.005 <= means["comm"] < 0.04 and 0.002 <= means["comm_exposed"] < means["comm"]


def test_comm_hook_end_mark_is_taken_in_the_future_callback_on_the_device_source():
    """Guards: a timed DDP hook stamps its start before the collective is issued and its end inside
    the future's `then` callback, both from the timer's source (CUDA events on a GPU, never a host
    perf_counter there), and nothing is synchronized until the step's spans are resolved."""
    cuda = FakeCuda()
    timer = CommTimer(DeviceEvents(cuda))

    def hook(state, bucket):
        fut = torch.futures.Future()
        threading.Timer(0.01, lambda: fut.set_result([bucket])).start()
        return fut

    out = timed_hook(hook, timer)(None, torch.ones(2)).wait()
    assert torch.equal(out, torch.ones(2))
    spans = timer.take()
    assert spans.count == 1 and cuda.syncs == 0
    assert 0.009 <= spans.in_flight.resolve() < 0.2 and cuda.syncs > 0


def test_exposed_communication_is_the_in_flight_time_after_the_last_bucket_was_ready():
    """Guards the definition of exposed communication: collectives overlapped with backward cost
    nothing; only in-flight time after the last bucket became ready (compute done) counts."""
    # three buckets, each all-reduce done before the next bucket is ready: fully overlapped but the last
    assert comm_seconds([(0.0, 1.0), (2.0, 3.0), (4.0, 4.5)]) == (2.5, 0.5)
    # a queue of collectives that drains long after compute: most of it exposed
    assert comm_seconds([(0.0, 5.0), (1.0, 9.0), (2.0, 10.0)]) == (10.0, 8.0)
    assert comm_seconds([]) == (0.0, 0.0)


def ranks(comm: float, exposed: float) -> list[dict]:
    return [{"rank": r, "host": "h", "steps": 20, "total": 0.100, "data_wait": 0.001, "forward": 0.02,
             "backward": 0.06, "compute": 0.08, "optimizer": 0.01, "comm": comm, "comm_exposed": exposed}
            for r in range(2)]


def _real_recipe():
    """A resolved recipe (the verdict reads the real schema: backend, strategy, precision)."""
    from test_bottleneck_advice import recipe

    return recipe(strategy={"name": "ddp", "bucket_cap_mb": 25}, precision="bf16",
                  data={"name": "synthetic", "batch_size": 8, "num_workers": 4, "prefetch_factor": 4,
                        "persistent_workers": True, "pin_memory": True},
                  launch={"nproc_per_node": 2})


RECIPE = _real_recipe()


def test_overlapped_communication_is_not_called_communication_bound():
    """Guards: the verdict judges exposed communication. 60 ms of 100 in flight but overlapped with
    backward (2 ms exposed) is compute-bound; the same in flight with 40 ms exposed is
    communication-bound, and the report shows both numbers."""
    overlapped = diagnose(ranks(comm=0.060, exposed=0.002), RECIPE)
    assert overlapped.kind == "compute-bound"
    assert any("in flight 60%" in e for e in overlapped.evidence)
    assert any("exposed communication" in e and "2%" in e for e in overlapped.evidence)
    exposed = diagnose(ranks(comm=0.060, exposed=0.040), RECIPE)
    assert exposed.kind == "communication-bound" and "40%" in exposed.headline
    assert exposed.table[0][-1] == "exposed comm ms" and exposed.table[1][-1] == "40.0"


@pytest.mark.parametrize("name, precision, tf32, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.0),
    ("NVIDIA H100 80GB HBM3", "fp32", False, 67.0),  # TF32 off: plain fp32, not the TF32 peak
    ("NVIDIA H100 80GB HBM3", "fp32", True, 494.0),
    ("NVIDIA H100 PCIe", "fp16", False, 756.0),
    ("NVIDIA H100 NVL", "bf16", False, 835.0),
    ("NVIDIA H200", "bf16", False, 989.0),
    ("NVIDIA GH200 480GB", "fp32", True, 494.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", False, 19.5),
    ("NVIDIA A100 80GB PCIe", "fp32", True, 156.0),
    ("NVIDIA A10G", "bf16", False, 70.0),
    ("NVIDIA A10", "bf16", False, 125.0),
    ("NVIDIA L40S", "bf16", False, 362.0),
    ("NVIDIA L4", "bf16", False, 121.0),
    ("Tesla V100-SXM2-16GB", "fp32", True, 15.7),  # no TF32 on Volta
    ("Tesla T4", "fp16", False, 65.0),
    ("NVIDIA GeForce RTX 4090", "bf16", False, 165.0),
    ("NVIDIA B200", "bf16", False, 2250.0),
    ("Some Future GPU", "bf16", False, None),
])
def test_peak_matches_real_device_names_and_what_actually_runs(name, precision, tf32, expected):
    """Guards MFU's denominator: real `get_device_name()` strings match their GPU (the old "H100 SXM"
    key never did), and fp32 uses the fp32 peak unless `performance.tf32` is on."""
    assert peak_tflops(name, precision, tf32) == expected


def test_each_pipeline_rank_is_credited_with_its_own_stages_flops():
    """Guards per-stage FLOPs: on a CPU pipeline split the stages' counts add up to the whole model's
    (plus the input gradients later stages compute) and a rank is credited with its stages only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    x = torch.randn(8, 64)
    options = PipelineOptions(name="pipeline", split_points=["3"])
    plan = plan_stages(model, options, 2)
    per_stage = stage_flops([StageModule(b) for b in plan], x)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    whole = counter.get_total_flops()
    assert len(per_stage) == 2 and all(0 < f < whole for f in per_stage)
    assert whole <= sum(per_stage) <= whole * 1.2
    strategy = PipelineStrategy(options, device=torch.device("cpu"), data=None)  # no tracing, no evaluation here
    strategy_flops = strategy.flops_of_rank(model, x)  # one process: rank 0 of 1 holds both stages
    assert strategy_flops == pytest.approx(sum(per_stage))

    class SecondOfTwo(PipelineStrategy):
        rank = property(lambda self: 1)
        world_size = property(lambda self: 2)

    assert SecondOfTwo(options, device=torch.device("cpu"), data=None).flops_of_rank(model, x) == pytest.approx(per_stage[1])


def test_gpu_sampler_reads_nvml_every_interval_and_aggregates_between_log_steps():
    """Guards `gpu.interval_s`: a background thread samples on that interval (not only at log steps),
    and a log step reports min/mean/max of the samples since the previous one."""
    reads = []

    def fake_nvml() -> dict:
        reads.append(time.perf_counter())
        return {"utilization_percent": float(len(reads) % 3) * 50.0, "power_w": 300.0}

    sampler = Sampler(fake_nvml, interval_s=0.02).start()
    try:
        time.sleep(0.5)
        values = sampler.take()
    finally:
        sampler.stop()
    assert 10 <= values["samples"] <= 30  # ~25 expected; 2 shared cores make it jittery
    assert values["utilization_percent_min"] == 0.0 and values["utilization_percent_max"] == 100.0
    assert 0.0 < values["utilization_percent"] < 100.0 and values["power_w"] == 300.0
    assert sampler.take()["samples"] <= 1  # the window restarts at each log step
