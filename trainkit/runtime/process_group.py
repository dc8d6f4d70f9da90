"""Joining the process group without opening more to the network than the job needs.

`init_process_group` with the env:// rendezvous makes rank 0 serve a TCPStore, and torch's store
listens on every interface, unauthenticated. A world-size-1 run (the worker inside `trainkit run`)
has nobody to meet: it uses an in-memory HashStore, so the trainkit process listens on no port at
all. Runs of several processes meet through torchrun's stores (docs/security.md says what those
expose).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_process_group(backend: str, *, timeout: timedelta) -> None:
    """`dist.init_process_group` for this process, from torchrun's (or the launcher's) environment."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and int(os.environ.get("RANK", "0")) == 0:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend, timeout=timeout)
