"""Where a rank's memory peaks inside a step: with PROBE_PHASES=1 and this folder on PYTHONPATH, every
torchrun worker prints its VmRSS and VmHWM (MiB) on entering and leaving DeepSpeed ZeRO-1/2's phases
(backward's bucket copies, the reduce, the optimizer step) and torch's backward and AdamW step.
Used for docs/benchmarks.md, "Where a step peaks"; a diagnostic, not part of trainkit:

    PROBE_PHASES=1 PYTHONPATH=bench/phase_probe trainkit run RECIPE 2>&1 | grep PROBE
"""
import os

if os.environ.get("PROBE_PHASES") and os.environ.get("LOCAL_RANK") is not None:
    import sys

    def _mib() -> dict:
        out = {}
        with open("/proc/self/status") as status:
            for line in status:
                key, value = line.split(":", 1)
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) // 1024
        return out

    def _say(what: str) -> None:
        print(f"PROBE rank {os.environ.get('RANK')} {what}: {_mib()}", file=sys.stderr, flush=True)

    def _wrap(owner, name: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return

        def probed(*args, **kwargs):
            _say(f"{name} enter")
            out = original(*args, **kwargs)
            _say(f"{name} exit")
            return out

        setattr(owner, name, probed)

    import torch.autograd
    import torch.optim

    _wrap(torch.autograd, "backward")
    _wrap(torch.optim.AdamW, "step")
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except ImportError:
        DeepSpeedZeroOptimizer = None
    if DeepSpeedZeroOptimizer is not None:
        for phase in ("average_tensor", "copy_grads_in_partition", "step", "_optimizer_step"):
            _wrap(DeepSpeedZeroOptimizer, phase)
