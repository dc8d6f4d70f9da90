"""Environment detection: what a PyTorchJob pod (cube-studio / older operator, training-operator v1.9),
a Kubeflow Trainer v2 pod and a SLURM step decide for `trainkit run`, from their exact variables."""

from __future__ import annotations

import pytest

from run_helpers import mlp_recipe
from trainkit.cluster import ClusterError, applied, detect, detect_here
from trainkit.cluster.detect import first_host, kind_of
from trainkit.recipe import resolve
from trainkit.recipe.launch_plan import torchrun_command

OLD_OPERATOR_WORKER = {"MASTER_ADDR": "pytorchjob-abc-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4",
                       "RANK": "2", "HOSTNAME": "pytorchjob-abc-worker-1", "PYTHONUNBUFFERED": "0"}
V19_WORKER = {"MASTER_ADDR": "resnet-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "32", "RANK": "3",
              "PET_MASTER_ADDR": "resnet-master-0", "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "8",
              "PET_NODE_RANK": "3", "PET_NNODES": "4", "HOSTNAME": "resnet-worker-2"}
TRAINER_V2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "1",
              "PET_MASTER_ADDR": "tj-node-0-0.tj", "PET_MASTER_PORT": "29400", "JOBSET_NAME": "tj",
              "HOSTNAME": "tj-node-0-1-x7k"}
SLURM_NODE1 = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1",
               "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]",
               "SLURM_GPUS_ON_NODE": "8"}


def recipe(tmp_path, *overrides, **launch):
    path = mlp_recipe(tmp_path, "det", launch={"run_dir": str(tmp_path / "runs"), **launch})
    return resolve(path, list(overrides))


def test_old_operator_pods_are_nodes_and_the_pod_index_is_the_node_rank(tmp_path):
    # resnet152-style recipe: nnodes 1 in the file, run as a 4-pod job
    r = recipe(tmp_path, nproc_per_node=1, nnodes=1)
    d = detect(OLD_OPERATOR_WORKER, r.recipe)
    assert d.kind == "kubeflow"
    assert d.values == {"nnodes": 4, "node_rank": 2, "rdzv_endpoint": "pytorchjob-abc-master-0:23456",
                        "rdzv_id": "pytorchjob-abc", "nproc_per_node": 1}
    assert d.sources["nnodes"].startswith("WORLD_SIZE=4") and d.sources["nproc_per_node"] == "recipe"
    assert d.replaced == ["nnodes 1"] and "replacing the recipe's nnodes 1" in d.announcement()
    new = applied(r, d)
    assert new.recipe.launch.nnodes == 4 and new.recipe.world_size == 4 and r.recipe.launch.nnodes == 1
    cmd = torchrun_command(new.recipe, "RUN")
    assert "--rdzv-endpoint=pytorchjob-abc-master-0:23456" in cmd and "--rdzv-id=pytorchjob-abc" in cmd
    assert new.raw["launch"]["nnodes"] == 4 and "node_rank" not in new.data["launch"]


def test_v19_pet_variables_define_the_topology_not_world_size(tmp_path):
    d = detect(V19_WORKER, recipe(tmp_path).recipe, gpus=8)
    assert d.kind == "kubeflow-v1.9"
    assert (d.values["nnodes"], d.values["node_rank"]) == (4, 3)  # not WORLD_SIZE=32 / RANK
    assert d.values["rdzv_id"] == "resnet"
    assert any("WORLD_SIZE=32 counts processes" in n for n in d.notes)
    # the recipe (mlp_recipe) sets nproc_per_node 2: it wins over PET_NPROC_PER_NODE
    assert d.values["nproc_per_node"] == 2


def test_nproc_per_node_from_pet_then_visible_gpus_then_one_cpu_process(tmp_path):
    path = mlp_recipe(tmp_path, "np", launch={"run_dir": str(tmp_path / "runs")})
    text = path.read_text().replace("  nproc_per_node: 2\n", "")
    path.write_text(text)
    r = resolve(path).recipe
    assert "nproc_per_node" not in r.launch.model_fields_set
    assert detect(V19_WORKER, r, gpus=8).values["nproc_per_node"] == 8
    auto = dict(V19_WORKER, PET_NPROC_PER_NODE="auto")
    assert detect(auto, r, gpus=4).values["nproc_per_node"] == 4
    d = detect(auto, r, gpus=0)
    assert d.values["nproc_per_node"] == 1 and "CPU" in d.sources["nproc_per_node"]
    with pytest.raises(ClusterError, match="nproc_per_node 8 .* only 2 GPU"):
        detect(V19_WORKER, r, gpus=2)


def test_trainer_v2_is_recognised_from_pet_variables_alone(tmp_path):
    assert kind_of(TRAINER_V2) == "trainer-v2"
    d = detect(TRAINER_V2, recipe(tmp_path).recipe)
    assert d.kind == "trainer-v2" and d.values["rdzv_endpoint"] == "tj-node-0-0.tj:29400"
    assert (d.values["nnodes"], d.values["node_rank"], d.values["rdzv_id"]) == (2, 1, "tj")


def test_elastic_pytorchjob_uses_the_operators_rendezvous(tmp_path):
    env = dict(V19_WORKER, PET_NNODES="2:4", PET_RDZV_ENDPOINT="resnet-master-0:29400")
    d = detect(env, recipe(tmp_path).recipe)
    assert d.values["nnodes"] == "2:4" and d.values["rdzv_endpoint"] == "resnet-master-0:29400"


def test_slurm_step(tmp_path):
    d = detect(SLURM_NODE1, recipe(tmp_path).recipe, gpus=8)
    assert d.kind == "slurm"
    assert (d.values["nnodes"], d.values["node_rank"], d.values["rdzv_id"]) == (2, 1, "slurm-4242")
    assert d.values["rdzv_endpoint"] == "gpu07:29642"  # 29400 + 4242 % 1000
    single = {"SLURM_JOB_ID": "7", "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
              "SLURM_JOB_NODELIST": "localhost"}
    new = applied(recipe(tmp_path), detect(single, recipe(tmp_path).recipe))
    assert new.recipe.launch.rdzv_endpoint is None and "--standalone" in torchrun_command(new.recipe, "R")


def test_slurm_needs_one_srun_task_per_node(tmp_path):
    with pytest.raises(ClusterError, match="one task per node"):
        detect(dict(SLURM_NODE1, SLURM_NTASKS="16"), recipe(tmp_path).recipe, gpus=8)
    batch_only = {k: v for k, v in SLURM_NODE1.items() if k not in ("SLURM_STEP_ID", "SLURM_PROCID")}
    with pytest.raises(ClusterError, match="srun"):
        detect(batch_only, recipe(tmp_path).recipe, gpus=8)


@pytest.mark.parametrize("nodelist, first", [("gpu[07-08]", "gpu07"), ("n1,n2", "n1"), ("a[3,5-6],b1", "a3"),
                                             ("node", "node"), ("rack1-[002-004]-ib", "rack1-002-ib")])
def test_first_host_of_a_nodelist(nodelist, first):
    assert first_host(nodelist) == first


def test_a_pod_without_master_addr_is_an_error():
    env = {k: v for k, v in OLD_OPERATOR_WORKER.items() if k != "MASTER_ADDR"}
    assert kind_of(env) == "kubeflow"  # recognised from the pod name
    with pytest.raises(ClusterError, match="MASTER_ADDR is missing"):
        detect(env, resolve_default())


def resolve_default():
    import tempfile
    from pathlib import Path

    return recipe(Path(tempfile.mkdtemp())).recipe


def test_command_line_override_contradicting_the_environment_names_both(tmp_path):
    r = recipe(tmp_path, "launch.nnodes=2")
    with pytest.raises(ClusterError, match=r"launch.nnodes=2 on the command line .* WORLD_SIZE=4 \(pods\) gives 4"):
        detect_here(r, gpus=0, env=OLD_OPERATOR_WORKER)
    agreeing = recipe(tmp_path, "launch.nnodes=4")
    assert detect_here(agreeing, gpus=0, env=OLD_OPERATOR_WORKER).values["nnodes"] == 4


def test_inside_torchrun_or_cluster_none_means_no_detection(tmp_path):
    assert not detect(dict(OLD_OPERATOR_WORKER, LOCAL_RANK="0"), recipe(tmp_path).recipe).found
    assert not detect(OLD_OPERATOR_WORKER, recipe(tmp_path, "launch.cluster=none").recipe).found
    assert not detect({"HOME": "/root"}, recipe(tmp_path).recipe).found
    with pytest.raises(ClusterError, match="not a PyTorchJob pod"):
        detect({}, recipe(tmp_path, "launch.cluster=kubeflow").recipe)


def test_interpolated_integers_are_numbers(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("NPROC", "2")
    r = recipe(tmp_path, "launch.nnodes=${oc.env:WORLD_SIZE}", "launch.nproc_per_node=${oc.env:NPROC}",
               "launch.rdzv_endpoint=h:1")
    assert r.recipe.launch.nnodes == 3 and r.recipe.launch.nproc_per_node == 2 and r.recipe.world_size == 6


def test_plan_shows_what_was_detected_and_where_from(tmp_path, monkeypatch):
    from trainkit.recipe.plan import describe

    for k, v in OLD_OPERATOR_WORKER.items():
        monkeypatch.setenv(k, v)
    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    text = describe(recipe(tmp_path), "det.yaml", [])
    assert "Kubeflow PyTorchJob pod" in text and "WORLD_SIZE=4 (pods)" in text
    assert "--rdzv-endpoint=pytorchjob-abc-master-0:23456" in text
