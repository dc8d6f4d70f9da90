"""Joining the process group without opening more to the network than the job needs.

`init_process_group` with the env:// rendezvous makes rank 0 serve a TCPStore, and torch's store
listens on every interface, unauthenticated, whatever MASTER_ADDR says. So rank 0 binds the socket
itself, on exactly MASTER_ADDR (loopback for a run on one node: the launcher passes torchrun
`--local-addr`, see `trainkit.launch.rendezvous_store`), and hands it to the store
(`TCPStore(master_listen_fd=...)`, torch's own way to choose the address); the other ranks connect.
A world-size-1 run (the worker inside `trainkit run`) has nobody to meet: it uses an in-memory
HashStore, so the trainkit process listens on no port at all.

Under TORCH_DISTRIBUTED_DEBUG=DETAIL (`launch.debug_collectives`), torch wraps the group in its
ProcessGroupWrapper, which checks every collective's op, shapes and dtypes across the ranks. DDP's
logger then casts a group named "gloo" to ProcessGroupGloo, which the wrapper is not, and the rank
segfaults in DDP's constructor (torch 2.14.1, plain torch reproduces it): so gloo joins under
another name (`GLOO_UNDER_DETAIL`, the same ProcessGroupGloo, still wrapped and checked by torch).
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import ProcessGroupGloo

from .listen import bound_socket

GLOO_UNDER_DETAIL = "gloo_checked"


def init_process_group(backend: str, *, timeout: timedelta) -> None:
    """`dist.init_process_group` for this process, from torchrun's (or the launcher's) environment."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    backend = checked_backend(backend)
    if world_size == 1 and rank == 0:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # the agent serves it (static rendezvous)
        dist.init_process_group(backend, timeout=timeout)
        return
    store = master_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def checked_backend(backend: str) -> str:
    """`backend`, or under torch's DETAIL debug level gloo by another name (see the module's docstring)."""
    if backend != "gloo" or dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return backend
    if GLOO_UNDER_DETAIL.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(GLOO_UNDER_DETAIL, _gloo, devices=["cpu"])
    return GLOO_UNDER_DETAIL


def _gloo(store, rank: int, size: int, timeout: timedelta) -> ProcessGroupGloo:
    return ProcessGroupGloo(store, rank, size, timeout=timeout)


def master_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The job's store at `address`:`port`: served by rank 0 on exactly that address, joined by the others."""
    if rank != 0:
        return dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    sock = bound_socket(address, port)
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())
