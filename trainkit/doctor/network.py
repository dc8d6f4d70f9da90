"""Where the ranks meet: the rendezvous/master address resolves, its port is free on the host that
serves it and reachable from the others, and the socket interfaces named for NCCL/gloo exist."""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from dataclasses import dataclass
from typing import Optional

from ..processes import CLI
from .check import Check, failed, passed, warned

MASTER_PORT = 29500  # torchrun's --master-port default (static rendezvous, plain torch.distributed)
RDZV_PORT = 29400  # c10d rendezvous default port
CONNECT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    setting: str  # what the user edits to change it, e.g. "launch.rdzv_endpoint (recipe.yaml:12)"
    serves_here: bool  # this node is the one that binds the port (when the host is local)
    shared: bool  # several nodes: a busy local port may be this job's own store


def endpoint(resolved) -> Optional[Endpoint]:
    """The address this launch binds or connects to; None for a standalone launch, where torchrun
    binds a free port on localhost itself (MASTER_PORT is then not used)."""
    if resolved is None:
        return Endpoint(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", MASTER_PORT)),
                        "MASTER_ADDR / MASTER_PORT", True, False)
    la = resolved.recipe.launch
    if la.rdzv_endpoint is None:
        return None  # rules require an endpoint for several nodes, so this is torchrun --standalone
    host, _, port = la.rdzv_endpoint.rpartition(":")
    default = RDZV_PORT if la.rdzv_backend == "c10d" else MASTER_PORT
    if not host:
        host, port = la.rdzv_endpoint, ""
    where = f"launch.rdzv_endpoint ({resolved.locate(('launch', 'rdzv_endpoint'))})"
    serves = la.rdzv_backend == "c10d" or la.node_rank in (None, 0)
    return Endpoint(host.strip("[]"), int(port) if port.isdigit() else default, where, serves,
                    la.nnodes not in (1, "1", "1:1"))


def local_addresses() -> set[str]:
    import psutil

    out = {"127.0.0.1", "::1"}
    for addrs in psutil.net_if_addrs().values():
        out.update(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    return out


def _is_local(ip: str, mine: set[str]) -> bool:
    return ip in mine or ipaddress.ip_address(ip).is_loopback or ip in ("0.0.0.0", "::")


def _resolve(host: str) -> list[tuple[int, str]]:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return list(dict.fromkeys((family, sockaddr[0]) for family, _, _, _, sockaddr in infos))


def port_in_use(port: int, family: int = socket.AF_INET) -> Optional[str]:
    """None if a server could bind `port` on all interfaces (as TCPStore does), else why not."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like TCPStore: TIME_WAIT is no conflict
        try:
            s.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _listener(port: int) -> Optional[tuple[int, list[str]]]:
    """(pid, command line) of the process listening on `port`, when the OS tells us (own processes,
    or as root); command line [] when it cannot be read."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    return conn.pid, psutil.Process(conn.pid).cmdline()
                except psutil.Error:
                    return conn.pid, []
    except psutil.Error:
        pass
    return None


def _holder(port: int) -> str:
    """Which process listens on `port`, in words ('' when unknown)."""
    found = _listener(port)
    if found is None:
        return ""
    pid, cmdline = found
    return f" by pid {pid} ({' '.join(cmdline[:3])[:60]})" if cmdline else f" by pid {pid}"


# the programs or modules another node of the same job runs as (torchrun's agent, trainkit's launcher)
_JOB_PROGRAMS = frozenset({"torchrun", "trainkit", "torch.distributed.run", CLI})


def _foreign_listener(port: int) -> bool:
    """Whether a known process that cannot be a node of a trainkit/torchrun job holds `port`."""
    found = _listener(port)
    if found is None or not found[1]:
        return False  # unknown: it may be this job's store
    return not any(os.path.basename(part) in _JOB_PROGRAMS for part in found[1][:4])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_port(resolved) -> Check:
    """MASTER_ADDR (or the rendezvous host) resolves, and the port is free where it will be bound."""
    ep = endpoint(resolved)
    name = "master port"
    if ep is None:
        try:
            port = free_port()
        except OSError as exc:
            return failed(name, f"cannot bind a port on localhost: {exc}", "check the loopback interface (ip link set lo up)")
        ignored = f"; MASTER_PORT={os.environ['MASTER_PORT']} is not used" if "MASTER_PORT" in os.environ else ""
        return passed(name, f"standalone: torchrun binds a free localhost port (e.g. {port}){ignored}")
    try:
        addrs = _resolve(ep.host)
    except (socket.gaierror, UnicodeError) as exc:
        return failed(name, f"{ep.host} does not resolve ({getattr(exc, 'strerror', exc)})",
                      f"set {ep.setting} to a host name or IP every node can resolve (check DNS or /etc/hosts)")
    mine = local_addresses()
    local = [(f, ip) for f, ip in addrs if _is_local(ip, mine)]
    if not local:
        return passed(name, f"{ep.host}:{ep.port} is another host ({addrs[0][1]}); this node connects to it")
    if not ep.serves_here:
        return passed(name, f"{ep.host}:{ep.port} is this host, but node_rank 0 binds it, not this node")
    busy = port_in_use(ep.port, local[0][0])
    if busy is None:
        return passed(name, f"{ep.host} ({local[0][1]}) is this host; port {ep.port} is free")
    detail = f"port {ep.port} on {ep.host} is in use{_holder(ep.port)} ({busy})"
    spare = free_port()
    change = f"export MASTER_PORT={spare}" if resolved is None else f"{ep.setting.split(' (')[0]}={ep.host}:{spare}"
    fix = f"stop the process holding port {ep.port}, or pick a free port: {change}"
    if ep.shared and not _foreign_listener(ep.port):
        return warned(name, detail + "; fine only if another node of this job runs on this host and serves it", fix)
    if ep.shared:  # several nodes, but the holder is no torchrun/trainkit process: the rendezvous would wait forever
        return failed(name, detail + "; it is not a torchrun or trainkit process, so no node of this job serves "
                                     "it and the rendezvous would wait without an end", fix)
    return failed(name, detail, fix)


def monitor_ports(resolved) -> Optional[Check]:
    """Ports the recipe's monitors serve on (`prometheus`) must be free on this node before launch."""
    recipe = getattr(resolved, "recipe", None)
    wanted = [(m.name, m.host, m.port) for m in getattr(recipe, "monitors", ()) if hasattr(m, "port")]
    if not wanted:
        return None
    name = "monitor ports"
    for monitor, host, port in wanted:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        busy = port_in_use(port, family)
        if busy is not None:
            return failed(name, f"the {monitor} monitor's port {port} is in use{_holder(port)} ({busy})",
                          f"stop that process, or set the {monitor} monitor's port to a free one, e.g. "
                          f"monitors: [{{name: {monitor}, port: {free_port()}}}]")
    return passed(name, ", ".join(f"{m} {h}:{p} free" for m, h, p in wanted))


def rendezvous(resolved) -> Optional[Check]:
    """A remote rendezvous host must answer on its port within a second."""
    ep = endpoint(resolved)
    name = "rendezvous"
    if ep is None:
        return passed(name, "standalone: local c10d store, nothing to reach")
    try:
        addrs = _resolve(ep.host)
    except (socket.gaierror, UnicodeError):
        return None  # reported by master_port
    mine = local_addresses()
    if any(_is_local(ip, mine) for _, ip in addrs):
        return passed(name, f"{ep.host}:{ep.port} is served on this host (see master port)")
    family, ip = addrs[0]
    start = time.perf_counter()
    try:
        with socket.create_connection((ip, ep.port), timeout=CONNECT_TIMEOUT_S):
            pass
    except ConnectionRefusedError:
        return warned(name, f"{ep.host}:{ep.port} ({ip}) refused the connection: nothing listens there yet",
                      "fine if node 0 has not started; otherwise start it first, with the same " + ep.setting)
    except OSError as exc:
        return failed(name, f"{ep.host}:{ep.port} ({ip}) did not answer in {CONNECT_TIMEOUT_S:g} s "
                      f"({exc.strerror or type(exc).__name__})",
                      f"open TCP port {ep.port} between the nodes (firewall / security group), or fix {ep.setting}")
    ms = (time.perf_counter() - start) * 1000
    return passed(name, f"{ep.host}:{ep.port} ({ip}) accepted a connection in {ms:.0f} ms")


def _nccl_matches(spec: str, names: list[str]) -> list[str]:
    """Interfaces NCCL would use for NCCL_SOCKET_IFNAME: prefixes, '=' exact, '^' excludes."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    wanted = [w for w in spec.lstrip("=").split(",") if w]
    hit = [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]
    return [n for n in names if n not in hit] if exclude else hit


def socket_ifname(resolved) -> Check:
    import psutil

    name = "socket ifname"
    addrs = psutil.net_if_addrs()
    stats = psutil.net_if_stats()
    names = sorted(addrs)
    set_vars = {k: os.environ[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if os.environ.get(k)}
    if not set_vars:
        return passed(name, f"NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME not set: chosen automatically "
                      f"(interfaces: {', '.join(names)})")
    usable = [n for n in names if stats.get(n) and stats[n].isup and any(
        a.family in (socket.AF_INET, socket.AF_INET6) for a in addrs[n])]
    multi = resolved is not None and resolved.recipe.launch.nnodes not in (1, "1", "1:1")
    notes = []
    for var, value in set_vars.items():
        chosen = _nccl_matches(value, names) if var.startswith("NCCL") else [v for v in value.split(",") if v]
        missing = [] if var.startswith("NCCL") else [v for v in chosen if v not in addrs]
        if missing or not chosen:
            what = ", ".join(missing) if missing else value
            return failed(name, f"{var}={value}: no such interface here ({what})",
                          f"export {var}=<one of: {', '.join(usable) or ', '.join(names)}>, or unset it")
        down = [v for v in chosen if v not in usable]
        if down and len(down) == len(chosen):
            return failed(name, f"{var}={value}: {', '.join(down)} is down or has no IP address",
                          f"bring it up, or export {var}=<one of: {', '.join(usable)}>")
        if multi and all(v == "lo" for v in chosen):
            return failed(name, f"{var}={value}: loopback cannot reach other nodes (launch.nnodes "
                          f"{resolved.recipe.launch.nnodes})", f"export {var}=<the inter-node interface, one of: "
                          f"{', '.join(n for n in usable if n != 'lo')}>")
        notes.append(f"{var}={value} -> {', '.join(chosen)}")
    return passed(name, "; ".join(notes))
