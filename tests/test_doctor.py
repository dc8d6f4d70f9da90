"""`trainkit doctor`: every environment problem a launch would hit, as a pass/warn/fail row with its
fix, and a non-zero exit code on any fail; `trainkit run` stops on the quick subset before launching."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from run_helpers import Result, env_for, mlp_recipe

ENV_UNDER_TEST = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def trainkit(tmp: Path, *args: str, **env: str) -> Result:
    """`python -m trainkit.cli ARGS` with only the environment variables this test sets."""
    full = env_for(tmp)
    for key in ENV_UNDER_TEST:
        full.pop(key, None)
    full.update(env)
    proc = subprocess.run([sys.executable, "-m", "trainkit.cli", *args], cwd=tmp, env=full,
                          capture_output=True, text=True, timeout=120)
    return Result(proc.returncode, proc.stdout, proc.stderr)


@contextmanager
def port_in_use():
    """A port some other program is listening on, for as long as the block runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def row(output: str, name: str) -> str:
    """The table row of check `name`, with its fix line if any."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if line[6:].startswith(name + " "):
            fix = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].strip().startswith("fix:") else ""
            return line + "\n" + fix
    raise AssertionError(f"no row {name!r} in:\n{output}")


@pytest.mark.slow
def test_port_in_use_too_few_visible_gpus_and_missing_data_root_each_fail_with_their_fix(tmp_path):
    with port_in_use() as port:
        recipe = mlp_recipe(tmp_path, "sick",
                            data={"name": "imagefolder", "root": "no/such/folder", "batch_size": 4, "image_size": 32},
                            launch={"nproc_per_node": 2, "rdzv_endpoint": f"127.0.0.1:{port}",
                                    "run_dir": str(tmp_path / "runs")})
        result = trainkit(tmp_path, "doctor", recipe.name, CUDA_VISIBLE_DEVICES="0")
        as_json = trainkit(tmp_path, "doctor", recipe.name, "--format", "json", CUDA_VISIBLE_DEVICES="0")
    assert result.returncode == 1, result.output
    out = result.stdout

    gpus = row(out, "GPUs")
    assert gpus.startswith("FAIL")
    assert "CUDA_VISIBLE_DEVICES=0 names 1 device(s) but launch.nproc_per_node is 2" in gpus
    assert "fix: set CUDA_VISIBLE_DEVICES to 2 devices (e.g. 0,1) or launch.nproc_per_node: 1 (sick.yaml:" in gpus

    master = row(out, "master port")
    assert master.startswith("FAIL")
    assert f"port {port} on 127.0.0.1 is in use" in master
    assert f"fix: stop the process holding port {port}, or pick a free port: launch.rdzv_endpoint=127.0.0.1:" in master

    data = row(out, "data root")
    assert data.startswith("FAIL")
    assert "data.root: no/such/folder does not exist" in data
    assert "fix: point data.root (sick.yaml:" in data
    assert "or make a small one: trainkit data make-imagefolder no/such/folder" in data

    assert out.rstrip().endswith("-> exit 1")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and report["exit_code"] == 1
    failed = {c["name"] for c in report["checks"] if c["status"] == "fail"}
    assert failed == {"GPUs", "master port", "data root"}
    assert all(c["fix"] for c in report["checks"] if c["status"] != "pass")


@pytest.mark.slow
def test_healthy_recipe_passes_with_estimates_stated(tmp_path):
    from trainkit.runtime.imagefolder_maker import make_imagefolder

    make_imagefolder(tmp_path / "imgs", classes=2, per_class=2, size=16)
    recipe = mlp_recipe(tmp_path, "healthy",
                        data={"name": "imagefolder", "root": "imgs", "batch_size": 4, "image_size": 32,
                              "num_workers": 2})
    result = trainkit(tmp_path, "doctor", recipe.name)
    assert result.returncode == 0, result.output
    statuses = {line.split()[0] for line in result.stdout.splitlines()[2:-1] if not line.startswith(" ")}
    assert statuses <= {"PASS", "WARN"}, result.stdout
    assert row(result.stdout, "data root").startswith("PASS")
    assert "x 2 worker(s) x prefetch 2 x batch 4 x 12.0 KiB/sample" in row(result.stdout, "/dev/shm")
    assert "params x 4 B x (1 + 1 sgd state) x 4 checkpoints" in row(result.stdout, "disk")  # model built on meta
    assert "standalone: torchrun binds a free localhost port" in row(result.stdout, "master port")


@pytest.mark.slow
def test_without_a_recipe_only_machine_checks_run_and_master_port_is_checked(tmp_path):
    with port_in_use() as port:
        result = trainkit(tmp_path, "doctor", MASTER_PORT=str(port))
    assert result.returncode == 1, result.output
    master = row(result.stdout, "master port")
    assert master.startswith("FAIL") and f"port {port} on 127.0.0.1 is in use" in master
    assert "fix: stop the process holding port" in master and "export MASTER_PORT=" in master
    assert "data root" not in result.stdout


@pytest.mark.slow
def test_socket_interface_that_does_not_exist_fails(tmp_path):
    result = trainkit(tmp_path, "doctor", GLOO_SOCKET_IFNAME="nosuch0", NCCL_SOCKET_IFNAME="=nosuch1")
    ifname = row(result.stdout, "socket ifname")
    assert ifname.startswith("FAIL") and "no such interface here" in ifname and "fix: export " in ifname
    assert result.returncode == 1


@pytest.mark.slow
def test_invalid_recipe_exits_2(tmp_path):
    recipe = mlp_recipe(tmp_path, "typo", launch={"nproc_per_nod": 2})
    result = trainkit(tmp_path, "doctor", recipe.name)
    assert result.returncode == 2, result.output
    assert "did you mean 'nproc_per_node'" in result.stderr


@pytest.mark.slow
def test_run_stops_before_launching_when_the_rendezvous_port_is_taken(tmp_path):
    with port_in_use() as port:
        recipe = mlp_recipe(tmp_path, "busy", launch={"nproc_per_node": 2, "rdzv_endpoint": f"127.0.0.1:{port}",
                                                      "run_dir": str(tmp_path / "runs")})
        result = trainkit(tmp_path, "run", recipe.name)
    assert result.returncode == 2, result.output
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "not started: 1 environment check(s) failed (all checks: trainkit doctor" in result.stderr
    assert "PASS" not in result.stderr  # only the rows that need attention
    assert not (tmp_path / "runs").exists()  # nothing created, nothing launched


@pytest.mark.parametrize("value, expected", [
    ("0,1", ["0", "1"]), ("", []), ("-1", []), ("0,-1,2", ["0"]), ("GPU-1a2b,MIG-3c", ["GPU-1a2b", "MIG-3c"])])
def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch, value, expected):
    from trainkit.doctor.devices import visible_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_devices() == expected


def test_nccl_interface_patterns_prefix_exact_and_exclude():
    from trainkit.doctor.network import _nccl_matches

    names = ["eth0", "eth1", "ib0", "lo"]
    assert _nccl_matches("eth", names) == ["eth0", "eth1"]
    assert _nccl_matches("=eth", names) == []
    assert _nccl_matches("^eth,lo", names) == ["ib0"]


@pytest.mark.slow
def test_a_multi_node_launch_refuses_an_endpoint_a_foreign_process_holds(tmp_path):
    """Issue 25, case 11: with several nodes a busy local endpoint may be this job's own store, so it
    was only a warning, and two agents then waited >= 60 s without a word. A holder that is no
    torchrun/trainkit process can never be: refused at once, naming it."""
    import subprocess
    import sys
    import time

    listener = subprocess.Popen([sys.executable, "-c", "import socket, time; s = socket.socket(); "
                                 "s.bind(('0.0.0.0', 0)); s.listen(); print(s.getsockname()[1], flush=True); "
                                 "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(listener.stdout.readline())
        recipe = mlp_recipe(tmp_path, "busy2", launch={"nproc_per_node": 1, "nnodes": 2, "node_rank": 0,
                                                       "rdzv_endpoint": f"127.0.0.1:{port}",
                                                       "run_dir": str(tmp_path / "runs")})
        started = time.monotonic()
        result = trainkit(tmp_path, "run", recipe.name)
        took = time.monotonic() - started
    finally:
        listener.kill()
        listener.wait()
    assert result.returncode == 2, result.output
    assert f"port {port} on 127.0.0.1 is in use by pid {listener.pid}" in result.stderr, result.stderr
    assert "not a torchrun or trainkit process" in result.stderr
    assert took < 45, took  # refused before any rendezvous wait
    assert not (tmp_path / "runs").exists()


def test_a_remote_rendezvous_endpoint_is_checked_for_reachability(tmp_path, monkeypatch):
    """Guards the rendezvous row for another node's endpoint (issue 29): a listening endpoint passes
    with the time the connection took, one that refuses warns with its fix (start node 0 first, or
    fix launch.rdzv_endpoint). Real sockets; loopback stands in for the remote host."""
    from trainkit.doctor import network
    from trainkit.recipe.resolver import resolve

    monkeypatch.setattr(network, "_is_local", lambda ip, mine: False)  # as seen from another node

    def check(port: int):
        recipe = mlp_recipe(tmp_path, "remote", launch={"nproc_per_node": 1, "nnodes": 2,
                                                         "rdzv_endpoint": f"127.0.0.1:{port}"})
        return network.rendezvous(resolve(recipe))

    with port_in_use() as port:
        listening = check(port)
    assert listening.status == "pass" and "accepted a connection" in listening.detail, listening
    refused = check(port)  # closed now: nothing listens
    assert refused.status == "warn" and "refused the connection" in refused.detail, refused
    assert "start it first" in refused.fix and "launch.rdzv_endpoint" in refused.fix, refused
