"""Serve the MLflow UI as one process group that ends with `trainkit ui`, however it is stopped.

`mlflow ui` starts uvicorn workers, a job runner and huey consumers. Ctrl-C in a terminal reaches the
whole foreground group, but a SIGTERM (a service manager, `kill`, a test) reaches only `trainkit ui`,
which left the rest serving on the port. So the server gets its own process group, and every way out
of `trainkit ui` (its end, Ctrl-C, SIGTERM, SIGHUP) stops that group. The URL is printed once the
server answers, not while it still starts (10-16 s on a small machine).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Sequence

READY_TIMEOUT_S = 180.0
STOP_GRACE_S = 10.0


class _Stopped(Exception):
    """A termination signal arrived: leave `serve` through its cleanup."""


def serve(cmd: Sequence[str], health_url: str, announce: str) -> int:
    """Run `cmd` in a new process group; print `announce` once `health_url` answers; stop the group on exit."""
    # the server's own chatter goes to stderr: stdout carries only the announcement (scripts read the URL)
    server = subprocess.Popen(list(cmd), start_new_session=True, stdout=sys.stderr)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if _wait_until_answering(server, health_url):
            print(announce, flush=True)
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
    deadline = time.monotonic() + READY_TIMEOUT_S
    while server.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.3)
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
