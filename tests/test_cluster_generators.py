"""`trainkit k8s` and `trainkit slurm`: the files they write, checked against the PyTorchJob CRD and
by bash, and the requests they refuse (exit 2, nothing written)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from run_helpers import mlp_recipe, trainkit

SHARED = Path(__file__).resolve().parents[2] / "shared"
CRD = SHARED / "k8s" / "kubeflow.org_pytorchjobs.v1.9.0.yaml"


def crd_schema() -> dict:
    if not CRD.is_file():
        pytest.skip(f"the PyTorchJob CRD is not at {CRD} (the ../shared reference folder beside the repository)")
    return yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


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
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
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
    docs, notes = k8s_docs(tmp_path, str(recipe), "--image", "img")
    job = docs[1]
    jsonschema.validate(job, schema)
    assert job["metadata"]["name"] == "my-run-v2" and "'my-run-v2'" in notes
    assert job["spec"]["elasticPolicy"]["minReplicas"] == 2 and job["spec"]["elasticPolicy"]["maxReplicas"] == 4
    assert "checkpoints live on each pod" in notes


def test_k8s_refuses_a_bad_namespace(tmp_path):
    recipe = mlp_recipe(tmp_path, "ns")
    r = trainkit(tmp_path, "k8s", str(recipe), "--image", "i", "--namespace", "Bad_NS", "-o", "x.yaml", timeout=60)
    assert r.returncode == 2 and "not a valid Kubernetes namespace" in r.stderr and not (tmp_path / "x.yaml").exists()


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
