"""The rendezvous store of a launch, listening on the one address the job needs.

torchrun's agent meets the other agents through a c10d TCPStore, and torch's TCPStore server listens
on every interface whatever host name it is given (unauthenticated). torch's own way to choose the
address is a socket the caller binds and hands over (`TCPStore(master_listen_fd=...)`), and its c10d
rendezvous joins a store someone else serves when told `is_host=0`. So trainkit binds the socket:

* one node: on loopback, at a free port, and the agent meets its own workers there;
* several nodes (c10d rendezvous): on the address `launch.rdzv_endpoint` names, by the agent of the
  node that owns that address (the others, and a second agent of the same machine, join it).

`--local-addr` tells torchrun the address its workers' own store (rank 0's, MASTER_ADDR) must use:
loopback on one node, else this node's address on the route to the endpoint
(`trainkit.runtime.process_group` binds exactly that address). gloo's ranks also listen, pairwise, on
the address the host name resolves to; on one node they are given the loopback interface
(GLOO_SOCKET_IFNAME, unless the user set it).
"""

from __future__ import annotations

import dataclasses
import errno
import socket
import uuid
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional, Sequence

from ..recipe.schema import Recipe
from ..runtime.listen import bound_socket

LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = timedelta(seconds=60)  # torch's c10d rendezvous read timeout


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where this launch's agents meet, and the torchrun flags that say so."""

    endpoint: str  # HOST:PORT of the store torchrun's agent joins
    local_addr: str  # this node's address for the workers' store (MASTER_ADDR of node 0)
    gloo_interface: Optional[str] = None  # one node: the loopback interface, for gloo's own pair sockets
    run_id: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))  # one node's rendezvous id, as --standalone

    def torchrun_command(self, command: Sequence[str]) -> list[str]:
        """`command` (launch_plan.torchrun_command) made to join this store instead of starting one."""
        out, conf = [], ["is_host=0"]
        for word in command:
            if word.startswith("--rdzv-conf="):  # torchrun reads one --rdzv-conf: is_host joins the recipe's
                conf.append(word.split("=", 1)[1])
            elif word == "--standalone":  # one node: the store trainkit serves on loopback
                out += ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}"]
            elif word == "-m":  # the options end where the worker module begins
                out += [f"--rdzv-conf={','.join(conf)}", f"--local-addr={self.local_addr}", word]
            else:
                out.append(word)
        return out


def serve_store(sock: socket.socket):
    """torch's TCPStore server on the already bound `sock` (the store owns the socket from now on)."""
    import torch.distributed as dist

    address, port = sock.getsockname()[:2]
    return dist.TCPStore(address, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=STORE_TIMEOUT, master_listen_fd=sock.detach())


def _endpoint_addresses(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(sockaddr[0] for *_, sockaddr in infos))


def _route_address(address: str, port: int) -> str:
    """This node's own address on the route to `address` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))
        return probe.getsockname()[0]


@contextmanager
def served(recipe: Recipe) -> Iterator[Optional[Rendezvous]]:
    """The rendezvous of a launch of several processes, its store served from this process for as
    long as the block runs when this node hosts it. None where torch's rendezvous keeps its own store
    (the static backend: its node 0 creates the store itself; docs/security.md)."""
    la = recipe.launch
    if la.rdzv_endpoint is None:  # one node: torchrun --standalone would listen on every interface
        with _serving(bound_socket(LOOPBACK, 0)) as port:
            yield Rendezvous(f"{LOOPBACK}:{port}", LOOPBACK, _interface_of(LOOPBACK))
        return
    if la.rdzv_backend != "c10d":
        yield None
        return
    host, _, port_text = la.rdzv_endpoint.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    try:
        addresses = _endpoint_addresses(host, port)
        local_addr = _route_address(addresses[0], port)
    except OSError:  # not resolvable from here (yet): torch's rendezvous says so, or retries, as before
        yield None
        return
    for address in addresses:
        try:
            sock = bound_socket(address, port)
        except OSError as exc:  # not this node's address, or another agent on this machine serves it
            if exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
                continue
            yield None  # e.g. a privileged port: torch's own rendezvous tries, and says why it cannot
            return
        with _serving(sock):
            yield Rendezvous(la.rdzv_endpoint, local_addr)
        return
    yield Rendezvous(la.rdzv_endpoint, local_addr)  # another agent serves it


def _interface_of(address: str) -> Optional[str]:
    """The name of the network interface holding `address` ('lo' for loopback on Linux)."""
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


@contextmanager
def _serving(sock: socket.socket) -> Iterator[int]:
    """Serve the store on `sock` while the block runs; yields its port."""
    port = sock.getsockname()[1]
    store = serve_store(sock)
    try:
        yield port
    finally:
        del store  # the server stops with its last reference
