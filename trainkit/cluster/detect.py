"""Which cluster started this `trainkit run`, and what it says about the launch.

A pure function of (environment mapping, recipe): `detect` returns the effective launch settings and
where each came from; `apply` turns them into a new frozen Recipe. Nothing here reads os.environ,
starts a process or imports torch, so `plan`, `doctor` and the launcher share one answer and the
tests can feed it the exact environment of each scheduler.

What each environment gives (see docs/clusters.md):

- PyTorchJob, cube-studio / older training operator: MASTER_ADDR, MASTER_PORT, WORLD_SIZE = number
  of pods, RANK = pod index (master 0, worker-N is N+1).
- PyTorchJob, training-operator v1.9 (kubeflow.org/v1): the same plus PET_NNODES, PET_NODE_RANK,
  PET_NPROC_PER_NODE (may be `auto`), PET_MASTER_ADDR/PORT; there WORLD_SIZE = replicas x nprocPerNode
  (pkg/controller.v1/pytorch/envvar.go), so PET_* define the topology whenever present.
- Kubeflow Trainer v2 (TrainJob, trainer.kubeflow.org/v1alpha1), torch plugin of v2.3.0: PET_* only
  (no MASTER_ADDR, no WORLD_SIZE): PET_NNODES = trainer.numNodes, PET_NODE_RANK = the Job completion
  index, PET_NPROC_PER_NODE (`auto` with GPUs), PET_MASTER_ADDR = `<trainjob>-node-0-0.<trainjob>`,
  PET_MASTER_PORT = 29500.
- SLURM (one srun task per node): SLURM_JOB_ID, SLURM_NNODES, SLURM_NODEID, SLURM_NTASKS,
  SLURM_JOB_NODELIST, SLURM_GPUS_ON_NODE.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from ..recipe.schema import Recipe

TOPOLOGY = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")  # the environment is authoritative for these
SLURM_PORT_BASE = 29400  # c10d's default port; a SLURM job adds its id modulo PORT_SPREAD
PORT_SPREAD = 1000
POD_NAME = re.compile(r"^(?P<job>[a-z0-9]([-a-z0-9]*[a-z0-9])?)-(?P<role>master|worker)-(?P<index>\d+)$")
# Trainer v2: the torch plugin's master address, and a JobSet pod's hostname <jobset>-<replicatedJob>-<job>-<pod>
TRAINJOB_MASTER = re.compile(r"^(?P<job>[a-z]([-a-z0-9]*[a-z0-9])?)-node-0-0\.(?P=job)(\..*)?$")
TRAINJOB_POD = re.compile(r"^(?P<job>[a-z]([-a-z0-9]*[a-z0-9])?)-node-\d+-\d+(-[a-z0-9]{5})?$")


class ClusterError(Exception):
    """The environment and the recipe/command line cannot both be right, or the environment is
    incomplete: nothing may start (exit 2)."""


@dataclass(frozen=True)
class Detected:
    """What the environment says. `kind` is none | kubeflow | kubeflow-v1.9 | trainer-v2 | slurm."""

    kind: str
    description: str
    values: dict[str, Any] = field(default_factory=dict)   # launch key -> effective value
    sources: dict[str, str] = field(default_factory=dict)  # launch key -> where it came from
    replaced: list[str] = field(default_factory=list)      # recipe values the environment replaced
    notes: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return self.kind != "none"

    def lines(self) -> list[str]:
        """For `plan` and `doctor`: one line per value, with its source."""
        if not self.found:
            return [f"cluster:         {self.description}"]
        out = [f"cluster:         {self.description}"]
        for key in ("nnodes", "node_rank", "nproc_per_node", "rdzv_endpoint", "rdzv_id"):
            if key in self.values:
                out.append(f"  {key + ':':<16}{self.values[key]}  ({self.sources.get(key, '?')})")
        return out + [f"  note: {n}" for n in self.notes]

    def announcement(self) -> str:
        """The one line `trainkit run` prints."""
        got = ", ".join(f"{k}={self.values[k]}" for k in ("nnodes", "node_rank", "nproc_per_node", "rdzv_endpoint",
                                                         "rdzv_id") if k in self.values)
        text = f"trainkit: {self.description}: {got}"
        if self.replaced:
            text += f" (replacing the recipe's {', '.join(self.replaced)})"
        return text


def inside_torchrun(env: Mapping[str, str]) -> bool:
    """A worker (or a nested launch) already under torchrun: the cluster variables are its own."""
    return "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env


def kind_of(env: Mapping[str, str]) -> str:
    """Which of the known environments this is, from the variables alone."""
    if inside_torchrun(env):
        return "none"
    pet = "PET_NNODES" in env or "PET_NODE_RANK" in env
    if pet and "MASTER_ADDR" not in env and "WORLD_SIZE" not in env and "PET_RDZV_ENDPOINT" not in env:
        return "trainer-v2"
    if pet:
        return "kubeflow-v1.9"
    if "WORLD_SIZE" in env and "RANK" in env and ("MASTER_ADDR" in env or _looks_like_pod(env)):
        return "kubeflow"
    if env.get("SLURM_JOB_ID") and (env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")):
        return "slurm"
    return "none"


def _looks_like_pod(env: Mapping[str, str]) -> bool:
    return "KUBERNETES_SERVICE_HOST" in env or bool(POD_NAME.match(env.get("HOSTNAME", "")))


DESCRIPTIONS = {
    "kubeflow": "Kubeflow PyTorchJob pod (MASTER_ADDR/WORLD_SIZE/RANK: cube-studio or an older training operator)",
    "kubeflow-v1.9": "Kubeflow PyTorchJob pod (training-operator v1.9: PET_*)",
    "trainer-v2": "Kubeflow Trainer v2 TrainJob pod (PET_* only)",
    "slurm": "SLURM step",
}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as `scontrol show hostnames` prints it first:
    'gpu[03-05,9],cpu1' -> 'gpu03'."""
    text = nodelist.strip()
    m = re.match(r"([^,\[]*)(\[([^\]]*)\])?", text)
    if not m or not m.group(0):
        return text
    prefix, ranges = m.group(1), m.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    rest = text[m.end():]
    suffix = "" if rest.startswith(",") or not rest else re.match(r"[^,\[]*", rest).group(0)
    return prefix + first + suffix


def visible_gpus(env: Mapping[str, str], devices: int) -> int:
    """GPUs this node's workers may use: CUDA_VISIBLE_DEVICES when set, else `devices` (counted by
    the caller), capped by SLURM_GPUS_ON_NODE inside a SLURM allocation."""
    count = devices
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        listed = len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"]) if cvd.strip() else 0
        count = min(count, listed)
    gpus_on_node = env.get("SLURM_GPUS_ON_NODE", "")
    if gpus_on_node.isdigit():
        count = min(count, int(gpus_on_node)) if count else 0
    return count


def _int(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "").strip()
    if not text.isdigit():
        raise ClusterError(f"{name}={text!r} in this environment is not a whole number")
    return int(text)


def detect(env: Mapping[str, str], recipe: Recipe, *, gpus: int = 0, overridden: frozenset[str] = frozenset(),
           first_host_of: Callable[[str], str] = first_host) -> Detected:
    """The effective launch settings for this environment.

    Args:
        env: the process environment (a plain mapping in tests).
        recipe: the resolved recipe; `launch.model_fields_set` says which keys the recipe wrote.
        gpus: GPUs visible on this node (0 on CPU).
        overridden: launch keys set on the command line (key=value): those must agree with the
            environment, while values from recipe files are replaced.
        first_host_of: SLURM node list -> first host (`scontrol show hostnames` when available).

    Raises:
        ClusterError: launch.cluster names an environment that is not there, the environment is
            incomplete (a pod without MASTER_ADDR), or the command line contradicts it.
    """
    la = recipe.launch
    if la.cluster == "none":
        return Detected("none", "none (launch.cluster: none)")
    kind = kind_of(env)
    if kind == "none" and inside_torchrun(env):
        return Detected("none", "none (already inside torchrun: LOCAL_RANK / TORCHELASTIC_RUN_ID are set)")
    if la.cluster == "trainjob" and kind != "trainer-v2":
        what = f"this is a {DESCRIPTIONS[kind]}" if kind != "none" else "PET_NNODES / PET_NODE_RANK are not set"
        raise ClusterError(f"launch.cluster is trainjob but {what}: a Kubeflow Trainer v2 pod has PET_NNODES, "
                           f"PET_NODE_RANK and PET_MASTER_ADDR and neither MASTER_ADDR nor WORLD_SIZE; submit it as a "
                           f"TrainJob (trainkit k8s --api trainjob), or set launch.cluster=auto")
    if la.cluster == "kubeflow" and not kind.startswith(("kubeflow", "trainer")):
        raise ClusterError("launch.cluster is kubeflow but this is not a PyTorchJob pod (no PET_NNODES, "
                           "WORLD_SIZE/RANK or MASTER_ADDR in the environment)")
    if la.cluster == "slurm" and kind != "slurm":
        raise ClusterError("launch.cluster is slurm but SLURM_JOB_ID / SLURM_NNODES are not set: run it with srun "
                           "inside an allocation (trainkit slurm writes the sbatch script)")
    if kind == "none":
        return Detected("none", "none detected (no PyTorchJob or SLURM variables): the recipe's launch values")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []
    if kind == "slurm":
        _slurm(env, values, sources, notes, first_host_of)
    else:
        _kubeflow(kind, env, recipe, values, sources, notes)
    _nproc(kind, env, recipe, gpus, values, sources)
    if la.cluster == "trainjob":
        _same_shape_as_the_trainjob(recipe, values, sources, overridden)
    replaced = _merge_with_recipe(recipe, values, sources, overridden)
    return Detected(kind, DESCRIPTIONS[kind], values, sources, replaced, notes)


def _kubeflow(kind: str, env: Mapping[str, str], recipe: Recipe, values: dict, sources: dict, notes: list) -> None:
    if kind == "kubeflow":
        if "MASTER_ADDR" not in env:
            raise ClusterError("this looks like a PyTorchJob pod (WORLD_SIZE and RANK are set) but MASTER_ADDR is "
                               "missing: the operator sets it on every pod of a job with a Master replica; add a "
                               "Master replica, set MASTER_ADDR, or run with launch.cluster=none")
        values["nnodes"], sources["nnodes"] = _int(env, "WORLD_SIZE"), f"WORLD_SIZE={env['WORLD_SIZE']} (pods)"
        values["node_rank"], sources["node_rank"] = _int(env, "RANK"), f"RANK={env['RANK']} (pod index)"
    else:
        nnodes = env.get("PET_NNODES", "").strip()
        if re.fullmatch(r"\d+", nnodes):
            values["nnodes"] = int(nnodes)
        elif re.fullmatch(r"\d+:\d+", nnodes):
            values["nnodes"] = nnodes
        else:
            raise ClusterError(f"PET_NNODES={nnodes!r} is neither a number nor MIN:MAX")
        sources["nnodes"] = f"PET_NNODES={nnodes}"
        if "PET_NODE_RANK" in env:
            values["node_rank"], sources["node_rank"] = _int(env, "PET_NODE_RANK"), f"PET_NODE_RANK={env['PET_NODE_RANK']}"
        if kind == "kubeflow-v1.9" and "WORLD_SIZE" in env:
            notes.append(f"WORLD_SIZE={env['WORLD_SIZE']} counts processes here (replicas x nprocPerNode), not pods: "
                         f"ignored")
    if env.get("PET_RDZV_ENDPOINT"):  # elasticPolicy: the operator names the c10d endpoint itself
        values["rdzv_endpoint"], sources["rdzv_endpoint"] = env["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT"
    else:
        addr_var = "MASTER_ADDR" if env.get("MASTER_ADDR") else "PET_MASTER_ADDR"
        port_var = "MASTER_PORT" if env.get("MASTER_PORT") else "PET_MASTER_PORT"
        if not env.get(addr_var):
            raise ClusterError(f"this looks like a {DESCRIPTIONS[kind]} but neither MASTER_ADDR nor PET_MASTER_ADDR "
                               f"is set: the nodes have no rendezvous address; set it, or launch.cluster=none")
        port = env.get(port_var) or "29400"
        values["rdzv_endpoint"] = f"{env[addr_var]}:{port}"
        sources["rdzv_endpoint"] = f"{addr_var}:{port_var}" if env.get(port_var) else f"{addr_var} (port 29400)"
    job, where = _trainjob_name(env) if kind == "trainer-v2" else _k8s_job_name(env)
    if job:
        values["rdzv_id"], sources["rdzv_id"] = job, where
    elif kind == "trainer-v2":
        notes.append("no TrainJob name found (PET_MASTER_ADDR is not <trainjob>-node-0-0.<trainjob>, HOSTNAME is "
                     "not <trainjob>-node-N-M, no JOBSET_NAME): the rendezvous id is the recipe's")
    else:
        notes.append("no job name found (HOSTNAME is not <job>-master-N / <job>-worker-N, no JOBSET_NAME): "
                     "the rendezvous id is the recipe's")


def _k8s_job_name(env: Mapping[str, str]) -> tuple[Optional[str], str]:
    for var in ("TRAINKIT_JOB_ID", "JOBSET_NAME"):
        if env.get(var):
            return env[var], var
    m = POD_NAME.match(env.get("HOSTNAME", ""))
    if m:
        return m.group("job"), f"HOSTNAME={env['HOSTNAME']} (pod name's job prefix)"
    return None, ""


def _trainjob_name(env: Mapping[str, str]) -> tuple[Optional[str], str]:
    """The TrainJob's name: every node of one TrainJob finds the same one, and a new TrainJob a new one."""
    for var in ("TRAINKIT_JOB_ID", "JOBSET_NAME"):
        if env.get(var):
            return env[var], var
    m = TRAINJOB_MASTER.match(env.get("PET_MASTER_ADDR", ""))
    if m:
        return m.group("job"), f"PET_MASTER_ADDR={env['PET_MASTER_ADDR']} (<trainjob>-node-0-0.<trainjob>)"
    m = TRAINJOB_POD.match(env.get("HOSTNAME", ""))
    if m:
        return m.group("job"), f"HOSTNAME={env['HOSTNAME']} (<trainjob>-node-N-M)"
    return None, ""


def _same_shape_as_the_trainjob(recipe: Recipe, values: dict, sources: dict, overridden: frozenset[str]) -> None:
    """`launch.cluster: trainjob` (what `trainkit k8s --api trainjob` writes into the recipe it ships) says the
    recipe was written for this TrainJob: a node count it states must be the one the TrainJob was given.
    Under `auto` the environment replaces recipe values, as on the other clusters."""
    la = recipe.launch
    if "nnodes" not in la.model_fields_set or "nnodes" not in values:
        return
    mine, given = la.nnodes, values["nnodes"]
    if isinstance(mine, str) and isinstance(given, int):
        low, high = (int(x) for x in mine.split(":"))
        if low <= given <= high:
            return
    elif str(mine) == str(given):
        return
    where = "command line" if "nnodes" in overridden else "recipe"
    raise ClusterError(f"launch.nnodes {mine} ({where}, launch.cluster: trainjob) contradicts this TrainJob: "
                       f"{sources['nnodes']} (trainer.numNodes); make them agree (regenerate the TrainJob with "
                       f"trainkit k8s --api trainjob, or set trainer.numNodes to {mine}), or set launch.cluster=auto "
                       f"to take the TrainJob's node count")


def _slurm(env: Mapping[str, str], values: dict, sources: dict, notes: list,
           first_host_of: Callable[[str], str]) -> None:
    nodes_var = next(v for v in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if env.get(v))
    nnodes = _int(env, nodes_var)
    values["nnodes"], sources["nnodes"] = nnodes, f"{nodes_var}={nnodes}"
    if env.get("SLURM_NODEID"):
        values["node_rank"], sources["node_rank"] = _int(env, "SLURM_NODEID"), f"SLURM_NODEID={env['SLURM_NODEID']}"
    tasks_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    if env.get(tasks_var, "").isdigit() and int(env[tasks_var]) > nnodes:
        raise ClusterError(f"{tasks_var}={env[tasks_var]} on {nnodes} node(s): trainkit needs one task per node "
                           f"(srun --ntasks-per-node=1), it starts the node's workers itself")
    if nnodes > 1 and not env.get("SLURM_STEP_ID") and not env.get("SLURM_PROCID"):
        raise ClusterError(f"a {nnodes}-node SLURM allocation but this is not an srun step: start trainkit with "
                           f"`srun --ntasks-per-node=1 trainkit run ...` so every node runs one launcher")
    job = env["SLURM_JOB_ID"] + (f"_{env['SLURM_ARRAY_TASK_ID']}" if env.get("SLURM_ARRAY_TASK_ID") else "")
    values["rdzv_id"], sources["rdzv_id"] = f"slurm-{job}", f"SLURM_JOB_ID={env['SLURM_JOB_ID']}"
    if nnodes > 1:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise ClusterError("SLURM_JOB_NODELIST is not set: the first node of the allocation hosts the rendezvous")
        host = first_host_of(nodelist)
        if env.get("MASTER_PORT", "").isdigit():
            port, why = int(env["MASTER_PORT"]), "MASTER_PORT"
        else:
            port = SLURM_PORT_BASE + int(re.sub(r"\D", "", env["SLURM_JOB_ID"]) or 0) % PORT_SPREAD
            why = f"port {SLURM_PORT_BASE} + job id mod {PORT_SPREAD}"
        values["rdzv_endpoint"] = f"{host}:{port}"
        sources["rdzv_endpoint"] = f"first node of SLURM_JOB_NODELIST={nodelist}, {why}"


def _nproc(kind: str, env: Mapping[str, str], recipe: Recipe, gpus: int, values: dict, sources: dict) -> None:
    la = recipe.launch
    if "nproc_per_node" in la.model_fields_set:
        nproc, source = la.nproc_per_node, "recipe"
    elif env.get("PET_NPROC_PER_NODE", "").isdigit():
        nproc, source = int(env["PET_NPROC_PER_NODE"]), f"PET_NPROC_PER_NODE={env['PET_NPROC_PER_NODE']}"
    elif gpus > 0:
        nproc, source = gpus, f"visible GPUs ({gpus})"
    else:
        nproc, source = 1, "no GPU visible: 1 CPU process"
    if gpus > 0 and nproc > gpus:
        raise ClusterError(f"launch.nproc_per_node {nproc} ({source}) but only {gpus} GPU(s) are visible on this "
                           f"node; lower it or leave it unset (one process per visible GPU)")
    values["nproc_per_node"], sources["nproc_per_node"] = nproc, source


def _merge_with_recipe(recipe: Recipe, values: dict, sources: dict, overridden: frozenset[str]) -> list[str]:
    """The environment wins over recipe files; a command-line override that disagrees is an error."""
    la = recipe.launch
    replaced = []
    for key in TOPOLOGY:
        if key not in values:
            if key in la.model_fields_set and getattr(la, key) is not None:
                sources[key] = "command line" if key in overridden else "recipe"
                values[key] = getattr(la, key)
            continue
        mine = getattr(la, key)
        if key in overridden and mine is not None and str(mine) != str(values[key]):
            raise ClusterError(f"launch.{key}={mine} on the command line contradicts the environment: "
                               f"{sources[key]} gives {values[key]}; drop the override (or launch.cluster=none)")
        if key in la.model_fields_set and mine is not None and str(mine) != str(values[key]):
            replaced.append(f"{key} {mine}")
    return replaced


def apply(recipe: Recipe, detected: Detected) -> Recipe:
    """A new frozen Recipe with the detected launch values (the recipe itself when nothing was found)."""
    if not detected.found:
        return recipe
    update = {k: v for k, v in detected.values.items() if k in TOPOLOGY + ("nproc_per_node",)}
    if recipe.launch.rdzv_backend == "c10d":
        update.pop("node_rank", None)  # c10d orders the nodes itself; torchrun warns about --node-rank
    if update.get("nnodes") in (1, "1", "1:1") and "rdzv_endpoint" in update and \
            "rdzv_endpoint" not in recipe.launch.model_fields_set:
        update.pop("rdzv_endpoint")  # one node: torchrun --standalone, no rendezvous to meet at
    return recipe.model_copy(update={"launch": recipe.launch.model_copy(update=update)})
