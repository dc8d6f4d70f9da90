"""A real single-host SLURM (munge + slurmctld + slurmd on localhost, a generated slurm.conf) runs the
script `trainkit slurm` writes: `sbatch --wait`, one node, two CPU workers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run_helpers import env_for, mlp_recipe, summary

pytestmark = pytest.mark.distributed
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def slurm(tmp_path_factory):
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        pytest.skip(f"SLURM is not installed here (missing {', '.join(missing)}; apt-get install slurm-wlm munge)")
    if os.geteuid() != 0 or not Path("/etc/munge/munge.key").is_file():
        pytest.skip("a local SLURM needs root and /etc/munge/munge.key (the munge package creates it)")
    d = Path(tempfile_dir(tmp_path_factory))
    (d / "state").mkdir()
    (d / "spool").mkdir()
    key = d / "munge.key"
    key.write_bytes(Path("/etc/munge/munge.key").read_bytes())
    key.chmod(0o400)
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=tk", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={d}/munge.sock", "CredType=cred/munge", f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}", f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
        f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid", f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd.log", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/affinity",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2",
        "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "SchedulerType=sched/builtin", "InactiveLimit=0", "KillWait=5",
        f"NodeName={host} CPUs={os.cpu_count() or 2} RealMemory={_memory_mib() * 9 // 10} State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
    env = dict(os.environ, SLURM_CONF=str(conf))
    procs = []
    try:
        subprocess.run(["munged", "--force", "-S", f"{d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid",
                        f"--log-file={d}/munged.log", f"--seed-file={d}/seed"], check=True, timeout=10)
        for daemon in ("slurmctld", "slurmd"):
            procs.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True, timeout=10).stdout
            if out.strip() == "idle":
                break
            time.sleep(0.5)
        else:
            pytest.skip(f"the local SLURM did not come up in 30 s (logs in {d})")
        yield env
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        pid = d / "munged.pid"
        if pid.is_file():
            try:
                os.kill(int(pid.read_text().strip()), signal.SIGTERM)
            except (ValueError, ProcessLookupError):
                pass


def _memory_mib() -> int:
    """This host's memory (slurmd refuses a node whose configured RealMemory is above it)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("MemTotal:")) // 1024


def tempfile_dir(factory) -> str:
    return str(factory.mktemp("slurm"))


# what the job step's process may run on, written before it becomes `trainkit run` (exec: the same process)
STEP_CPUS = 'python3 -c "import os; print(len(os.sched_getaffinity(0)))" > "$0/step-cpus"; exec "$@"'


def test_sbatch_script_runs_one_node_with_two_cpu_workers(tmp_path, slurm):
    """The job asks for 2 CPUs (2 ranks, no DataLoader workers) and SLURM binds each step to its CPUs
    (task/affinity, SLURM_CPU_BIND=cores as a site may set): the step that runs `trainkit run` gets both,
    since the script passes --cpus-per-task on to srun (SRUN_CPUS_PER_TASK); without it Slurm 22.05+
    gives the step one CPU, shared by both ranks."""
    from trainkit.cli import _node_resources
    from trainkit.cluster.slurm import sbatch_script
    from trainkit.recipe import resolve

    recipe = mlp_recipe(tmp_path, "slurm-job", launch={"nproc_per_node": 2, "run_dir": str(tmp_path / "runs"),
                                                       "timeout_s": 60})
    resolved = resolve(recipe)
    script = sbatch_script(resolved, str(recipe), ["trainer.max_steps=6"], time="5:00", gpus_per_node=0,
                           resources=_node_resources(resolved.recipe, 0),  # as `trainkit slurm` sizes it
                           trainkit=("sh", "-c", STEP_CPUS, str(tmp_path), sys.executable, "-m", "trainkit.cli"))
    assert "#SBATCH --cpus-per-task=2" in script.splitlines()
    assert any(line.startswith("#SBATCH --mem=") for line in script.splitlines())  # slurmd accepts it
    (tmp_path / "job.sbatch").write_text(script)
    env = dict(env_for(tmp_path), SLURM_CPU_BIND="cores", **{k: v for k, v in slurm.items() if k == "SLURM_CONF"})
    done = subprocess.run(["sbatch", "--wait", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180)
    logs = "\n".join(p.read_text() for p in tmp_path.rglob("*.log")) + "\n".join(
        p.read_text() for p in tmp_path.glob("*.out"))
    assert done.returncode == 0, done.stdout + done.stderr + logs
    assert "SLURM step" in logs
    s = summary(tmp_path / "runs" / "slurm-job")
    assert s["world_size"] == 2 and s["steps"] == 6
    assert (tmp_path / "step-cpus").read_text().strip() == "2", logs
    # the control: a step in the same kind of allocation without SRUN_CPUS_PER_TASK gets one CPU here
    # (binding is on), so the 2 above is the script's doing
    control = subprocess.run(["salloc", "--cpus-per-task=2", "srun", sys.executable, "-c",
                              "import os; print(len(os.sched_getaffinity(0)))"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
    assert control.returncode == 0 and control.stdout.strip().splitlines()[-1] == "1", control
