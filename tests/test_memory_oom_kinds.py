"""Out of memory outside the caching allocator, and the plan's CUDA budget (issue 41, items 1 and 2).

In-process, on the CPU: the real exception types (torch.distributed.DistBackendError,
torch.AcceleratorError, torch's RuntimeError) carry the messages torch and NCCL build on a GPU
(torch/csrc/distributed/c10d/NCCLUtils.hpp `C10D_NCCL_CHECK` + `getNcclErrorDetailStr`, NCCL's
`CUDACHECK`/`CUCHECK`/`ncclCalloc` warnings; ATen/cuda/Exceptions.h `TORCH_CUDABLAS_CHECK`,
`AT_CUDNN_CHECK`; c10/cuda `C10_CUDA_CHECK`), and go through what the worker does with an exception
(`memory_watch.is_out_of_memory`, `explained`, `fatal.record`), then what a restart and the launcher
read back. The CUDA budget runs the real `memory_verdict` with torch.cuda's queries answered here.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from run_helpers import mlp_recipe

from trainkit.doctor.resources import mem_get_info_in_a_process_of_its_own as REAL_MEM_GET_INFO_ELSEWHERE

GiB = 1 << 30
NCCL_VERSION = "NCCL version 2.30.7"


def nccl_error(result: str, interpret: str, last_error: str) -> dist.DistBackendError:
    """The DistBackendError `C10D_NCCL_CHECK` throws: "NCCL error in: FILE:LINE, <ncclGetErrorString>,
    NCCL version ...\\n<getNcclErrorDetailStr>" (its interpretation, then NCCL's last WARN)."""
    return dist.DistBackendError(
        f"NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3147, {result}, {NCCL_VERSION}\n"
        f"{interpret}\nLast error:\n{last_error}")


UNHANDLED_CUDA = ("unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
                  "ncclUnhandledCudaError: Call to CUDA function failed.")
SYSTEM = ("unhandled system error (run with NCCL_DEBUG=INFO for details)",
          "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ")


def accelerator_error(message: str, code: int) -> torch.AcceleratorError:
    """What `C10_CUDA_CHECK` raises into Python: the message, and the CUDA error code as `error_code`
    (torch/csrc/Exceptions.cpp `_new_accelerator_error_object`)."""
    exc = torch.AcceleratorError(message)
    exc.error_code = code
    return exc


CUDA_HINT = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
             "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1")

OUT_OF_MEMORY = [
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Cuda failure 2 'out of memory'"),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-cumem"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Cuda failure 'out of memory'"),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-cudart"),
    pytest.param(nccl_error(*SYSTEM, "Failed to malloc 8388608 bytes"),
                 "NCCL communicator set-up ran out of host memory", id="nccl-malloc"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Failed to CUDA host alloc 4923392 bytes"),
                 "NCCL communicator set-up ran out of host memory", id="nccl-pinned"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Failed to CUDA calloc 33554432 bytes"),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-calloc"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Failed to CUDA calloc async 4194304 bytes"),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-calloc-async"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Failed to CUDA malloc 9633792 bytes"),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-malloc-gpu"),
    pytest.param(nccl_error(*UNHANDLED_CUDA, "Failed to bind NVLink SHARP (NVLS) Multicast memory of size "
                                             "1073741824 : CUDA error 2 'out of memory'."),
                 "NCCL communicator set-up ran out of GPU memory", id="nccl-nvls"),
    pytest.param(accelerator_error("CUDA error: out of memory" + CUDA_HINT, 2),
                 "a CUDA call outside the caching allocator ran out of memory", id="accelerator"),
    pytest.param(RuntimeError("CUDA error: out of memory when calling `cusparseCreate(handle)`"),
                 "a CUDA call outside the caching allocator ran out of memory", id="cusparse"),
    pytest.param(RuntimeError("CUDA driver error: out of memory"),
                 "a CUDA call outside the caching allocator ran out of memory", id="driver-api"),
    pytest.param(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
                 "cuBLAS could not allocate GPU memory", id="cublas"),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
                 "cuDNN could not allocate GPU memory", id="cudnn-device"),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"), "cuDNN could not allocate memory",
                 id="cudnn-legacy"),
    pytest.param(RuntimeError("CUDA error: CUSOLVER_STATUS_ALLOC_FAILED when calling `cusolverDnCreate(handle)`"),
                 "cuSOLVER could not allocate GPU memory", id="cusolver"),
    pytest.param(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."),
                 "the CUDA caching allocator ran out of GPU memory", id="caching-allocator"),
]

NOT_OUT_OF_MEMORY = [
    pytest.param(dist.DistBackendError(
        "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."), id="nccl-timeout"),
    pytest.param(nccl_error("remote process exited or there was a network error",
                            "ncclRemoteError: A call failed possibly due to a network error or a remote process "
                            "exiting prematurely.", "socketProgress: Connection closed by remote peer"),
                 id="nccl-remote"),
    pytest.param(nccl_error(*SYSTEM, "nvmlDeviceGetHandleByPciBusId() failed: Not Found"), id="nccl-nvml"),
    pytest.param(accelerator_error("CUDA error: an illegal memory access was encountered" + CUDA_HINT, 700),
                 id="illegal-access"),
    pytest.param(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm(...)`"),
                 id="cublas-execution"),
    pytest.param(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                              "non-contiguous input."), id="cudnn-unsupported"),
    pytest.param(RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"),
                 id="cublas-create-no-device"),  # here mem_get_info cannot say: not read as out of memory
]


@pytest.fixture
def watch(tmp_path, monkeypatch):
    """This process as a worker's rank 0 in step 3: the record `explained` reads."""
    from trainkit.runtime import memory_watch

    monkeypatch.setattr(memory_watch, "_watch", None)
    memory_watch.start(tmp_path, 0, torch.device("cpu"))
    memory_watch.phase("step 3")
    yield memory_watch
    os.close(memory_watch._watch.fd)


def worker_handles(memory_watch, run_dir, exc: BaseException) -> BaseException:
    """What worker.main does with a failure (trainkit/runtime/worker.py): raised and caught, then explained
    and recorded as fatal when it is an out of memory."""
    from trainkit.runtime import fatal

    try:
        raise exc
    except Exception as caught:
        if memory_watch.is_out_of_memory(caught):
            caught = memory_watch.explained(caught)
            fatal.record(run_dir, caught)
        return caught


@pytest.mark.parametrize("exc, kind", OUT_OF_MEMORY)
def test_gpu_out_of_memory_outside_the_caching_allocator_is_reported_and_stops_restarts(tmp_path, watch, exc, kind):
    from trainkit.launch import oom
    from trainkit.run_dir import read_fatal
    from trainkit.runtime.fatal import NonRetryableError, raise_if_restart_would_repeat

    assert watch.out_of_memory_kind(exc).startswith(kind)
    reported = worker_handles(watch, tmp_path, exc)
    assert isinstance(reported, watch.OutOfMemory)
    text = str(reported)
    assert text.startswith("out of memory on rank 0 during step 3: peak ") and f"); {kind}" in text, text
    assert f"{type(exc).__name__}: {str(exc).splitlines()[0]}" in text
    fatal = read_fatal(tmp_path)  # the launcher's explanation and plan advice, and restarts stop
    assert oom.is_out_of_memory(fatal) and kind in fatal["message"]
    with pytest.raises(NonRetryableError, match=kind):
        raise_if_restart_would_repeat(tmp_path, tmp_path / "checkpoints")


@pytest.mark.parametrize("exc", NOT_OUT_OF_MEMORY)
def test_other_gpu_and_nccl_failures_are_not_out_of_memory(tmp_path, watch, exc):
    from trainkit.run_dir import read_fatal

    assert watch.out_of_memory_kind(exc) is None and not watch.is_out_of_memory(exc)
    assert worker_handles(watch, tmp_path, exc) is exc
    assert read_fatal(tmp_path) is None


# --------------------------------------------------------------------------- the plan's CUDA budget
class FakeGpus:
    """torch.cuda's answers for a node with these GPUs (total, used by other processes)."""

    def __init__(self, monkeypatch, gpus: list[tuple[int, int]], nvml: bool = True):
        from trainkit.doctor import resources

        self.gpus, self.asked_free, self.asked_elsewhere = gpus, [], []
        monkeypatch.setattr(resources, "mem_get_info_in_a_process_of_its_own", self.mem_get_info_elsewhere)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i: SimpleNamespace(total_memory=gpus[i][0], name="NVIDIA H100 80GB HBM3"))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
        monkeypatch.setattr(torch.cuda, "device_memory_used", self.used if nvml else self.no_nvml)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)

    def used(self, i):
        return self.gpus[i][1]

    @staticmethod
    def no_nvml(i):
        raise ModuleNotFoundError("nvidia-ml-py does not seem to be installed or it can't be imported.")

    def mem_get_info(self, i):  # cudaMemGetInfo: makes a CUDA context on device i in the caller
        self.asked_free.append(i)
        total, used = self.gpus[i]
        return total - used, total

    def mem_get_info_elsewhere(self, indices):  # the same, in one child process whose contexts end with it
        self.asked_elsewhere.append(list(indices))
        return {i: (self.gpus[i][0] - self.gpus[i][1], self.gpus[i][0]) for i in indices}


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "mem_get_info"])
def test_the_plans_cuda_budget_is_the_memory_free_at_launch_on_the_fullest_gpu(tmp_path, monkeypatch, nvml):
    from trainkit.doctor.resources import memory_verdict
    from trainkit.recipe import resolve

    total = 80 * GiB
    gpus = FakeGpus(monkeypatch, [(total, 1 * GiB), (total, 30 * GiB), (total, 2 * GiB)], nvml=nvml)
    recipe = resolve(mlp_recipe(tmp_path, "gpu-budget", launch={"nproc_per_node": 2, "backend": "nccl"})).recipe
    verdict = memory_verdict(recipe)
    assert verdict is not None and verdict.plan.setting.device_type == "cuda"
    assert verdict.budget == 50 * GiB  # cuda:1's free, not the 80 GiB total (cuda:2 is not this node's)
    assert verdict.budget_how == ("50.0 GiB free of 80.0 GiB on NVIDIA H100 80GB HBM3 (cuda:1, the least free of "
                                  "the 2 this node's ranks take)")
    assert gpus.asked_free == []  # the launcher makes no CUDA context of its own
    assert gpus.asked_elsewhere == ([] if nvml else [[0, 1]])  # without NVML one child process asks CUDA


def test_on_a_gpu_split_into_mig_instances_nvmls_whole_gpu_figures_are_not_the_budget(tmp_path, monkeypatch):
    """A MIG slice of 20 GiB on a GPU whose other tenants use 60 GiB: NVML's used memory is the whole
    GPU's (under the slice's total, so it looks plausible); the budget is the slice's own free memory,
    from cudaMemGetInfo in a child process."""
    import pynvml

    from trainkit.doctor.resources import memory_verdict
    from trainkit.recipe import resolve

    gpus = FakeGpus(monkeypatch, [(20 * GiB, 2 * GiB)])
    monkeypatch.setattr(torch.cuda, "device_memory_used", lambda i: 15 * GiB)  # the parent GPU's tenants
    monkeypatch.setattr(torch.cuda, "_get_nvml_device_index", lambda i: i)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: f"handle{i}")
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMigMode", lambda handle: (pynvml.NVML_DEVICE_MIG_ENABLE, 1))
    recipe = resolve(mlp_recipe(tmp_path, "mig", launch={"nproc_per_node": 1, "backend": "nccl"})).recipe
    assert memory_verdict(recipe).budget == 18 * GiB and gpus.asked_elsewhere == [[0]] and gpus.asked_free == []


@pytest.mark.slow
def test_where_no_process_can_read_the_free_memory_the_budget_is_the_total_said_as_such(tmp_path, monkeypatch):
    """The child process really runs (this machine has no CUDA, so cudaMemGetInfo fails there) and the
    budget falls back to the device's total, worded so."""
    from trainkit.doctor import resources

    FakeGpus(monkeypatch, [(80 * GiB, 10 * GiB)], nvml=False)
    monkeypatch.setattr(resources, "mem_get_info_in_a_process_of_its_own", REAL_MEM_GET_INFO_ELSEWHERE)
    assert resources.mem_get_info_in_a_process_of_its_own([0]) == {}
    budget, how = resources.cuda_budget(1)
    assert budget == 80 * GiB and how == "80.0 GiB on NVIDIA H100 80GB HBM3 (free memory unknown)"


def test_a_one_gpu_budget_says_free_of_total(tmp_path, monkeypatch):
    from trainkit.doctor.resources import memory_verdict
    from trainkit.recipe import resolve

    FakeGpus(monkeypatch, [(80 * GiB, 72 * GiB)])
    recipe = resolve(mlp_recipe(tmp_path, "one-gpu", launch={"nproc_per_node": 1, "backend": "nccl"})).recipe
    verdict = memory_verdict(recipe)
    assert verdict.budget == 8 * GiB and verdict.budget_how == "8.0 GiB free of 80.0 GiB on NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("free, out_of_memory", [(100 << 20, True), (40 * GiB, False)], ids=["nearly-full", "free"])
def test_cublas_failing_to_create_its_handle_is_out_of_memory_only_with_the_gpu_nearly_full(watch, monkeypatch, free,
                                                                                            out_of_memory):
    """cuBLAS says NOT_INITIALIZED, not ALLOC_FAILED, when cublasCreate finds no GPU memory; a broken CUDA
    context says the same. The rank's free device memory at that moment (cudaMemGetInfo) decides."""
    exc = RuntimeError("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * GiB))
    kind = watch.out_of_memory_kind(exc)
    assert (kind is not None) == out_of_memory
    if out_of_memory:
        assert kind.startswith("cuBLAS could not create its handle with the GPU nearly full")


def test_a_recipe_that_fits_but_for_the_plans_nccl_upper_estimate_is_warned_not_refused(tmp_path, monkeypatch):
    """NCCL's line is an NVSwitch node's cost (docs/memory.md): on a GPU with less free memory than the plan
    but more than the plan without that line, the doctor warns (naming NCCL's variables) instead of
    refusing the run; with less than that it refuses as before."""
    from trainkit.doctor.resources import memory, memory_verdict
    from trainkit.recipe import resolve

    resolved = resolve(mlp_recipe(tmp_path, "nccl-tight", launch={"nproc_per_node": 2, "backend": "nccl"}))
    total = 80 * GiB
    FakeGpus(monkeypatch, [(total, 0), (total, 0)])
    plan = memory_verdict(resolved.recipe).plan
    nccl = sum(p.bytes for p in plan.parts if p.name == "NCCL buffers")
    assert nccl > 0
    FakeGpus(monkeypatch, [(total, total - (plan.per_rank - nccl // 2))] * 2)
    check = memory(resolved)
    assert check.status == "warn" and "it fits without the plan's NCCL buffers" in check.detail, check
    assert "NCCL_NVLS_ENABLE=0" in check.fix
    FakeGpus(monkeypatch, [(total, total - (plan.per_rank - nccl - GiB))] * 2)
    assert memory(resolved).status == "fail"
