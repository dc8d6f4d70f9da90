"""What NCCL's start events cost (TORCH_NCCL_ENABLE_TIMING=1, which the launcher sets under NCCL so
that the Flight Recorder can say a collective `started` on a GPU: docs/running.md, "When a run
hangs"), side by side on one GPU:

    python bench/nccl_timing_overhead.py --pairs 9

One process, one GPU, two one-rank NCCL process groups made alike but for the variable
(ProcessGroupNCCL reads it when a group is made): "with" records a start event per collective and
has its watchdog compute each one's duration, "without" does not. Each pair runs a block on each
group, the order alternating: --collectives all-reduces of --numel floats (the test MLP's one DDP
bucket by default) enqueued back to back and then waited for, timed from the host. Reported: the
median time per collective of each side, the per-pair ratio with / without, median (min-max), and
the median difference per collective (to set against a step: a step of N collectives pays N times
it at most). One rank measures the per-collective cost on the host and the stream; it does not
measure a multi-GPU collective's network time, which the events do not change.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def block(group, tensor, collectives: int) -> float:
    """Seconds per collective for `collectives` all-reduces on `group`, enqueued then waited for."""
    import torch
    import torch.distributed as dist
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(collectives):
        dist.all_reduce(tensor, group=group)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--collectives", type=int, default=500)
    parser.add_argument("--numel", type=int, default=7556)
    args = parser.parse_args()
    import torch
    import torch.distributed as dist
    if not torch.cuda.is_available():
        raise SystemExit("nccl_timing_overhead: needs a CUDA device")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    torch.cuda.set_device(0)
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "0"
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    groups = {"without": dist.new_group([0], backend="nccl")}
    os.environ["TORCH_NCCL_ENABLE_TIMING"] = "1"
    groups["with"] = dist.new_group([0], backend="nccl")
    tensor = torch.ones(args.numel, device="cuda")
    for group in groups.values():  # communicators made, kernels loaded
        block(group, tensor, 50)
    times: dict[str, list[float]] = {"with": [], "without": []}
    for pair in range(args.pairs):
        for side in (("with", "without") if pair % 2 == 0 else ("without", "with")):
            times[side].append(block(groups[side], tensor, args.collectives))
    ratios = [w / wo for w, wo in zip(times["with"], times["without"])]
    differences = [w - wo for w, wo in zip(times["with"], times["without"])]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {args.pairs} alternated pairs of "
          f"{args.collectives} all-reduces of {args.numel} floats on a one-rank NCCL group")
    for side in ("without", "with"):
        print(f"  TORCH_NCCL_ENABLE_TIMING={'1' if side == 'with' else '0'}: "
              f"{statistics.median(times[side]) * 1e6:.2f} us per collective (median)")
    print(f"  ratio with / without: {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    print(f"  added per collective: {statistics.median(differences) * 1e6:.2f} us "
          f"({min(differences) * 1e6:.2f} to {max(differences) * 1e6:.2f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
