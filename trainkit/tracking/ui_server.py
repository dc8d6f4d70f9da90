"""Serve the MLflow UI as one process group that ends with `trainkit ui`, however it is stopped.

`mlflow ui` starts uvicorn workers, a job runner and huey consumers. Ctrl-C in a terminal reaches the
whole foreground group, but a SIGTERM (a service manager, `kill`, a test) reaches only `trainkit ui`,
which left the rest serving on the port. So the server gets its own process group, and every way out
of `trainkit ui` (its end, Ctrl-C, SIGTERM, SIGHUP) stops that group. The URL is printed once the
server answers, not while it still starts (10-16 s on a small machine), and only when what answers is
this server: a port another process serves is refused before starting (`bind_problem`), and a server
that exits before serving (its port taken meanwhile) prints no URL.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Optional, Sequence
from urllib.parse import urlsplit

READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


class _Stopped(Exception):
    """A termination signal arrived: leave `serve` through its cleanup."""


def bind_problem(host: str, port: int) -> Optional[str]:
    """None when the server can bind `host`:`port`; else why not, a sentence for the user. The test bind
    has SO_REUSEADDR off; a port refused only that way (closed connections in TIME_WAIT, no listener) is
    retried with it on, as the server itself binds, so a UI restarted at once is not refused."""
    if not 1 <= port <= 65535:
        return f"--port {port} is not a port number (1-65535)"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn chooses
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    for reuse in (False, True) if os.name != "nt" else (False,):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
                probe.bind((host, port))
            return None
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                return f"cannot bind {where}: {exc.strerror or exc} (--host, --port)"
    return f"port {port} on {host} is in use by another process; choose another with --port"


def serve(cmd: Sequence[str], health_url: str, announce: str) -> int:
    """Run `cmd` in a new process group; print `announce` once `health_url` answers from that group;
    stop the group on exit."""
    # the server's own chatter goes to stderr: stdout carries only the announcement (scripts read the URL)
    server = subprocess.Popen(list(cmd), start_new_session=True, stdout=sys.stderr)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if _wait_until_answering(server, health_url):
            print(announce, flush=True)
        elif server.poll() is not None:
            print(f"trainkit: the MLflow UI exited (code {server.returncode}) before serving {health_url}: "
                  "nothing of it is served there (its own messages are above)", file=sys.stderr, flush=True)
            return server.returncode or 1
        return server.wait()
    except (KeyboardInterrupt, _Stopped):
        return 0
    finally:
        _stop_group(server)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stopped(signum, frame) -> None:
    raise _Stopped(signum)


def _wait_until_answering(server: subprocess.Popen, url: str) -> bool:
    """True once `url` answers and the server's group listens on its port (another process answering
    on that port does not count); False if the server exits first or does not answer in time."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    port = urlsplit(url).port
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                pass
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
            continue
        if server.poll() is None and _listens(server.pid, port) is not False:
            return True
        time.sleep(0.3)  # someone else answers: wait for ours to listen, or to fail to
    if server.poll() is None:
        print(f"trainkit: the MLflow UI did not answer {url} within {READY_TIMEOUT_S:.0f} s; still waiting",
              file=sys.stderr, flush=True)
    return False


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM the server's whole group, SIGKILL what is left after a grace period, reap the leader."""
    group = server.pid  # start_new_session: the leader's pid is the group's id
    _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_group(group, signal.SIGKILL)
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _listens(group: int, port: Optional[int]) -> Optional[bool]:
    """Whether a process of the group listens on `port` (None: cannot tell, e.g. not allowed to look)."""
    import psutil

    unknown = False
    for proc in _members(group):
        try:
            conns = proc.net_connections(kind="inet") if hasattr(proc, "net_connections") else proc.connections("inet")
        except psutil.AccessDenied:
            unknown = True
            continue
        except psutil.Error:
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return None if unknown else False


def _members(group: int) -> list:
    """Live (not zombie) processes of the group."""
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == group and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found
