"""Two "pods" on one machine, as a PyTorchJob runs them: two network namespaces joined by a veth pair
(private addresses that exist only inside them), each with its own hostname, /etc/hosts, working
directory and exactly the operator's environment (MASTER_ADDR = the master's address, WORLD_SIZE=2,
RANK=0/1). `trainkit run` with no launch overrides in each makes one 2-rank job and one MLflow run on a
real `mlflow server` inside the master's namespace. The run directory is on storage both pods share
(as `trainkit k8s --run-dir-pvc` mounts it): checkpoints need it (docs/clusters.md)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_helpers import env_for, mlp_recipe, summary

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[1]
JOB = "tkjob"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def pods(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"tk{os.getpid() % 100000}"
    names = [f"{tag}m", f"{tag}w"]
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addrs = [f"{subnet}.1", f"{subnet}.2"]
    hosts = [f"{JOB}-master-0", f"{JOB}-worker-0"]
    made: list[str] = []
    try:
        for ns in names:
            if sh("ip", "netns", "add", ns, check=False).returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {sh('ip', 'netns', 'add', ns, check=False).stderr}")
            made.append(ns)
        sh("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for ns, dev, addr, host in zip(names, (f"{tag}a", f"{tag}b"), addrs, hosts):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns  # `ip netns exec` bind-mounts these over /etc, as a pod's own /etc/hosts
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, hosts)))
        yield list(zip(names, addrs, hosts))
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def in_pod(ns: str, host: str, argv: list[str], env: dict, cwd: Path, log: Path) -> subprocess.Popen:
    inner = f"hostname {host} && exec env -i " + " ".join(f"{k}={_q(v)}" for k, v in env.items()) + " " + \
        " ".join(_q(a) for a in argv)
    return subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", inner], cwd=cwd,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _q(text: str) -> str:
    import shlex

    return shlex.quote(str(text))


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def base_env(tmp: Path) -> dict:
    env = {k: v for k, v in env_for(tmp).items()
           if not k.startswith(("SLURM_", "PET_", "MASTER_", "TORCHELASTIC_", "KUBERNETES_"))
           and k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "HOSTNAME", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def test_old_operator_pods_make_one_job_and_one_mlflow_run(tmp_path, pods):
    (master_ns, master_ip, master_host), (worker_ns, _, worker_host) = pods
    port = 5000 + os.getpid() % 1000
    store = tmp_path / "mlflow"
    store.mkdir()
    server = in_pod(master_ns, master_host, [sys.executable, "-m", "mlflow", "server", "--host", master_ip,
                                             "--port", str(port), "--workers", "1",
                                             "--backend-store-uri", f"sqlite:///{store}/mlflow.db",
                                             "--artifacts-destination", str(store / "artifacts")],
                    base_env(tmp_path), store, tmp_path / "mlflow-server.log")
    procs = [server]
    try:
        uri = f"http://{master_ip}:{port}"
        probe = [sys.executable, "-c", f"import urllib.request as u; u.urlopen('{uri}/health', timeout=2)"]
        deadline = time.monotonic() + 90
        while subprocess.run(["ip", "netns", "exec", master_ns, *probe], capture_output=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "mlflow-server.log").read_text()
            time.sleep(1.0)
        pod_dirs = []
        shared = tmp_path / "pvc"
        for i, (ns, _, host) in enumerate(pods):
            pod = tmp_path / f"pod{i}"
            pod.mkdir()
            recipe = mlp_recipe(pod, "k8s-job", launch={"nproc_per_node": 1, "run_dir": str(shared), "timeout_s": 60},
                                tracking={"enabled": True, "uri": uri, "experiment": "pods"})
            env = dict(base_env(pod), MASTER_ADDR=master_ip, MASTER_PORT="23456", WORLD_SIZE="2", RANK=str(i),
                       HOSTNAME=host, PYTHONUNBUFFERED="0")
            procs.append(in_pod(ns, host, [sys.executable, "-m", "trainkit.cli", "run", recipe.name], env, pod,
                                tmp_path / f"pod{i}.log"))
            pod_dirs.append(pod)
        for p in procs[1:]:
            p.wait(timeout=240)
        logs = [(tmp_path / f"pod{i}.log").read_text() for i in range(2)]
        assert [p.returncode for p in procs[1:]] == [0, 0], "\n---\n".join(logs)
        assert all("Kubeflow PyTorchJob pod" in log and "nnodes=2" in log for log in logs)
        assert "replacing the recipe's" not in logs[0]  # mlp_recipe sets no nnodes
        s = summary(shared / "k8s-job")
        assert s["world_size"] == 2 and s["steps"] == 12 and s["replicas_identical"]
        digests = s.get("replica_digests")
        assert digests and len(set(map(str, digests))) == 1
        states = [json.loads((shared / "k8s-job" / "tracking" / "state.json").read_text())]
        query = (f"from mlflow.tracking import MlflowClient; c = MlflowClient('{uri}'); "
                 f"e = c.get_experiment_by_name('pods'); r = c.search_runs([e.experiment_id]); "
                 f"print([(x.info.run_id, x.info.status) for x in r])")
        out = subprocess.run(["ip", "netns", "exec", master_ns, sys.executable, "-c", query], capture_output=True,
                             text=True, timeout=60, env=base_env(tmp_path)).stdout.strip()
        assert out == str([(states[0]["run_id"], "FINISHED")]), out
    finally:
        for p in reversed(procs):
            _stop(p)
