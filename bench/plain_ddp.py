"""The textbook torchrun DDP script trainkit is measured against (bench/overhead.py framework):
DistributedSampler, DDP, AdamW, cross-entropy, a loss print every N steps. Same model and data
(imported from trainkit so both sides compute exactly the same thing); the loop is hand-written."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from trainkit.models import mlp
from trainkit.runtime import host_allocator
from trainkit.runtime.data import SyntheticDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--model", default="{}")
    p.add_argument("--out", required=True)
    p.add_argument("--compile", action="store_true", help="DDP(torch.compile(model)): the order that compiles")
    p.add_argument("--compile-in-place", action="store_true",
                   help="model.compile() then DDP(model): how trainkit compiles (same parameter names)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="pass DDP an explicit bucket_cap_mb (None: torch's default, 25 MiB with a 1 MiB first bucket)")
    p.add_argument("--host-allocator", choices=["system", "retain"], default="system",
                   help="retain: glibc keeps freed host memory, as trainkit's performance.host_allocator "
                        "(auto) does on the CPU -- to measure the framework with the allocator equal")
    args = p.parse_args()
    host_allocator.apply(args.host_allocator)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = mlp(**json.loads(args.model))
    if args.compile_in_place:
        net.compile()
    model = DDP(torch.compile(net) if args.compile else net, bucket_cap_mb=args.bucket_cap_mb)
    data = SyntheticDataset(8192, [3, 32, 32], 10, seed=0)  # the same data trainkit's `synthetic` makes
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    # the recipe's optimizer exactly: trainkit's `adamw` defaults to weight_decay 0.0 (torch's AdamW to 0.01,
    # which adds a pass over every parameter and changes the trajectory)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    loss_fn = torch.nn.CrossEntropyLoss()
    times, step, first = {}, 0, None
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            first = first or time.time()
            if step % args.log_every == 0 or step == args.steps:
                dist.all_reduce(loss.detach())
                if rank == 0:
                    print(f"step {step} loss {loss.item() / dist.get_world_size():.4f}", flush=True)
                times[step] = time.time()
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"times": times, "first_step_at": first}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
