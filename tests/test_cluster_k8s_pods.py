"""Two "pods" on one machine, as a PyTorchJob runs them: two network namespaces joined by a veth pair
(private addresses that exist only inside them), each with its own hostname, /etc/hosts, working
directory and exactly the operator's environment (MASTER_ADDR = the master's address, WORLD_SIZE=2,
RANK=0/1). `trainkit run` with no launch overrides in each makes one 2-rank job and one MLflow run on a
real `mlflow server` inside the master's namespace. The run directory is on storage both pods share
(as `trainkit k8s --run-dir-pvc` mounts it): checkpoints need it (docs/clusters.md).

The same two pods then run the TrainJob that `trainkit k8s --api trainjob` writes, with Kubeflow Trainer
v2's environment instead (PET_* only): again one 2-rank job and one MLflow run. The namespaces and the
MLflow server are shared by both tests."""

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
import yaml

from run_helpers import env_for, mlp_recipe, summary

pytestmark = pytest.mark.distributed
REPO = Path(__file__).resolve().parents[1]
JOB = "tkjob"
PYTORCHJOB_HOSTS = [f"{JOB}-master-0", f"{JOB}-worker-0"]
TRAINJOB_HOSTS = [f"{JOB}-node-0-0", f"{JOB}-node-0-1"]  # JobSet pod hostnames: <jobset>-<replicatedJob>-<job>-<pod>


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def pods():
    """Two namespaces joined by a veth pair; each one's /etc/hosts names both pods the way a PyTorchJob
    (<job>-master-0, <job>-worker-0) and a TrainJob (<job>-node-0-N, and .<job> under the JobSet's
    subdomain) do. Yields [(namespace, address)] for master/node 0 and worker/node 1."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("network namespaces need root, iproute2 and unshare")
    tag = f"tk{os.getpid() % 100000}"
    names = [f"{tag}m", f"{tag}w"]
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    addrs = [f"{subnet}.1", f"{subnet}.2"]
    made: list[str] = []
    try:
        for ns in names:
            if sh("ip", "netns", "add", ns, check=False).returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {sh('ip', 'netns', 'add', ns, check=False).stderr}")
            made.append(ns)
        sh("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        names_of = [" ".join((PYTORCHJOB_HOSTS[i], TRAINJOB_HOSTS[i], f"{TRAINJOB_HOSTS[i]}.{JOB}")) for i in range(2)]
        for ns, dev, addr in zip(names, (f"{tag}a", f"{tag}b"), addrs):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns  # `ip netns exec` bind-mounts these over /etc, as a pod's own /etc/hosts
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(addrs, names_of)))
        yield list(zip(names, addrs))
    finally:
        for ns in made:
            sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.fixture(scope="module")
def mlflow_uri(pods, tmp_path_factory):
    """One real `mlflow server` in the master's namespace, shared by the tests (each uses its own experiment)."""
    (master_ns, master_ip), _ = pods
    tmp = tmp_path_factory.mktemp("mlflow")
    port = 5000 + os.getpid() % 1000
    store = tmp / "store"
    store.mkdir()
    server = in_pod(master_ns, PYTORCHJOB_HOSTS[0], [sys.executable, "-m", "mlflow", "server", "--host", master_ip,
                                                     "--port", str(port), "--workers", "1",
                                                     "--backend-store-uri", f"sqlite:///{store}/mlflow.db",
                                                     "--artifacts-destination", str(store / "artifacts")],
                    base_env(tmp), store, tmp / "mlflow-server.log")
    try:
        uri = f"http://{master_ip}:{port}"
        probe = [sys.executable, "-c", f"import urllib.request as u; u.urlopen('{uri}/health', timeout=2)"]
        deadline = time.monotonic() + 90
        while subprocess.run(["ip", "netns", "exec", master_ns, *probe], capture_output=True,
                             timeout=30).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp / "mlflow-server.log").read_text()
            time.sleep(1.0)
        yield uri
    finally:
        _stop(server)


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


def two_pod_job(tmp_path: Path, pods, hosts: list[str], recipe_of, env_of, mlflow_uri: str, experiment: str,
                name: str) -> tuple[list[str], Path]:
    """`trainkit run` in both pods; asserts one 2-rank job with identical replicas and one FINISHED MLflow run.
    recipe_of(pod_dir) -> recipe file; env_of(i) -> the scheduler's variables for pod i. Returns the logs and
    the shared run directory."""
    shared = tmp_path / "pvc"
    procs = []
    try:
        for i, ((ns, _), host) in enumerate(zip(pods, hosts)):
            pod = tmp_path / f"pod{i}"
            pod.mkdir()
            recipe = recipe_of(pod, shared)
            env = dict(base_env(pod), HOSTNAME=host, PYTHONUNBUFFERED="0", **env_of(i))
            procs.append(in_pod(ns, host, [sys.executable, "-m", "trainkit.cli", "run", str(recipe.relative_to(pod))],
                                env, pod, tmp_path / f"pod{i}.log"))
        for p in procs:
            p.wait(timeout=240)
        logs = [(tmp_path / f"pod{i}.log").read_text() for i in range(2)]
        assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(logs)
        s = summary(shared / name)
        assert s["world_size"] == 2 and s["steps"] == 12 and s["replicas_identical"]
        digests = s.get("replica_digests")
        assert digests and len(set(map(str, digests))) == 1
        state = json.loads((shared / name / "tracking" / "state.json").read_text())
        query = (f"from mlflow.tracking import MlflowClient; c = MlflowClient('{mlflow_uri}'); "
                 f"e = c.get_experiment_by_name('{experiment}'); r = c.search_runs([e.experiment_id]); "
                 f"print([(x.info.run_id, x.info.status) for x in r])")
        out = subprocess.run(["ip", "netns", "exec", pods[0][0], sys.executable, "-c", query], capture_output=True,
                             text=True, timeout=60, env=base_env(tmp_path)).stdout.strip()
        assert out == str([(state["run_id"], "FINISHED")]), out
        return logs, shared
    finally:
        for p in reversed(procs):
            _stop(p)


def test_old_operator_pods_make_one_job_and_one_mlflow_run(tmp_path, pods, mlflow_uri):
    master_ip = pods[0][1]

    def recipe_of(pod: Path, shared: Path) -> Path:
        return mlp_recipe(pod, "k8s-job", launch={"nproc_per_node": 1, "run_dir": str(shared), "timeout_s": 60},
                          tracking={"enabled": True, "uri": mlflow_uri, "experiment": "pods"})

    def env_of(i: int) -> dict:
        return {"MASTER_ADDR": master_ip, "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": str(i)}

    logs, _ = two_pod_job(tmp_path, pods, PYTORCHJOB_HOSTS, recipe_of, env_of, mlflow_uri, "pods", "k8s-job")
    assert all("Kubeflow PyTorchJob pod" in log and "nnodes=2" in log for log in logs)
    assert "replacing the recipe's" not in logs[0]  # mlp_recipe sets no nnodes


def test_trainer_v2_pods_make_one_job_and_one_mlflow_run(tmp_path, pods, mlflow_uri):
    """The TrainJob `trainkit k8s --api trainjob` writes, run as Trainer v2's torch plugin runs it: the recipe from
    its ConfigMap, its trainer.env, and only PET_* (no MASTER_ADDR, WORLD_SIZE or RANK)."""
    from trainkit.cluster.k8s import trainjob
    from trainkit.recipe import resolve

    source = mlp_recipe(tmp_path, JOB, launch={"nproc_per_node": 1, "nnodes": 2, "timeout_s": 60},
                        tracking={"enabled": True, "uri": mlflow_uri, "experiment": "trainjob"})
    configmap, job = trainjob(resolve(source), str(source), image="trainkit:test", gpus_per_node=0).documents
    assert job["metadata"]["name"] == JOB and job["spec"]["trainer"]["numNodes"] == 2
    shipped = yaml.safe_load(configmap["data"][source.name])
    trainer_env = {e["name"]: e["value"] for e in job["spec"]["trainer"]["env"] if "value" in e}
    assert trainer_env == {"MLFLOW_TRACKING_URI": mlflow_uri}

    def recipe_of(pod: Path, shared: Path) -> Path:  # the ConfigMap, with the PVC's mount point moved to `shared`
        assert shipped["launch"]["run_dir"] == "/trainkit/runs"
        path = pod / source.name
        path.write_text(yaml.safe_dump(dict(shipped, launch=dict(shipped["launch"], run_dir=str(shared)))))
        return path

    def env_of(i: int) -> dict:  # kubeflow/trainer v2.3.0 pkg/runtime/framework/plugins/torch/torch.go
        return dict(trainer_env, PET_NNODES=str(job["spec"]["trainer"]["numNodes"]),
                    PET_NPROC_PER_NODE=str(job["spec"]["trainer"]["numProcPerNode"]), PET_NODE_RANK=str(i),
                    PET_MASTER_ADDR=f"{JOB}-node-0-0.{JOB}", PET_MASTER_PORT="29500")

    logs, _ = two_pod_job(tmp_path, pods, TRAINJOB_HOSTS, recipe_of, env_of, mlflow_uri, "trainjob", JOB)
    for log in logs:
        assert "Kubeflow Trainer v2 TrainJob pod" in log and "nnodes=2" in log, log
        assert f"rdzv_endpoint={JOB}-node-0-0.{JOB}:29500" in log and f"rdzv_id={JOB}" in log, log
