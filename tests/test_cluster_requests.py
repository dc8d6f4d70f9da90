"""What the written jobs ask the scheduler for on each node (issue 41, items 3 and 4): the CPUs a SLURM
step gets, and a Kubernetes pod's CPUs, memory, /dev/shm and RDMA devices (trainkit/cluster/node_resources.py).

In-process: `sbatch_script` and `trainkit k8s` through `trainkit.cli.main` (the command's own path: the
recipe, the memory plan, the DataLoader's shared memory), the manifests checked against the Kubeflow CRDs.
The step's CPUs inside a real job step: tests/test_cluster_slurm.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch  # noqa: F401 -- at collection: torch's first import runs ldconfig (a process); `trainkit k8s` imports it
import yaml

from run_helpers import mlp_recipe
from test_cluster_generators import validate

from trainkit.doctor.resources import CUDA_PROCESS_HOST_BYTES

GiB, MiB = 1 << 30, 1 << 20
RDMA = "rdma/hca_shared_devices_a"
# 2 ranks x 4 DataLoader workers of 64-image batches: shared memory 2 x 4 x prefetch 2 x 64 x 3x224x224 fp32
# (+ an int64 label) = 616.6 MB; /dev/shm is twice that in whole GiB: 2Gi
IMAGES = {"data": {"num_workers": 4, "batch_size": 64, "shape": [3, 224, 224]},
          "model": {"name": "mlp", "args": {"in_features": 3 * 224 * 224, "hidden": 64, "num_classes": 4}}}


def test_the_slurm_step_gets_the_cpus_the_job_asked_for(tmp_path):
    """Since Slurm 22.05 srun does not take --cpus-per-task from the allocation: without
    SRUN_CPUS_PER_TASK the step (both ranks and their 8 DataLoader workers) would run on one CPU."""
    from trainkit.cluster.slurm import sbatch_script
    from trainkit.recipe import resolve

    recipe = mlp_recipe(tmp_path, "cpus", launch={"nproc_per_node": 2, "backend": "nccl"}, data={"num_workers": 4})
    lines = sbatch_script(resolve(recipe), str(recipe)).splitlines()
    assert "#SBATCH --cpus-per-task=10" in lines  # 2 ranks x (1 + 4 workers)
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines.index("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK") < srun
    # the launcher divides the step's CPUs among the ranks (OMP_NUM_THREADS); the script must not give
    # each rank all of them
    assert not any("OMP_NUM_THREADS" in line for line in lines)


def test_a_recipe_that_leaves_the_ranks_to_the_gpus_gets_a_cpu_per_rank_it_will_start(tmp_path, capsys):
    """No launch.nproc_per_node: the launcher starts one rank per GPU, so 8 GPUs make 8 ranks, each with
    its 2 DataLoader workers -- 24 CPUs, as `trainkit k8s` asks for the same recipe; and the job's
    memory, the same figure as the pod's, is the script's --mem."""
    from trainkit.cli import main

    recipe = mlp_recipe(tmp_path, "by-gpus", launch={"backend": "nccl"}, data={"num_workers": 2})
    text = yaml.safe_load(recipe.read_text())
    del text["launch"]["nproc_per_node"]
    recipe.write_text(yaml.safe_dump(text))
    script = tmp_path / "job.sbatch"
    assert main(["slurm", str(recipe), "--gpus-per-node", "8", "-o", str(script)]) == 0
    lines = script.read_text().splitlines()
    assert "#SBATCH --cpus-per-task=24" in lines and "#SBATCH --gpus-per-node=8" in lines
    docs, code = k8s(tmp_path, recipe, "--gpus-per-node", "8")
    resources = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]
    assert code == 0 and resources["requests"]["cpu"] == 24
    assert f"#SBATCH --mem={int(resources['limits']['memory'].removesuffix('Gi')) * 1024}M" in lines


def k8s(tmp_path, recipe: Path, *args: str) -> tuple[list[dict], int]:
    from trainkit.cli import main

    out = tmp_path / "job.yaml"
    out.unlink(missing_ok=True)
    code = main(["k8s", str(recipe), "--image", "reg/trainkit:1", *args, "-o", str(out)])
    return (list(yaml.safe_load_all(out.read_text())) if out.exists() else []), code


def plan_figures(recipe: Path) -> tuple[int, int]:
    """(host memory per rank on a GPU node, parameters), as the memory plan says."""
    from trainkit.doctor.resources import host_memory_per_rank
    from trainkit.recipe import resolve
    from trainkit.runtime.memory_trace import model_sizes

    r = resolve(recipe).recipe
    return host_memory_per_rank(r, "cuda")[0], model_sizes(r).parameters


def test_a_pod_asks_for_the_cpus_memory_and_shared_memory_its_ranks_and_workers_use(tmp_path, capsys):
    recipe = mlp_recipe(tmp_path, "pods", launch={"nproc_per_node": 2, "backend": "nccl"}, **IMAGES)
    docs, code = k8s(tmp_path, recipe)
    assert code == 0
    validate(docs[1])
    pod = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    container = pod["containers"][0]
    host, parameters = plan_figures(recipe)
    # DDP builds the whole fp32 model on the host before moving it to the GPU, beside the rank's own process
    assert host >= parameters * 4 + CUDA_PROCESS_HOST_BYTES
    # each of the 8 DataLoader workers holds memory of its own beside the rank's (LOADER_WORKER_BYTES)
    memory = f"{math.ceil(1.25 * (2 * host + 8 * 256 * MiB + 560 * MiB + 2 * GiB) / GiB)}Gi"
    assert memory == "11Gi"  # docs/clusters.md's example
    assert container["resources"] == {"requests": {"cpu": 10, "memory": memory},
                                      "limits": {"memory": memory, "nvidia.com/gpu": 2}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    assert "securityContext" not in container
    assert f"each node asks for cpu 10 = 2 rank(s) x (1 + 4 DataLoader worker(s)); memory {memory}" in \
        capsys.readouterr().err


def test_rdma_devices_are_requested_with_ipc_lock_and_their_network_for_either_api(tmp_path, capsys):
    networks = {"annotations": {"k8s.v1.cni.cncf.io/networks": "rdma-net-a,infra/rdma-net-b"}}
    recipe = mlp_recipe(tmp_path, "rdma", launch={"nproc_per_node": 2, "backend": "nccl"}, **IMAGES)
    docs, code = k8s(tmp_path, recipe, "--rdma-resource", f"{RDMA}=1", "--network", "rdma-net-a",
                     "--network", "infra/rdma-net-b")
    assert code == 0
    validate(docs[1])
    template = docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    container = template["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["requests"][RDMA] == resources["limits"][RDMA] == 1
    assert resources["requests"]["cpu"] == 10 and resources["limits"]["nvidia.com/gpu"] == 2
    assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert template["metadata"]["annotations"] == networks["annotations"]  # Multus attaches the RDMA network

    docs, code = k8s(tmp_path, recipe, "--api", "trainjob", "--runtime", "torch-distributed", "--rdma-resource", RDMA,
                     "--network", "rdma-net-a", "--network", "infra/rdma-net-b")
    assert code == 0
    job = docs[-1]
    validate(job)
    assert job["spec"]["trainer"]["resourcesPerNode"] == resources  # the same requests, for the TrainJob's nodes
    template = (job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
                ["template"]["spec"]["template"])
    pod = template["spec"]
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    assert template["metadata"] == networks
    capsys.readouterr()

    docs, code = k8s(tmp_path, recipe, "--rdma-resource", RDMA)  # without its network: said, not guessed
    assert code == 0 and "metadata" not in docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert "annotations" not in docs[1]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]
    assert "RDMA devices without --network" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["RDMA_net", "a/b/c", "net-"])
def test_a_network_kubernetes_could_not_name_is_refused(tmp_path, bad, capsys):
    recipe = mlp_recipe(tmp_path, "bad-net", launch={"backend": "nccl"})
    docs, code = k8s(tmp_path, recipe, "--network", bad)
    assert code == 2 and not docs and f"--network {bad!r}" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["kubernetes.io/rdma=1", "hca_shared_devices_a=1", f"{RDMA}=0", f"{RDMA}=two",
                                 "nvidia.com/gpu=1", "nvidia.com/mig-1g.10gb=1"])
def test_an_rdma_resource_kubernetes_would_reject_is_refused(tmp_path, bad, capsys):
    recipe = mlp_recipe(tmp_path, "bad-rdma", launch={"backend": "nccl"})
    docs, code = k8s(tmp_path, recipe, "--rdma-resource", bad)
    assert code == 2 and not docs
    assert f"--rdma-resource {bad!r}" in capsys.readouterr().err


def test_without_a_plan_each_rank_counts_a_stated_default_and_a_cpu_pod_its_whole_plan(tmp_path):
    from trainkit.cluster.node_resources import DEFAULT_HOST_PER_RANK, node_resources
    from trainkit.doctor.resources import host_memory_per_rank, memory_verdict
    from trainkit.recipe import resolve

    recipe = resolve(mlp_recipe(tmp_path, "cpu-pod", launch={"nproc_per_node": 2, "backend": "gloo"}, **IMAGES)).recipe
    default = node_resources(recipe, 2, host_per_rank=None, shm_need=None)
    assert default.memory == math.ceil(1.25 * (2 * DEFAULT_HOST_PER_RANK + 8 * 256 * MiB + 560 * MiB + GiB) / GiB) * GiB
    assert default.shm == GiB and default.cpus == 10
    assert any("did not size this model" in n for n in default.notes)
    assert any("/dev/shm gets the 1 GiB minimum" in n for n in default.notes)
    host, _ = host_memory_per_rank(recipe, "cpu")  # on a CPU node a rank's whole plan is host memory
    assert host == memory_verdict(recipe).plan.per_rank


@pytest.mark.parametrize("mem, line", [("none", None), ("200G", "#SBATCH --mem=200G"), ("2t", "refused")])
def test_the_slurm_memory_request_can_be_left_to_the_site_or_given(tmp_path, capsys, mem, line):
    from trainkit.cli import main

    recipe = mlp_recipe(tmp_path, "mem", launch={"nproc_per_node": 2, "backend": "gloo"})
    script = tmp_path / "job.sbatch"
    code = main(["slurm", str(recipe), "--mem", mem, "-o", str(script)])
    if line == "refused":
        assert code == 2 and not script.exists() and "--mem '2t'" in capsys.readouterr().err
        return
    lines = script.read_text().splitlines()
    assert code == 0 and [x for x in lines if x.startswith("#SBATCH --mem")] == ([line] if line else [])
    assert "memory" in capsys.readouterr().err  # how the node was sized, as `trainkit k8s` says it
