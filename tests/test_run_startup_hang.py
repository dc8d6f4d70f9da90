"""Start-up hangs of a multi-node launch end within launch.join_timeout_s, named (issue 29): a node
that dies while the rendezvous gathers (two agents on loopback, as tests/test_run_multinode.py), and
a rendezvous endpoint that refuses this node."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from run_helpers import env_for, free_port, mlp_recipe, wait_for
from test_run_hang import _left_running

from trainkit.launch import startup
from trainkit.recipe.resolver import resolve

pytestmark = pytest.mark.distributed

JOIN_TIMEOUT_S = 8


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _agent(tmp_path, recipe) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_a_node_killed_while_the_rendezvous_gathers_ends_the_other_after_join_timeout(tmp_path):
    """Guards launch.join_timeout_s (torchrun's c10d join_timeout) and the message: node 0's agent
    serves the rendezvous and waits; node 1's agent is killed as it reaches the rendezvous. Before,
    node 0 waited torch's 600 s and then failed with a bare 'RendezvousTimeoutError'. Now it ends after
    the join timeout, saying that the rendezvous did not gather 2 nodes, that a node is missing and
    why that may be; nothing is left running."""
    port = free_port()
    recipe = mlp_recipe(tmp_path, "gather", launch={"nproc_per_node": 1, "nnodes": 2, "rdzv_id": "g",
                                                     "rdzv_endpoint": f"127.0.0.1:{port}",
                                                     "join_timeout_s": JOIN_TIMEOUT_S})
    first = _agent(tmp_path, recipe)
    # node 0 is the agent that serves the endpoint: the second starts once it listens (started together,
    # either could bind it first, and killing the one that serves leaves the other facing a closed port)
    wait_for(lambda: _accepts(port) or first.poll() is not None, timeout=60, what="node 0 serving the rendezvous")
    second = _agent(tmp_path, recipe)
    try:
        for line in second.stdout:  # its launch begins: the next step is the rendezvous
            if line.startswith("trainkit: run gather"):
                break
        os.killpg(second.pid, signal.SIGKILL)
        second.communicate()
        killed_at = time.monotonic()
        output = first.communicate(timeout=JOIN_TIMEOUT_S + 60)[0]
        took = time.monotonic() - killed_at
    finally:
        for agent in (first, second):
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    assert first.returncode == 1, output
    assert took < JOIN_TIMEOUT_S + 30, f"{took:.0f} s after the kill"
    assert (f"not started: the rendezvous at 127.0.0.1:{port} (rdzv_id g) did not gather launch.nnodes 2 nodes "
            f"within launch.join_timeout_s {JOIN_TIMEOUT_S} s") in output, output
    assert "at least one node is missing" in output and "died while joining" in output, output
    assert "Traceback" not in output, output
    assert not _left_running(tmp_path)


def test_an_endpoint_that_refuses_this_node_is_named_within_join_timeout(tmp_path):
    """Guards the reachability wait before torchrun: an endpoint nothing listens on (a wrong
    launch.rdzv_endpoint / MASTER_ADDR, node 0 not started, a firewall that rejects). Before, torch's
    store retried for minutes printing C++ stack traces. Now the launch stops after
    launch.join_timeout_s, naming the endpoint, what the connection said, and the likely causes."""
    port = free_port()  # nothing listens there
    recipe = resolve(mlp_recipe(tmp_path, "refused", launch={
        "nproc_per_node": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "join_timeout_s": 2})).recipe
    started = time.monotonic()
    message = startup.unreachable(recipe, "this-node")
    assert 2 <= time.monotonic() - started < 6
    assert message.startswith(f"not started: the rendezvous endpoint 127.0.0.1:{port} (launch.rdzv_endpoint) did "
                              f"not accept a connection from this node (this-node) within launch.join_timeout_s 2 "
                              f"s: Connection refused"), message
    assert "a wrong address" in message and f"firewall blocking TCP port {port}" in message, message


def test_an_endpoint_served_by_a_stopped_process_is_named_within_join_timeout(tmp_path):
    """Issue 38 #3: the endpoint is served by another job's `trainkit run` (node 0 of a 2-node launch)
    that is then SIGSTOPped. Its socket still accepts connections (the kernel queues them), and torch's
    store client waits past its own timeout: the launch once waited for ever (killed by the case at
    90 s, join_timeout_s 8, nothing printed after the first line). Now `trainkit run` ends within the
    join timeout, saying the endpoint accepts connections but its store does not answer, and why that
    may be; nothing of it is left running."""
    port = free_port()
    launch = {"nproc_per_node": 1, "nnodes": 2, "rdzv_id": "other", "rdzv_endpoint": f"127.0.0.1:{port}",
              "join_timeout_s": 600}
    other = tmp_path / "other"
    other.mkdir()
    holder = _agent(other, mlp_recipe(other, "other", launch={**launch, "node_rank": 0}))
    try:
        wait_for(lambda: _accepts(port) or holder.poll() is not None, timeout=60, what="the other job serving")
        os.killpg(holder.pid, signal.SIGSTOP)
        recipe = mlp_recipe(tmp_path, "held", launch={**launch, "node_rank": 1, "join_timeout_s": JOIN_TIMEOUT_S})
        agent = _agent(tmp_path, recipe)
        started = time.monotonic()
        try:
            output = agent.communicate(timeout=JOIN_TIMEOUT_S + 60)[0]
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
        took = time.monotonic() - started
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        os.killpg(holder.pid, signal.SIGCONT)
        holder.wait()
    assert agent.returncode == 1, output
    assert took < JOIN_TIMEOUT_S + 25, f"{took:.0f} s"
    assert (f"not started: the rendezvous endpoint 127.0.0.1:{port} (launch.rdzv_endpoint) accepts TCP "
            f"connections from this node") in output and "did not answer within" in output, output
    assert "stopped (SIGSTOP" in output and "Traceback" not in output, output
    assert not _left_running(tmp_path)
