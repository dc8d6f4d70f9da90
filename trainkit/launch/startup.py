"""Start-up hangs of a multi-node launch, bounded and named: an endpoint this node cannot reach
(a wrong launch.rdzv_endpoint / MASTER_ADDR, a firewall, node 0 not started) and a rendezvous that
does not gather every node within launch.join_timeout_s (torchrun's c10d `join_timeout`: a node
that was never started, died while joining, or names another endpoint or rdzv_id).

Why here: torch's c10d rendezvous retries a store it cannot reach for minutes, printing C++ stack
traces, and its timeout is a bare `RendezvousTimeoutError` that names nothing.
"""

from __future__ import annotations

import socket
import time
from typing import Optional

from ..recipe.schema import Recipe

RETRY_S = 1.0  # between connection attempts: nodes start in any order
CONNECT_TIMEOUT_S = 2.0
STORE_ANSWER_MIN_S = 5.0  # the store's handshake is given at least this long


def _endpoint(recipe: Recipe) -> Optional[tuple[str, int]]:
    la = recipe.launch
    if la.rdzv_endpoint is None or la.rdzv_backend != "c10d" or str(la.nnodes) in ("1", "1:1"):
        return None
    host, _, port = la.rdzv_endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _connect(host: str, port: int) -> Optional[str]:
    """None when `host`:`port` accepts a TCP connection, else why not."""
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            return None
    except socket.gaierror as exc:
        return f"{host} does not resolve ({exc.strerror})"
    except socket.timeout:
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__


def _store_silent(host: str, port: int, timeout_s: float) -> Optional[str]:
    """None when the TCPStore at host:port completes a client's handshake within `timeout_s`, else why
    not. A stopped process still has its socket accept connections (the kernel queues them), and
    torch's TCPStore client then waits past its own timeout (torch 2.14: measured 60 s and more with a
    3 s timeout), so torchrun's agent waited for ever and launch.join_timeout_s never fired. The
    handshake runs on a daemon thread (the client releases the GIL) bounded here; a thread left behind
    is stuck on a socket of a launch that ends now."""
    import threading
    from datetime import timedelta

    outcome: dict = {}

    def handshake() -> None:
        try:
            import torch.distributed as dist

            dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
            outcome["answered"] = True
        except Exception as exc:  # refused the handshake: not a store, or a store that failed
            outcome["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]

    probe = threading.Thread(target=handshake, name="trainkit-store-probe", daemon=True)
    probe.start()
    probe.join(timeout_s + 1.0)
    if outcome.get("answered"):
        return None
    if "error" in outcome:
        return f"its rendezvous store failed the handshake ({outcome['error']})"
    return f"its rendezvous store did not answer within {timeout_s:.0f} s"


def unreachable(recipe: Recipe, host_name: str) -> Optional[str]:
    """Wait up to launch.join_timeout_s for the rendezvous endpoint to accept a connection; None when
    it does (or there is no remote endpoint), else the message to stop with."""
    found = _endpoint(recipe)
    if found is None:
        return None
    host, port = found
    deadline = time.monotonic() + recipe.launch.join_timeout_s
    while True:
        why = _connect(host, port)
        if why is None:
            silent = _store_silent(host, port, max(STORE_ANSWER_MIN_S, deadline - time.monotonic()))
            if silent is None:
                return None
            return (f"not started: the rendezvous endpoint {host}:{port} (launch.rdzv_endpoint) accepts TCP "
                    f"connections from this node ({host_name}) but {silent}.\n  Likely: the process serving it "
                    f"is stopped (SIGSTOP, Ctrl-Z, a debugger) or hung -- often another job's `trainkit run` "
                    f"on that port -- or the port belongs to something that is not a rendezvous store.")
        remaining = deadline - time.monotonic()
        if remaining <= 0:  # a name that does not resolve yet is waited for too (a pod's DNS comes late)
            break
        time.sleep(min(RETRY_S, remaining))
    return (f"not started: the rendezvous endpoint {host}:{port} (launch.rdzv_endpoint) did not accept a "
            f"connection from this node ({host_name}) within launch.join_timeout_s "
            f"{recipe.launch.join_timeout_s} s: {why}.\n  Likely: a wrong address (it must be an address of "
            f"the node that serves the rendezvous, as this node reaches it), that node's `trainkit run` not "
            f"started, or a firewall blocking TCP port {port} between the nodes (`trainkit doctor` checks it).")


def rendezvous_failed(exc: BaseException, recipe: Recipe, host_name: str) -> Optional[str]:
    """The message for torch's rendezvous errors (timeout, closed), or None for any other error."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    la = recipe.launch
    if isinstance(exc, RendezvousTimeoutError):
        return (f"not started: the rendezvous at {la.rdzv_endpoint} (rdzv_id {la.rdzv_id or recipe.name}) did not "
                f"gather launch.nnodes {la.nnodes} nodes within launch.join_timeout_s {la.join_timeout_s} s; this "
                f"node ({host_name}) joined, at least one node is missing.\n  Likely: `trainkit run` was not "
                f"started on the missing node, or it died while joining (its console says why), or it names "
                f"another launch.rdzv_endpoint or rdzv_id, or it cannot reach {la.rdzv_endpoint} (a firewall: "
                f"`trainkit doctor` on that node checks it).")
    if isinstance(exc, RendezvousClosedError):
        return (f"not started: the rendezvous at {la.rdzv_endpoint} was closed by another node (it stopped or "
                f"failed; its console says why)")
    return None
