"""`trainkit k8s` and `trainkit slurm`: the files they write, checked against the Kubeflow CRDs (PyTorchJob,
Trainer v2 TrainJob and ClusterTrainingRuntime) and by bash, and the requests they refuse (exit 2, nothing
written)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


SHARED = Path(__file__).resolve().parents[2] / "shared"
CRD = SHARED / "k8s" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"
CRDS = {"PyTorchJob": CRD, "TrainJob": SHARED / "k8s" / "trainer.kubeflow.org_trainjobs.v2.3.0.yaml",
        "ClusterTrainingRuntime": SHARED / "k8s" / "trainer.kubeflow.org_clustertrainingruntimes.v2.3.0.yaml"}
_schemas: dict[str, dict] = {}


def crd_schema(kind: str = "PyTorchJob") -> dict:
    path = CRDS[kind]
    if not path.is_file():
        pytest.skip(f"the {kind} CRD is not at {path} (the ../shared reference folder beside the repository)")
    if kind not in _schemas:  # the Trainer CRDs are ~1 MB of YAML: parse each once
        crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        _schemas[kind] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return _schemas[kind]


def validate(doc: dict) -> None:
    """jsonschema against the CRD of doc's kind, plus the CRDs' CEL rule on metadata.name (jsonschema skips CEL)."""
    import jsonschema

    jsonschema.validate(doc, crd_schema(doc["kind"]))
    name = doc["metadata"]["name"]
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name), name
    if doc["kind"] == "TrainJob":
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), "TrainJob: RFC 1035 DNS label"


def k8s_docs(tmp_path, *args) -> tuple[list[dict], str]:
    out = tmp_path / "job.yaml"
    r = trainkit(tmp_path, "k8s", *args, "-o", str(out), timeout=60)
    assert r.returncode == 0, r.output
    return list(yaml.safe_load_all(out.read_text())), r.stderr


def test_pytorchjob_validates_against_the_crd(tmp_path):
    import jsonschema

    schema = crd_schema()
    recipe = mlp_recipe(tmp_path, "resnet", launch={"nnodes": 4, "nproc_per_node": 8, "backend": "nccl",
                                                    "rdzv_endpoint": "x:1"},
                        tracking={"enabled": True, "uri": "http://user:s3cret@mlflow.svc:5000", "experiment": "e"})
    docs, notes = k8s_docs(tmp_path, str(recipe), "--image", "reg/trainkit:1", "--namespace", "ml",
                           "--run-dir-pvc", "runs-pvc")
    configmap, job = docs
    jsonschema.validate(job, schema)
    spec = job["spec"]
    assert spec["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == 3 and spec["nprocPerNode"] == "8"
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["command"] == ["trainkit", "run", "/recipes/resnet.yaml"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8 and c["resources"]["requests"]["cpu"] == 8
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs-pvc"}} in pod["volumes"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.svc:5000"} in c["env"]
    assert any(e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "mlflow-credentials" for e in c["env"])
    text = (tmp_path / "job.yaml").read_text()
    assert "s3cret" not in text and "user:" not in text
    assert configmap["kind"] == "ConfigMap" and "resnet.yaml" in configmap["data"]
    assert yaml.safe_load(configmap["data"]["resnet.yaml"])["launch"]["run_dir"] == "/trainkit/runs"
    assert "Secret 'mlflow-credentials'" in notes


def test_elastic_recipe_gets_an_elastic_policy_and_a_safe_name(tmp_path):
    import jsonschema

    schema = crd_schema()
    recipe = mlp_recipe(tmp_path, "My_Run.v2", launch={"nnodes": "2:4", "rdzv_endpoint": "x:1"})
    docs, notes = k8s_docs(tmp_path, str(recipe), "--image", "img", "--gpus-per-node", "0")
    job = docs[1]
    jsonschema.validate(job, schema)
    assert job["metadata"]["name"] == "my-run-v2" and "'my-run-v2'" in notes
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 2 and job["spec"]["elasticPolicy"]["maxReplicas"] == 4
    assert "checkpoints live on each pod" in notes


def test_k8s_refuses_a_bad_namespace(tmp_path):
    recipe = mlp_recipe(tmp_path, "ns")
    r = trainkit(tmp_path, "k8s", str(recipe), "--image", "i", "--namespace", "Bad_NS", "-o", "x.yaml", timeout=60)
    assert r.returncode == 2 and "not a valid Kubernetes namespace" in r.stderr and not (tmp_path / "x.yaml").exists()


def test_k8s_refuses_secret_and_claim_names_kubernetes_rejects(tmp_path):
    """Issue 38 (c): `--mlflow-secret No_Such/secret` was written ("wrote ...", exit 0) into a job the API
    server rejects. Each name is checked by Kubernetes' own rule first, naming the flag and the rule."""
    recipe = mlp_recipe(tmp_path, "names", launch={"backend": "gloo"})
    for flag, bad, rule in (("--mlflow-secret", "No_Such/secret", "DNS-1123 subdomain"),
                            ("--run-dir-pvc", "runs-", "DNS-1123 subdomain")):
        r = trainkit(tmp_path, "k8s", str(recipe), "--image", "i", flag, bad, "-o", "x.yaml", timeout=60)
        assert r.returncode == 2, r.output
        assert f"{flag} {bad!r} is not a valid Kubernetes" in r.stderr and rule in r.stderr, r.stderr
        assert "Traceback" not in r.output and "wrote" not in r.output and not (tmp_path / "x.yaml").exists()


def test_kubernetes_names_follow_the_dns_1123_rules():
    from trainkit.cluster.k8s import K8sError, check_names

    check_names(namespace="ml-team", run_dir_pvc="runs.v2", mlflow_secret="a" * 253, runtime="torch-distributed")
    for bad in ({"namespace": "ml.team"}, {"namespace": "a" * 64}, {"mlflow_secret": "a" * 254},
                {"mlflow_secret": ""}, {"run_dir_pvc": "-runs"}, {"run_dir_pvc": "Runs"}, {"runtime": "a..b"}):
        with pytest.raises(K8sError, match="DNS-1123"):
            check_names(**bad)


def test_sbatch_script_is_valid_bash_with_one_task_per_node(tmp_path):
    recipe = mlp_recipe(tmp_path, "sl", launch={"nnodes": 2, "nproc_per_node": 4, "backend": "nccl",
                                                "rdzv_endpoint": "x:1"})
    r = trainkit(tmp_path, "slurm", str(recipe), "trainer.max_steps=5", "--partition", "gpu", "--time", "1:00:00",
                 "-o", "job.sbatch", timeout=60)
    assert r.returncode == 0, r.output
    script = (tmp_path / "job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00", "#SBATCH --requeue"):
        assert line in script
    assert "srun --ntasks-per-node=1" in script and "trainkit run" in script and "trainer.max_steps=5" in script
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")]).returncode == 0


def test_sbatch_refuses_gpus_for_a_gloo_recipe(tmp_path):
    recipe = mlp_recipe(tmp_path, "gl", launch={"backend": "gloo"})
    r = trainkit(tmp_path, "slurm", str(recipe), "--gpus-per-node", "2", "-o", "job.sbatch", timeout=60)
    assert r.returncode == 2 and "backend is gloo" in r.stderr and not (tmp_path / "job.sbatch").exists()


# --------------------------------------------------------------------------- Kubeflow Trainer v2
def trainjob_docs(tmp_path, nodes: int, gpu: bool, **options) -> tuple[dict, list[str]]:
    """The documents `trainjob` writes for a 1/2/4-node CPU or GPU recipe, by kind."""
    from trainkit.cluster.k8s import trainjob
    from trainkit.recipe import resolve

    launch = {"nnodes": nodes, "nproc_per_node": 4 if gpu else 2, "backend": "nccl" if gpu else "gloo"}
    recipe = mlp_recipe(tmp_path, f"tj-{nodes}-{'gpu' if gpu else 'cpu'}", launch=launch,
                        tracking={"enabled": True, "uri": "https://bob:pw@mlflow.example:443", "experiment": "e"})
    manifest = trainjob(resolve(recipe), str(recipe), image="reg/trainkit:1", namespace="ml", **options)
    return {d["kind"]: d for d in manifest.documents}, manifest.notes


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_trainjob_and_trainkit_runtime_validate_against_the_trainer_v2_crds(tmp_path, nodes, gpu):
    docs, notes = trainjob_docs(tmp_path, nodes, gpu, with_runtime=True)
    assert list(docs) == ["ClusterTrainingRuntime", "ConfigMap", "TrainJob"]  # the runtime first: apply order
    for doc in docs.values():
        if doc["kind"] != "ConfigMap":
            validate(doc)
    job, runtime = docs["TrainJob"], docs["ClusterTrainingRuntime"]
    assert job["apiVersion"] == runtime["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert job["spec"]["runtimeRef"] == {"name": "trainkit-distributed"} == {"name": runtime["metadata"]["name"]}
    trainer = job["spec"]["trainer"]
    file = f"tj-{nodes}-{'gpu' if gpu else 'cpu'}.yaml"
    assert trainer["numNodes"] == nodes and trainer["image"] == "reg/trainkit:1"
    assert trainer["command"] == ["trainkit", "run", f"/recipes/{file}"]
    assert trainer["numProcPerNode"] == (4 if gpu else 2)
    resources = trainer["resourcesPerNode"]  # no resources given: node_resources' rules without a plan
    assert resources["limits"].get("nvidia.com/gpu") == (4 if gpu else None)
    assert resources["requests"]["cpu"] == (4 if gpu else 2) and resources["limits"]["memory"].endswith("Gi")
    env = {e["name"]: e for e in trainer["env"]}
    assert env["MLFLOW_TRACKING_URI"]["value"] == "https://mlflow.example:443"
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-credentials"
    assert not any(n.startswith("PET_") for n in env)  # the torch plugin rejects TrainJobs that set them
    # the recipe: a ConfigMap mounted through the TrainJob's runtimePatches into the runtime's `node` container
    node = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert {"name": "recipe", "configMap": {"name": f"{job['metadata']['name']}-recipe"}} in pod["volumes"]
    shipped = yaml.safe_load(docs["ConfigMap"]["data"][file])
    assert shipped["launch"]["cluster"] == "trainjob" and shipped["launch"]["nnodes"] == nodes
    assert shipped["launch"]["run_dir"] == "/trainkit/runs"
    # trainkit's runtime: the torch policy, /dev/shm in memory, the run directory on the shared claim
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]
    assert rjob["name"] == "node"
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    rpod = rjob["template"]["spec"]["template"]["spec"]
    assert rpod["containers"][0]["image"] == "reg/trainkit:1"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in rpod["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "trainkit-runs"}} in rpod["volumes"]
    assert {"name": "runs", "mountPath": "/trainkit/runs"} in rpod["containers"][0]["volumeMounts"]
    text = yaml.safe_dump_all(docs.values())
    assert "bob" not in text and ":pw@" not in text
    assert any("'trainkit-runs'" in n for n in notes) and any("Secret 'mlflow-credentials'" in n for n in notes)


def test_trainjob_shipped_recipe_detects_the_shape_the_torch_plugin_gives(tmp_path):
    """The ConfigMap's recipe in a pod with the PET_* the TrainJob makes (v2.3.0 torch plugin): nnodes,
    nproc_per_node, the rendezvous at node 0 and the TrainJob's name as rendezvous id."""
    from trainkit.cluster import detect
    from trainkit.recipe import resolve

    docs, _ = trainjob_docs(tmp_path, 4, True)
    job = docs["TrainJob"]
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    shipped = tmp_path / "shipped.yaml"
    shipped.write_text(next(iter(docs["ConfigMap"]["data"].values())))
    env = {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
           "PET_NODE_RANK": "3", "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500",
           "HOSTNAME": f"{name}-node-0-3"}
    d = detect(env, resolve(shipped).recipe, gpus=4)
    assert d.kind == "trainer-v2" and not d.replaced
    assert d.values == {"nnodes": 4, "node_rank": 3, "nproc_per_node": 4, "rdzv_endpoint": f"{name}-node-0-0.{name}:29500",
                        "rdzv_id": name}


def test_trainjob_on_kubeflows_torch_runtime_brings_its_own_volumes(tmp_path):
    docs, notes = trainjob_docs(tmp_path, 2, True, runtime="torch-distributed", run_dir_pvc="runs-pvc")
    assert list(docs) == ["ConfigMap", "TrainJob"]
    validate(docs["TrainJob"])
    assert docs["TrainJob"]["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    pod = (docs["TrainJob"]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
           ["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "runs-pvc"}} in pod["volumes"]
    assert {"name": "runs", "mountPath": "/trainkit/runs"} in pod["containers"][0]["volumeMounts"]
    _, notes = trainjob_docs(tmp_path, 2, False, runtime="torch-distributed")
    assert any("checkpoints live on each pod" in n for n in notes)


def test_k8s_api_trainjob_from_the_command_line(tmp_path):
    recipe = mlp_recipe(tmp_path, "cli-tj", launch={"nproc_per_node": 1})
    docs, notes = k8s_docs(tmp_path, str(recipe), "launch.nnodes=2", "--api", "trainjob", "--image", "img",
                           "--gpus-per-node", "0", "--with-runtime", "--runtime", "trainkit-v1", "--run-dir-pvc", "shared-runs")
    for doc in docs:
        if doc["kind"] != "ConfigMap":
            validate(doc)
    runtime, _, job = docs
    assert job["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"] == "trainkit-v1"
    assert job["spec"]["trainer"]["numNodes"] == 2
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "shared-runs"}} in \
        runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"]
    assert "'shared-runs'" in notes


@pytest.mark.parametrize("args, message", [
    (["--api", "trainjobs"], "did you mean 'trainjob'?"),
    (["--api", "PyTorchJob"], "did you mean 'pytorchjob'?"),
    (["--api", "trainjob", "--runtime", "Torch_Distributed"], "--runtime 'Torch_Distributed' is not a valid"),
    (["--api", "trainjob", "--gpus-per-node", "2"], "launch.backend is gloo"),
    (["--gpus-per-node", "2"], "launch.backend is gloo"),
    (["--api", "trainjob", "launch.nnodes='2:4'"], "Kubeflow Trainer v2 has no elastic policy"),
    (["--runtime", "torch-distributed"], "for --api trainjob"),
    (["--api", "trainjob", "--run-dir-pvc", "x"], "pass --run-dir-pvc together with --with-runtime"),
])
def test_k8s_refuses_what_cannot_make_a_working_job(tmp_path, args, message):
    recipe = mlp_recipe(tmp_path, "bad", launch={"backend": "gloo", "rdzv_endpoint": "x:1"})
    overrides = [a for a in args if "=" in a]
    options = [a for a in args if "=" not in a]
    r = trainkit(tmp_path, "k8s", str(recipe), *overrides, "--image", "i", *options, "-o", "x.yaml", timeout=60)
    assert r.returncode == 2, r.output
    assert message in r.stderr and not (tmp_path / "x.yaml").exists()


def test_a_job_for_a_backend_auto_recipe_asks_which_and_a_gpu_job_requests_its_gpus(tmp_path):
    """Issue 27: with `backend: auto` the writers requested no GPU, so on clusters that expose only
    requested GPUs the job trained on the CPU without a word. Now they ask for --gpus-per-node; a GPU
    job requests one per process and ships `launch.backend: nccl`, so a node without CUDA fails at
    start instead of training on the CPU; --gpus-per-node 0 writes a CPU job."""
    recipe = mlp_recipe(tmp_path, "auto", launch={"nnodes": 2, "nproc_per_node": 4, "rdzv_endpoint": "x:1"})
    for command in (("slurm", str(recipe)), ("k8s", str(recipe), "--image", "i"),
                    ("k8s", str(recipe), "--image", "i", "--api", "trainjob")):
        r = trainkit(tmp_path, *command, "-o", "out", timeout=60)
        assert r.returncode == 2 and "--gpus-per-node 4" in r.stderr and "--gpus-per-node 0" in r.stderr, r.output
        assert not (tmp_path / "out").exists()
    r = trainkit(tmp_path, "slurm", str(recipe), "--gpus-per-node", "4", timeout=60)
    assert r.returncode == 0, r.output
    assert "#SBATCH --gpus-per-node=4" in r.stdout and r.stdout.rstrip().endswith("launch.backend=nccl")
    docs, _ = k8s_docs(tmp_path, str(recipe), "--image", "i", "--gpus-per-node", "4")
    pod = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert yaml.safe_load(docs[0]["data"]["auto.yaml"])["launch"]["backend"] == "nccl"
    docs, _ = k8s_docs(tmp_path, str(recipe), "--image", "i", "--api", "trainjob", "--gpus-per-node", "4")
    job = docs[-1]
    assert job["spec"]["trainer"]["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 4
    validate(job)
    cpu = trainkit(tmp_path, "slurm", str(recipe), "--gpus-per-node", "0", timeout=60)
    assert cpu.returncode == 0 and "--gpus-per-node" not in cpu.stdout and "launch.backend=nccl" not in cpu.stdout
