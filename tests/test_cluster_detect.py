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


# --------------------------------------------------------------------------- Kubeflow Trainer v2 (TrainJob)
# exactly what the v2.3.0 torch plugin injects (pkg/runtime/framework/plugins/torch/torch.go), nothing else
TRAINER_V2_NODE1 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
                    "PET_MASTER_ADDR": "train-mlp-node-0-0.train-mlp", "PET_MASTER_PORT": "29500",
                    "HOSTNAME": "train-mlp-node-0-1", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}


def test_trainer_v2_and_v19_pytorchjob_are_told_apart_by_master_addr_and_world_size():
    assert kind_of(TRAINER_V2_NODE1) == "trainer-v2"
    assert kind_of(dict(TRAINER_V2_NODE1, MASTER_ADDR="x")) == "kubeflow-v1.9"
    assert kind_of(dict(TRAINER_V2_NODE1, WORLD_SIZE="2")) == "kubeflow-v1.9"
    assert kind_of(dict(TRAINER_V2_NODE1, LOCAL_RANK="0")) == "none"  # a worker under torchrun


def test_trainer_v2_rendezvous_id_is_the_trainjob_name(tmp_path):
    r = recipe(tmp_path, nproc_per_node=1).recipe
    d = detect(TRAINER_V2_NODE1, r)
    assert d.values == {"nnodes": 2, "node_rank": 1, "nproc_per_node": 1, "rdzv_endpoint":
                        "train-mlp-node-0-0.train-mlp:29500", "rdzv_id": "train-mlp"}
    assert d.sources["rdzv_id"].startswith("PET_MASTER_ADDR=") and d.sources["nnodes"] == "PET_NNODES=2"
    by_hostname = {k: v for k, v in TRAINER_V2_NODE1.items() if k != "PET_MASTER_ADDR"}
    by_hostname["PET_MASTER_ADDR"] = "10.0.0.7"  # an address the name cannot be read from
    d = detect(by_hostname, r)
    assert d.values["rdzv_id"] == "train-mlp" and d.sources["rdzv_id"].startswith("HOSTNAME=")
    anonymous = dict(by_hostname, HOSTNAME="box")
    assert "rdzv_id" not in detect(anonymous, r).values
    assert any("no TrainJob name" in n for n in detect(anonymous, r).notes)


def test_plan_shows_a_trainjob_pods_values_and_their_sources(tmp_path, monkeypatch):
    from trainkit.recipe.plan import describe

    for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "WORLD_SIZE", "RANK", "JOBSET_NAME",
              "TRAINKIT_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in TRAINER_V2_NODE1.items():
        monkeypatch.setenv(k, v)
    text = describe(recipe(tmp_path, nproc_per_node=1), "det.yaml", [])
    assert "Kubeflow Trainer v2 TrainJob pod" in text and "(PET_NNODES=2)" in text
    assert "rdzv_id:        train-mlp  (PET_MASTER_ADDR=" in text
    assert "--rdzv-endpoint=train-mlp-node-0-0.train-mlp:29500" in text


def test_launch_cluster_trainjob_requires_a_trainjob_pod(tmp_path):
    with pytest.raises(ClusterError, match="launch.cluster is trainjob but this is a Kubeflow PyTorchJob pod"):
        detect(V19_WORKER, recipe(tmp_path, "launch.cluster=trainjob").recipe)
    with pytest.raises(ClusterError, match="launch.cluster is trainjob but PET_NNODES"):
        detect({}, recipe(tmp_path, "launch.cluster=trainjob").recipe)


def test_a_recipe_written_for_a_trainjob_must_match_its_node_count(tmp_path):
    """`trainkit k8s --api trainjob` ships the recipe with launch.cluster: trainjob and its nnodes: a TrainJob
    whose numNodes differs is refused; under auto the TrainJob's count replaces the recipe's, as elsewhere."""
    mine = recipe(tmp_path, cluster="trainjob", nnodes=4, nproc_per_node=1).recipe
    with pytest.raises(ClusterError, match=r"launch.nnodes 4 \(recipe, launch.cluster: trainjob\) contradicts this "
                                           r"TrainJob: PET_NNODES=2"):
        detect(TRAINER_V2_NODE1, mine)
    assert detect(TRAINER_V2_NODE1, recipe(tmp_path, cluster="trainjob", nnodes=2, nproc_per_node=1).recipe).found
    assert detect(TRAINER_V2_NODE1, recipe(tmp_path, cluster="trainjob", nnodes="1:3", nproc_per_node=1).recipe).found
    d = detect(TRAINER_V2_NODE1, recipe(tmp_path, nnodes=4, nproc_per_node=1).recipe)
    assert d.values["nnodes"] == 2 and d.replaced == ["nnodes 4"]


@pytest.mark.slow
def test_trainkit_run_refuses_a_trainjob_with_another_node_count(tmp_path):
    from run_helpers import trainkit

    path = mlp_recipe(tmp_path, "tj", launch={"run_dir": str(tmp_path / "runs"), "cluster": "trainjob", "nnodes": 4,
                                              "nproc_per_node": 1})
    r = trainkit(tmp_path, "run", str(path), timeout=120, **TRAINER_V2_NODE1)
    assert r.returncode == 2, r.output
    assert "contradicts this TrainJob: PET_NNODES=2" in r.stderr and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_recipe_valid_for_its_own_world_is_refused_before_launch_when_the_cluster_changes_it(tmp_path):
    """issue 38 #5: a recipe valid for world 1 (its mesh: 1 rank) under a 2-node TrainJob's environment ran
    on both nodes and failed there with exit 1; the rules now run again on the world the cluster gives it,
    and it is refused before anything starts, naming the key."""
    from run_helpers import trainkit

    path = mlp_recipe(tmp_path, "world1", launch={"run_dir": str(tmp_path / "runs"), "nproc_per_node": 1},
                      parallel={"dp_replicate": 1})
    assert trainkit(tmp_path, "validate", str(path), timeout=60).returncode == 0
    r = trainkit(tmp_path, "run", str(path), timeout=120, **TRAINER_V2_NODE1)
    assert r.returncode == 2, r.output
    assert "parallel" in r.stderr and "not with the world this cluster gives it" in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()
    shown = trainkit(tmp_path, "plan", str(path), timeout=120, **TRAINER_V2_NODE1)  # plan names it too
    assert "cannot start here: not valid with this cluster's world (2 ranks): parallel" in shown.stdout, shown.output
