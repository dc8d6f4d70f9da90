"""Where the rendezvous store of a launch listens (issue 25, case 5; trainkit/launch/rendezvous_store.py):
torch's TCPStore server listens on every interface whatever host it is given, so trainkit binds the
socket itself. Read back from this process's real listening sockets (psutil, as `ss -ltnp` shows them)
and through a real store client; the 2-process `trainkit run` that joins it is in test_hostile_recipes.py."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from run_helpers import free_port, mlp_recipe
from trainkit.launch import rendezvous_store
from trainkit.recipe import resolve


def listening_on(port: int) -> set[str]:
    """The addresses this process listens on at `port`."""
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def launch_recipe(tmp_path, **launch):
    return resolve(str(mlp_recipe(tmp_path, "meet", launch={"nproc_per_node": 2, **launch}))).recipe


def a_store_answers(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    client.set("hello", "there")
    return client.get("hello") == b"there"


def test_one_node_serves_its_agents_store_on_loopback_and_torchrun_joins_it(tmp_path):
    with rendezvous_store.served(launch_recipe(tmp_path)) as rendezvous:
        host, _, port = rendezvous.endpoint.rpartition(":")
        assert host == "127.0.0.1" and listening_on(int(port)) == {"127.0.0.1"}
        assert a_store_answers(rendezvous.endpoint)
        command = rendezvous.torchrun_command(["torchrun", "--nnodes=1", "--standalone", "-m", "w", "RUN"])
    assert "--standalone" not in command and f"--rdzv-endpoint={rendezvous.endpoint}" in command
    assert command[-5:] == ["--rdzv-conf=is_host=0", "--local-addr=127.0.0.1", "-m", "w", "RUN"]
    assert not listening_on(int(port))  # the store stops with the launch


def this_hosts_address() -> str:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    pytest.skip("no network interface besides loopback")


def test_several_nodes_serve_on_the_address_the_endpoint_names_once_per_machine(tmp_path):
    """The agent whose machine owns the endpoint's address serves there and nowhere else; a second
    agent of the same machine (two nodes on one host) joins it instead of failing to bind."""
    address, port = this_hosts_address(), free_port()
    recipe = launch_recipe(tmp_path, nnodes=2, rdzv_endpoint=f"{address}:{port}", rdzv_id="j")
    with rendezvous_store.served(recipe) as first:
        assert listening_on(port) == {address}
        with rendezvous_store.served(recipe) as second:
            assert listening_on(port) == {address}  # still the first agent's store only
            assert second.endpoint == first.endpoint == f"{address}:{port}"
            assert second.local_addr == first.local_addr == address  # the workers' store: the same interface
        assert a_store_answers(first.endpoint)


def test_the_static_rendezvous_keeps_torchs_own_store(tmp_path):
    recipe = launch_recipe(tmp_path, nnodes=2, rdzv_backend="static", node_rank=0,
                           rdzv_endpoint=f"127.0.0.1:{free_port()}", rdzv_id="j")
    with rendezvous_store.served(recipe) as rendezvous:
        assert rendezvous is None
