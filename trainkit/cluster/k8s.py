"""`trainkit k8s`: a Kubeflow v1 PyTorchJob (plus the ConfigMap that carries the recipe) for a recipe.

Every pod runs `trainkit run /recipes/<file>`; detection (detect.py) then reads the operator's
variables, so the recipe needs no per-node launch values. Secrets never enter the manifest: the
recipe keeps its `${oc.env:...}` references, the MLflow URI goes in without credentials, and
MLFLOW_TRACKING_USERNAME/PASSWORD come from a referenced Secret.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit, urlunsplit

import yaml

from ..recipe import secrets

API_VERSION = "kubeflow.org/v1"
PORT = 23456  # the operator's default PyTorchJob port (MASTER_PORT)
RECIPES_MOUNT = "/recipes"
RUN_DIR_MOUNT = "/trainkit/runs"
MAX_JOB_NAME = 40  # pods are <job>-worker-<N>, services carry the same name: stay far below 63


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


def pytorchjob(resolved, recipe_path: str, *, image: str, namespace: Optional[str] = None,
               gpus_per_node: Optional[int] = None, run_dir_pvc: Optional[str] = None,
               mlflow_secret: str = "mlflow-credentials") -> Manifest:
    """The ConfigMap and the PyTorchJob that run this recipe on its launch.nnodes pods."""
    recipe = resolved.recipe
    la = recipe.launch
    notes: list[str] = []
    job = dns_name(recipe.name)
    if job != recipe.name:
        notes.append(f"recipe name {recipe.name!r} is not a valid Kubernetes name (lowercase letters, digits, '-'; "
                     f"at most {MAX_JOB_NAME} characters): the job is named {job!r}")
    file = Path(recipe_path).name
    composed = copy.deepcopy(secrets.redact(resolved.raw, ()))  # `${oc.env:...}` stays a reference
    launch = dict(composed.get("launch") or {})
    tracking = dict(composed.get("tracking") or {})
    if run_dir_pvc:
        launch["run_dir"] = RUN_DIR_MOUNT
    else:
        notes.append("no --run-dir-pvc: each pod keeps its own run directory (checkpoints live on each pod and are "
                     "lost with it); resume after a pod restart needs shared storage: pass --run-dir-pvc NAME")
    composed["launch"] = launch
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
    if tracking:
        composed["tracking"] = tracking
    recipe_text = (f"# Composed by trainkit k8s from {recipe_path}; ${{oc.env:...}} references are resolved in each "
                   f"pod\n" + yaml.safe_dump(composed, sort_keys=False))
    configmap = {"apiVersion": "v1", "kind": "ConfigMap",
                 "metadata": _meta(f"{job}-recipe", namespace, job), "data": {file: recipe_text}}

    gpus = gpus_per_node if gpus_per_node is not None else (la.nproc_per_node if la.backend == "nccl" else 0)
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the container and its port by this name
        "image": image,
        "command": ["trainkit", "run", f"{RECIPES_MOUNT}/{file}"],
        "ports": [{"name": "pytorchjob-port", "containerPort": PORT}],
        "env": env,
        "volumeMounts": [{"name": "recipe", "mountPath": RECIPES_MOUNT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    volumes: list[dict[str, Any]] = [{"name": "recipe", "configMap": {"name": f"{job}-recipe"}},
                                     {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if run_dir_pvc:
        container["volumeMounts"].append({"name": "runs", "mountPath": RUN_DIR_MOUNT})
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": run_dir_pvc}})
    if not env:
        del container["env"]

    def replica(n: int) -> dict:
        return {"replicas": n, "restartPolicy": "OnFailure",
                "template": {"metadata": {"labels": {"app.kubernetes.io/name": "trainkit", "trainkit/job": job}},
                             "spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}}}

    spec: dict[str, Any] = {"nprocPerNode": str(la.nproc_per_node if "nproc_per_node" in la.model_fields_set
                                                else (gpus or 1))}
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


def _meta(name: str, namespace: Optional[str], job: str) -> dict:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = {"app.kubernetes.io/name": "trainkit", "trainkit/job": job}
    return meta
