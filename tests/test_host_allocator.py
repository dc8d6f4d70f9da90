"""`performance.host_allocator`: on the CPU, freed tensors' memory is kept for reuse instead of being
faulted in again every step (runtime/host_allocator.py says why)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from trainkit.runtime import host_allocator

# A CPU training step in trainkit's order (forward, backward, optimizer step, zero_grad(set_to_none) --
# the gradients are freed after every step and allocated again by the next backward), on the overhead
# bench's MLP shape (3072 -> 2048 x3 -> 10, 14M parameters: 24/16 MiB gradients and AdamW temporaries).
STEPS = textwrap.dedent("""
    import ctypes, sys, torch
    from trainkit.runtime import host_allocator
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, as the counts assume
    print(host_allocator.apply(sys.argv[1]))
    torch.manual_seed(0)
    layers = [torch.nn.Flatten(), torch.nn.Linear(3072, 2048), torch.nn.ReLU()]
    layers += [torch.nn.Linear(2048, 2048), torch.nn.ReLU()] * 2 + [torch.nn.Linear(2048, 10)]
    net = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    def step():
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(6):
        step()
    before = host_allocator.minor_faults()
    for _ in range(6):
        step()
    print((host_allocator.minor_faults() - before) / 6)
""")


def clean_env() -> dict:
    """The environment without malloc settings of the caller's (they would change the baseline)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")} | {"OMP_NUM_THREADS": "1"}


def probe(script: str, policy: str) -> tuple[str, float]:
    """Run a probe script in a fresh process under `policy`: (what apply() reported, the figure it printed)."""
    res = subprocess.run([sys.executable, "-c", script, policy], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert res.returncode == 0, res.stderr
    applied, figure = res.stdout.strip().splitlines()
    return applied, float(figure)


@pytest.mark.slow
@pytest.mark.skipif(not host_allocator.is_glibc(), reason="mallopt is glibc's")
def test_retain_stops_the_kernel_refaulting_each_steps_tensors():
    """Guards that `retain` really changes what glibc does (remove the mallopt calls and the two
    figures are alike): with the system's settings every step's freed gradients and optimizer
    temporaries go back to the kernel and their pages fault in again at the next step (thousands of
    pages per step at this size); with `retain` they are reused from the heap. Measured as the
    process's minor page faults over 6 steps after 6 warm-up steps, each policy in a fresh process."""
    applied_system, system = probe(STEPS, "system")
    applied_retain, retain = probe(STEPS, "retain")
    assert (applied_system, applied_retain) == ("system", "retain")
    # thousands of pages per step: 4,500-6,500 seen on this machine (the heap's state varies by run)
    assert system > 2000, f"the probe should show the problem: {system:.0f} faults/step with system malloc"
    assert retain < system / 5, f"retain: {retain:.0f} faults/step, system: {system:.0f}"


# 20 freed 4 MiB blocks with a live 64 KiB tensor after each: in the heap they cannot be trimmed
RELEASE = textwrap.dedent("""
    import ctypes, sys, torch
    from trainkit.runtime import host_allocator
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
    print(host_allocator.apply(sys.argv[1]))
    def rss():
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    warm = torch.ones(1 << 20)
    del warm  # freeing an mmap'd 4 MiB block raises glibc's dynamic threshold past it
    base = rss()
    big, small = [], []
    for _ in range(20):
        big.append(torch.ones(1 << 20))
        small.append(torch.ones(16 << 10))
    del big
    print((rss() - base) / 2**20)
""")


@pytest.mark.slow
@pytest.mark.skipif(not host_allocator.is_glibc(), reason="mallopt is glibc's")
def test_release_gives_freed_blocks_back_to_the_kernel():
    """Guards that `release` really lowers resident memory (FSDP's and DeepSpeed's CPU default): after 80 MiB of
    4 MiB tensors are freed with small tensors still alive between them, the system's settings keep
    them resident (they were served from the heap, which cannot shrink past the live blocks);
    `release` served them with mmap and unmapped them at free. Resident memory from /proc/self/status."""
    (applied_system, system), (applied_release, release) = probe(RELEASE, "system"), probe(RELEASE, "release")
    assert (applied_system, applied_release) == ("system", "release")
    assert system > 60, f"the probe should show retained memory: {system:.1f} MiB with system malloc"
    assert release < 10, f"release kept {release:.1f} MiB of the 80 MiB freed"


def test_auto_is_the_strategys_choice_on_the_cpu_and_system_on_gpus():
    """On a GPU the tensors live in CUDA's caching allocator and the host is left as the system sets it;
    on the CPU each strategy names the policy measured best for it (bench/strategies_memory.py)."""
    assert host_allocator.resolve("auto", "cpu") == "retain"
    assert host_allocator.resolve("auto", "cpu", cpu_default="release") == "release"
    assert host_allocator.resolve("auto", "cuda", cpu_default="release") == "system"
    assert host_allocator.resolve("system", "cpu") == "system"
    assert host_allocator.resolve("retain", "cuda", cpu_default="release") == "retain"
    with pytest.raises(ValueError, match="not one of auto, retain, release, system"):
        host_allocator.resolve("jemalloc", "cpu")


def test_each_built_in_strategy_gets_the_policy_measured_for_it():
    """A recipe's `auto` goes to its strategy class (for_recipe, what the worker applies): DDP and the
    pipeline re-allocate the same tensors each step (retain: fast); FSDP's and DeepSpeed's own buffers
    fragment a retained heap (peak RSS 2x FSDP's, +1.1 GiB ZeRO-2's: release). Fails if a class loses its
    choice or the lookup stops reaching the class."""
    from types import SimpleNamespace

    from trainkit.recipe.blocks import DDPOptions, DeepSpeedOptions, FSDPOptions, PerformanceOptions, PipelineOptions

    def policy(strategy, device="cpu", **performance):
        recipe = SimpleNamespace(strategy=strategy, performance=PerformanceOptions(**performance))
        return host_allocator.for_recipe(recipe, device)

    assert policy(DDPOptions(name="ddp")) == "retain"
    assert policy(PipelineOptions(name="pipeline")) == "retain"
    assert policy(FSDPOptions(name="fsdp")) == "release"
    assert policy(DeepSpeedOptions(name="deepspeed", zero_stage=2)) == "release"
    assert policy(FSDPOptions(name="fsdp"), "cuda") == "system"
    assert policy(FSDPOptions(name="fsdp"), host_allocator="retain") == "retain"  # the recipe's word wins


class RecordingLibc:
    """Stands in for glibc in-process (a real mallopt here would change the test process's malloc):
    records each mallopt call and refuses the values in `refuse`."""

    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if (param, value) in self.refuse else 1


def test_each_policy_sets_what_its_docs_say(monkeypatch):
    """release: blocks >= 1 MiB mmap'd, glibc's 128 KiB trim threshold fixed; retain: 1 GiB of both, and
    32 MiB blocks where a glibc refuses 1 GiB (the summary then says so)."""
    monkeypatch.setattr(host_allocator, "_applied", None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    libc = RecordingLibc()
    monkeypatch.setattr(host_allocator, "_glibc", lambda: libc)
    assert host_allocator.apply("release") == "release"
    assert libc.calls == [(host_allocator.M_MMAP_THRESHOLD, 1 << 20), (host_allocator.M_TRIM_THRESHOLD, 128 << 10)]

    monkeypatch.setattr(host_allocator, "_applied", None)
    libc = RecordingLibc(refuse={(host_allocator.M_MMAP_THRESHOLD, 1 << 30)})
    monkeypatch.setattr(host_allocator, "_glibc", lambda: libc)
    assert host_allocator.apply("retain") == "retain (blocks up to 32 MiB)"
    assert libc.calls[-2:] == [(host_allocator.M_MMAP_THRESHOLD, 32 << 20), (host_allocator.M_TRIM_THRESHOLD, 1 << 30)]


def test_what_cannot_be_set_is_reported_not_claimed(monkeypatch):
    """The summary never says `retain` when it is not in effect: not glibc, a preloaded allocator that
    replaces malloc, or an earlier run in the same process that set another policy (no undo in glibc)."""
    monkeypatch.setattr(host_allocator, "_applied", None)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.setattr(host_allocator, "_glibc", lambda: None)
    assert host_allocator.apply("retain") == "system (retain needs glibc's mallopt; this C library is not glibc)"

    libc = RecordingLibc()
    monkeypatch.setattr(host_allocator, "_glibc", lambda: libc)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert host_allocator.apply("retain").startswith("system (jemalloc is preloaded")
    assert libc.calls == []

    monkeypatch.delenv("LD_PRELOAD")
    assert host_allocator.apply("retain") == "retain"
    assert host_allocator.apply("system") == "retain (set earlier in this process; glibc cannot restore its defaults)"
    assert host_allocator.apply("release").startswith("retain (set earlier")
