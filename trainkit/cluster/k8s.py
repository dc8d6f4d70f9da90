"""`trainkit k8s`: the Kubernetes objects that run a recipe, for either Kubeflow API.

- `--api pytorchjob` (default): a training-operator v1 PyTorchJob (kubeflow.org/v1), Master + Workers.
- `--api trainjob`: a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) that references a
  ClusterTrainingRuntime: trainkit's own (`trainkit-distributed`, written with `--with-runtime`, installed
  once per cluster) or Kubeflow's `torch-distributed` (`--runtime torch-distributed`).

Both carry the recipe in a ConfigMap mounted at /recipes, and every pod runs `trainkit run /recipes/<file>`;
detection (detect.py) then reads the operator's variables, so the recipe needs no per-node launch values.
Secrets never enter the manifest: the recipe keeps its `${oc.env:...}` references, the MLflow URI goes in
without credentials, and MLFLOW_TRACKING_USERNAME/PASSWORD come from a referenced Secret.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

import yaml

from ..recipe import secrets
from . import gpus
from .node_resources import NodeResources, node_resources, quantity
from .quoting import comment_text

API_VERSION = "kubeflow.org/v1"
TRAINER_API_VERSION = "trainer.kubeflow.org/v1alpha1"
APIS = ("pytorchjob", "trainjob")
PORT = 23456  # the operator's default PyTorchJob port (MASTER_PORT)
TRAINER_PORT = 29500  # Trainer v2's PET_MASTER_PORT (constants.ContainerTrainerPort)
RECIPES_MOUNT = "/recipes"
RUN_DIR_MOUNT = "/trainkit/runs"
MAX_JOB_NAME = 40  # pods are <job>-worker-<N>, services carry the same name: stay far below 63
TRAINKIT_RUNTIME = "trainkit-distributed"
TORCH_RUNTIME = "torch-distributed"
RUN_DIR_CLAIM = "trainkit-runs"  # the PVC trainkit's runtime mounts at RUN_DIR_MOUNT, in the TrainJob's namespace
PATCH_MANAGER = "trainkit"  # runtimePatches entries are keyed by who wrote them
ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
SUBDOMAIN_RULE = ("a DNS-1123 subdomain: lowercase letters, digits, '-' and '.', starting and ending with a letter "
                  "or digit, at most 253 characters")
LABEL_RULE = ("a DNS-1123 label: lowercase letters, digits and '-', starting and ending with a letter or digit, at "
              "most 63 characters")


class K8sError(Exception):
    """The request cannot make a working job (exit 2, nothing written)."""


def check_names(*, namespace: Optional[str] = None, run_dir_pvc: Optional[str] = None,
                mlflow_secret: Optional[str] = None, runtime: Optional[str] = None) -> None:
    """Refuse a name given on the command line that Kubernetes would reject (K8sError, naming the flag and the
    rule): the API server refuses the whole manifest, or the pod waits forever for a volume it cannot mount.
    A namespace is a DNS-1123 label; Secret, PersistentVolumeClaim and ClusterTrainingRuntime names are
    DNS-1123 subdomains."""
    for flag, value, what, label in (("--namespace", namespace, "namespace", True),
                                     ("--run-dir-pvc", run_dir_pvc, "PersistentVolumeClaim name", False),
                                     ("--mlflow-secret", mlflow_secret, "Secret name", False),
                                     ("--runtime", runtime, "ClusterTrainingRuntime name", False)):
        if value is None:
            continue
        pattern, limit, rule = (DNS_LABEL, 63, LABEL_RULE) if label else (DNS_SUBDOMAIN, 253, SUBDOMAIN_RULE)
        if len(value) > limit or not pattern.fullmatch(value):
            raise K8sError(f"{flag} {value!r} is not a valid Kubernetes {what}: it must be {rule}"
                           + (f" (e.g. {TRAINKIT_RUNTIME} or {TORCH_RUNTIME})" if flag == "--runtime" else ""))


@dataclass
class Manifest:
    documents: list[dict]
    job_name: str
    notes: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "---\n".join(yaml.safe_dump(d, sort_keys=False) for d in self.documents)


def dns_name(name: str) -> str:
    """A DNS-1035 label from a recipe name: lowercase letters, digits and '-', starting with a letter."""
    out = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    out = re.sub(r"-{2,}", "-", out)
    if not out or not out[0].isalpha():
        out = "tk-" + out
    return out[:MAX_JOB_NAME].rstrip("-")


def _bare_uri(uri: str) -> tuple[str, bool]:
    """The URI without user:password@, and whether it had any."""
    if "://" not in uri or "@" not in uri.split("://", 1)[1].split("/", 1)[0]:
        return uri, False
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, parts.fragment)), True


def _job_name(recipe, notes: list[str]) -> str:
    job = dns_name(recipe.name)
    if job != recipe.name:
        notes.append(f"recipe name {recipe.name!r} is not a valid Kubernetes name (lowercase letters, digits, '-'; "
                     f"at most {MAX_JOB_NAME} characters): the job is named {job!r}")
    return job


def gpus_for(la, gpus_per_node: Optional[int]) -> int:
    """nvidia.com/gpu per pod (cluster/gpus.py: nccl one per process, gloo none, auto: say it)."""
    gpus_per_node = gpus.gpus_per_node(la, gpus_per_node, K8sError)
    if gpus_per_node and "nproc_per_node" in la.model_fields_set and la.nproc_per_node > gpus_per_node:
        raise K8sError(f"launch.nproc_per_node {la.nproc_per_node} exceeds --gpus-per-node {gpus_per_node}")
    return gpus_per_node


def _tracking_env(resolved, mlflow_secret: str, notes: list[str]) -> tuple[list[dict[str, Any]], dict]:
    """The container's MLflow variables (credentials only by Secret reference) and the recipe's tracking block
    with a bare URI."""
    recipe = resolved.recipe
    tracking = dict(copy.deepcopy(secrets.redact(resolved.raw, ())).get("tracking") or {})
    env: list[dict[str, Any]] = []
    if recipe.tracking.enabled and recipe.tracking.uri and "${" not in str((resolved.raw.get("tracking") or {}).get("uri", "")):
        bare, had_credentials = _bare_uri(recipe.tracking.uri)
        tracking["uri"] = bare
        env.append({"name": "MLFLOW_TRACKING_URI", "value": bare})
        if had_credentials:
            notes.append(f"the tracking URI's credentials are not written here: create the Secret {mlflow_secret!r} "
                         f"with keys username and password")
    if recipe.tracking.enabled and (str(recipe.tracking.uri or "").startswith(("http://", "https://")) or env):
        env += [{"name": var, "valueFrom": {"secretKeyRef": {"name": mlflow_secret, "key": key, "optional": True}}}
                for var, key in (("MLFLOW_TRACKING_USERNAME", "username"), ("MLFLOW_TRACKING_PASSWORD", "password"))]
    elif recipe.tracking.enabled and not recipe.tracking.uri:
        notes.append("tracking.uri is not set: each pod would write its own SQLite store; set tracking.uri to an "
                     "MLflow server every pod reaches")
    return env, tracking


def _recipe_configmap(resolved, recipe_path: str, job: str, namespace: Optional[str], tracking: dict,
                      launch_update: dict) -> dict:
    """The ConfigMap `<job>-recipe` holding the composed recipe (`${oc.env:...}` stays a reference)."""
    composed = copy.deepcopy(secrets.redact(resolved.raw, ()))
    composed["launch"] = dict(composed.get("launch") or {}, **launch_update)
    if tracking:
        composed["tracking"] = tracking
    text = (f"# Composed by trainkit k8s from {comment_text(recipe_path)}; ${{oc.env:...}} references are resolved in each "
            f"pod\n" + yaml.safe_dump(composed, sort_keys=False))
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(f"{job}-recipe", namespace, job),
            "data": {Path(recipe_path).name: text}}


_NO_SHARED_STORAGE = ("no --run-dir-pvc: each pod keeps its own run directory (checkpoints live on each pod and are "
                      "lost with it); resume after a pod restart needs shared storage: pass --run-dir-pvc NAME")


def pytorchjob(resolved, recipe_path: str, *, image: str, namespace: Optional[str] = None,
               gpus_per_node: Optional[int] = None, run_dir_pvc: Optional[str] = None,
               mlflow_secret: str = "mlflow-credentials", resources: Optional[NodeResources] = None,
               networks: Sequence[str] = ()) -> Manifest:
    """The ConfigMap and the PyTorchJob that run this recipe on its launch.nnodes pods; each pod asks for
    `resources` (cluster/node_resources.py; None: its rules without a memory plan) and attaches the
    secondary `networks` (Multus)."""
    check_names(namespace=namespace, run_dir_pvc=run_dir_pvc, mlflow_secret=mlflow_secret)
    check_networks(networks)
    recipe = resolved.recipe
    la = recipe.launch
    notes: list[str] = []
    job = _job_name(recipe, notes)
    gpu_count = gpus_for(la, gpus_per_node)
    if not run_dir_pvc:
        notes.append(_NO_SHARED_STORAGE)
    env, tracking = _tracking_env(resolved, mlflow_secret, notes)
    configmap = _recipe_configmap(resolved, recipe_path, job, namespace, tracking,
                                  {**({"run_dir": RUN_DIR_MOUNT} if run_dir_pvc else {}),
                                   **gpus.pinned_backend(la, gpu_count)})
    file = Path(recipe_path).name
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the container and its port by this name
        "image": image,
        "command": ["trainkit", "run", f"{RECIPES_MOUNT}/{file}"],
        "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
        "env": env,
        "volumeMounts": [{"name": "recipe", "mountPath": RECIPES_MOUNT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    resources = _resources(resolved.recipe, gpus.nproc_for(la, gpu_count), resources, notes)
    _network_notes(resources, networks, notes)
    container["resources"] = resources.requirements(gpu_count)
    if resources.security_context():
        container["securityContext"] = resources.security_context()
    volumes: list[dict[str, Any]] = [{"name": "recipe", "configMap": {"name": f"{job}-recipe"}}, _dshm(resources)]
    if run_dir_pvc:
        container["volumeMounts"].append({"name": "runs", "mountPath": RUN_DIR_MOUNT})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": run_dir_pvc}})
    if not env:
        del container["env"]

    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": {"app.kubernetes.io/name": "trainkit", "trainkit/job": job},
                                          **_annotations(networks)},
                             "spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}}}

    spec: dict[str, Any] = {"nprocPerNode": str(gpus.nproc_for(la, gpu_count))}
    if isinstance(la.nnodes, str):  # MIN:MAX: elastic workers only; the operator names the c10d endpoint
        low, high = (int(x) for x in la.nnodes.split(":"))
        spec["elasticPolicy"] = {"minReplicas": low, "maxReplicas": high, "rdzvBackend": "c10d",
                                 "maxRestarts": la.max_restarts}
        spec["pytorchReplicaSpecs"] = {"Worker": replica(high)}
    else:
        spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
        if la.nnodes > 1:
            spec["pytorchReplicaSpecs"]["Worker"] = replica(la.nnodes - 1)
    spec["runPolicy"] = {"cleanPodPolicy": "None"}
    job_doc = {"apiVersion": API_VERSION, "kind": "PyTorchJob", "metadata": _meta(job, namespace, job), "spec": spec}
    return Manifest([configmap, job_doc], job, notes)


def trainjob(resolved, recipe_path: str, *, image: str, namespace: Optional[str] = None,
             gpus_per_node: Optional[int] = None, run_dir_pvc: Optional[str] = None,
             mlflow_secret: str = "mlflow-credentials", runtime: Optional[str] = None,
             with_runtime: bool = False, resources: Optional[NodeResources] = None,
             networks: Sequence[str] = ()) -> Manifest:
    """The ConfigMap and the Kubeflow Trainer v2 TrainJob that run this recipe on launch.nnodes nodes, and with
    `with_runtime` trainkit's ClusterTrainingRuntime first.

    Args:
        runtime: the ClusterTrainingRuntime the TrainJob references (default trainkit-distributed). A runtime
            trainkit wrote (the default name, or any name with `with_runtime`) brings /dev/shm and the shared run
            directory; any other (torch-distributed) gets them from the TrainJob's runtimePatches.
        with_runtime: also write that runtime (install it once per cluster).
        resources: what each node asks for (cluster/node_resources.py; None: its rules without a memory
            plan): `resourcesPerNode`, IPC_LOCK with RDMA devices, and /dev/shm's sizeLimit where the
            TrainJob brings /dev/shm (a foreign runtime; trainkit's runtime, written once for every job,
            has none: its /dev/shm is bounded by the pod's memory limit, which counts it).

    Raises:
        K8sError: an elastic node count (Trainer v2 has no elastic policy), a name Kubernetes rejects
            (check_names), GPUs for a CPU recipe, --run-dir-pvc for an installed trainkit runtime.
    """
    recipe = resolved.recipe
    la = recipe.launch
    notes: list[str] = []
    runtime = runtime or TRAINKIT_RUNTIME
    check_names(namespace=namespace, run_dir_pvc=run_dir_pvc, mlflow_secret=mlflow_secret, runtime=runtime)
    if isinstance(la.nnodes, str):
        raise K8sError(f"launch.nnodes {la.nnodes!r} is elastic, and Kubeflow Trainer v2 has no elastic policy: a "
                       f"TrainJob has a fixed trainer.numNodes; pass launch.nnodes=N (with trainer.resume: auto a "
                       f"restarted job continues from its newest checkpoint), or --api pytorchjob for an "
                       f"elasticPolicy")
    trainkit_runtime = with_runtime or runtime == TRAINKIT_RUNTIME
    if run_dir_pvc and trainkit_runtime and not with_runtime:
        raise K8sError(f"--run-dir-pvc {run_dir_pvc}: the installed runtime {runtime!r} mounts the claim it was "
                       f"written with (default {RUN_DIR_CLAIM!r}) at {RUN_DIR_MOUNT}; pass --run-dir-pvc together "
                       f"with --with-runtime to write a runtime that mounts another claim, or drop it")
    job = _job_name(recipe, notes)
    gpu_count = gpus_for(la, gpus_per_node)
    nproc = gpus.nproc_for(la, gpu_count)
    shared = trainkit_runtime or bool(run_dir_pvc)
    if trainkit_runtime:
        notes.append(f"the runtime {runtime!r} mounts the PersistentVolumeClaim {run_dir_pvc or RUN_DIR_CLAIM!r} "
                     f"(ReadWriteMany) at {RUN_DIR_MOUNT}: create it once in the TrainJob's namespace"
                     + ("" if with_runtime else f"; install the runtime once with --with-runtime"))
    elif not run_dir_pvc:
        notes.append(_NO_SHARED_STORAGE)
    env, tracking = _tracking_env(resolved, mlflow_secret, notes)
    # cluster: trainjob makes a node count that disagrees with trainer.numNodes an error at run time
    update: dict[str, Any] = {"cluster": "trainjob", "nnodes": la.nnodes, **gpus.pinned_backend(la, gpu_count)}
    if shared:
        update["run_dir"] = RUN_DIR_MOUNT
    configmap = _recipe_configmap(resolved, recipe_path, job, namespace, tracking, update)

    check_networks(networks)
    resources = _resources(recipe, nproc, resources, notes)
    _network_notes(resources, networks, notes)
    trainer: dict[str, Any] = {"image": image, "command": ["trainkit", "run", f"{RECIPES_MOUNT}/{Path(recipe_path).name}"],
                               "numNodes": la.nnodes, "numProcPerNode": nproc,
                               "resourcesPerNode": resources.requirements(gpu_count)}
    if env:
        trainer["env"] = env
    mounts: list[dict[str, Any]] = [{"name": "recipe", "mountPath": RECIPES_MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "recipe", "configMap": {"name": f"{job}-recipe"}}]
    if not trainkit_runtime:  # a foreign runtime: /dev/shm and the run directory come from here
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append(_dshm(resources))
        if run_dir_pvc:
            mounts.append({"name": "runs", "mountPath": RUN_DIR_MOUNT})
            volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": run_dir_pvc}})
    patch = {"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {
            **({"metadata": _annotations(networks)} if networks else {}), "spec": {
            "containers": [{"name": "node", "volumeMounts": mounts,
                            **({"securityContext": resources.security_context()} if resources.rdma else {})}],
            "volumes": volumes}}}}}]}}}}
    job_doc = {"apiVersion": TRAINER_API_VERSION, "kind": "TrainJob", "metadata": _meta(job, namespace, job),
               "spec": {"runtimeRef": {"name": runtime}, "trainer": trainer, "runtimePatches": [patch]}}
    documents = [configmap, job_doc]
    if with_runtime:
        documents.insert(0, training_runtime(image=image, name=runtime, run_dir_pvc=run_dir_pvc))
    return Manifest(documents, job, notes)


def training_runtime(*, image: str, name: str = TRAINKIT_RUNTIME, run_dir_pvc: Optional[str] = None) -> dict:
    """trainkit's ClusterTrainingRuntime: the torch ML policy (PET_* for `trainkit run`), one `node` replicated
    job, a memory-backed /dev/shm, and the run directory on the shared claim `run_dir_pvc` (default
    trainkit-runs, resolved in each TrainJob's namespace). Cluster-scoped: install once, reference from every
    TrainJob."""
    container = {"name": "node", "image": image,
                 "ports": [{"name": "rendezvous", "containerPort": TRAINER_PORT}],
                 "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"},
                                  {"name": "runs", "mountPath": RUN_DIR_MOUNT}]}
    pod = {"containers": [container],
           "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}},
                       {"name": "runs", "persistentVolumeClaim": {"claimName": run_dir_pvc or RUN_DIR_CLAIM}}]}
    return {"apiVersion": TRAINER_API_VERSION, "kind": "ClusterTrainingRuntime",
            "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch",
                                                  "app.kubernetes.io/name": "trainkit"}},
            "spec": {"mlPolicy": {"numNodes": 1, "torch": {}},
                     "template": {"spec": {"replicatedJobs": [
                         {"name": "node", "template": {"metadata": {"labels": {ANCESTOR: "trainer"}},
                                                       "spec": {"template": {"spec": pod}}}}]}}}}


NETWORKS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"  # Multus: the pod's secondary networks, comma-separated
# a NetworkAttachmentDefinition's name, optionally NAMESPACE/NAME (DNS-1123 label / subdomain)
_NETWORK = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?/)?[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_RDMA_WITHOUT_NETWORK = ("RDMA devices without --network: where your device plugin shares the HCA through a "
                         "secondary network (Multus), name it with --network NAME, or NCCL may find no RDMA device "
                         "in the pod and fall back to sockets (NCCL_DEBUG=INFO says NET/Socket)")


def check_networks(networks: Sequence[str]) -> None:
    """Refuse a `--network` Kubernetes could not hold (K8sError): a NetworkAttachmentDefinition's name,
    NAMESPACE/NAME allowed."""
    for value in networks:
        if len(value) > 253 or not _NETWORK.fullmatch(value):
            raise K8sError(f"--network {value!r}: a network is a NetworkAttachmentDefinition's name (lowercase "
                           f"letters, digits, '-' and '.'), optionally NAMESPACE/NAME, e.g. rdma-net-a")


def _annotations(networks: Sequence[str]) -> dict:
    """A pod template's metadata entry for its annotations (the secondary networks it attaches), or nothing."""
    return {"annotations": {NETWORKS_ANNOTATION: ",".join(networks)}} if networks else {}


def _network_notes(resources: NodeResources, networks: Sequence[str], notes: list[str]) -> None:
    if resources.rdma and not networks:
        notes.append(_RDMA_WITHOUT_NETWORK)


def _resources(recipe, nproc: int, given: Optional[NodeResources], notes: list[str]) -> NodeResources:
    """`given`, or the rules without a memory plan; its notes and how it was sized join the job's notes."""
    resources = given or node_resources(recipe, nproc, host_per_rank=None, shm_need=None)
    notes.extend(resources.notes)
    if resources.how:
        notes.append(resources.how)
    return resources


def _dshm(resources: NodeResources) -> dict:
    """/dev/shm in memory, limited to the DataLoader's need (cluster/node_resources.py)."""
    return {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity(resources.shm)}}


def _meta(name: str, namespace: Optional[str], job: str) -> dict:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = {"app.kubernetes.io/name": "trainkit", "trainkit/job": job}
    return meta
