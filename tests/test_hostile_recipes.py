"""Recipes from a pull request stay data (issue 25, security cases): composed files stay inside the
recipe's repository, errors never echo a value pulled in by interpolation, generated job files and CI
annotations cannot be broken out of, a data folder cannot run code, and a recipe cannot make a run
write outside the working directory. Each case goes through real `python -m trainkit.cli`
subprocesses (or the real loader) and reads back what was printed, written or created."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from run_helpers import trainkit

SECRET = "RSAPRIVATEdeadbeef0c0ffee"  # the value of a YAML file above the repository
ENV_VALUE = "plain-looking-Value-7731"  # an environment variable whose name does not look secret
VALID = {"name": "hostile", "model": {"name": "mlp"}, "data": {"name": "synthetic", "batch_size": 2},
         "strategy": {"name": "ddp"}, "trainer": {"max_steps": 1}, "launch": {"nproc_per_node": 1}}


@pytest.fixture
def repo(tmp_path):
    """A workspace with a credentials file next to a git repository holding the recipes."""
    (tmp_path / ".credentials_rsaparams").write_text(f"d: {SECRET}\n")
    root = tmp_path / "repo"
    (root / "ci").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=30)
    return root


def write(path, data) -> str:
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return str(path)


COMMANDS = [("validate",), ("validate", "--format", "json"), ("validate", "--format", "github"), ("plan",),
            ("doctor",), ("k8s", "--image", "trainer:1"), ("slurm",)]


@pytest.mark.slow
def test_defaults_outside_the_repository_are_refused_and_nothing_of_the_file_is_printed(repo):
    recipe = write(repo / "ci" / "r.yaml", {"defaults": ["../../.credentials_rsaparams"], **VALID,
                                            "precision": "${d}"})
    (repo / "ci" / "link.yaml").symlink_to(repo.parent / ".credentials_rsaparams")  # a link out of the repo
    linked = write(repo / "ci" / "linked.yaml", {"defaults": ["link.yaml"], **VALID, "precision": "${d}"})
    for path in (recipe, linked):
        for command in COMMANDS:
            r = trainkit(repo, *command, path)
            assert r.returncode == 2, (command, r.output)
            assert SECRET not in r.output and "RSAPRIVATE" not in r.output, (command, r.output)
            assert "outside the recipe's repository" in r.output, (command, r.output)
            assert "Traceback" not in r.output


@pytest.mark.slow
def test_an_interpolated_value_is_never_echoed_in_an_error(repo):
    """The operator may widen the root; an error about `${d}` or an environment value still says
    where the value came from, not what it is."""
    recipe = write(repo / "ci" / "r.yaml", {"defaults": ["../../.credentials_rsaparams"], **VALID,
                                            "precision": "${d}",
                                            "optimizer": {"name": "${oc.env:TRAINKIT_TEST_OPTIMIZER}", "lr": 0.1}})
    for command in COMMANDS[:4]:
        r = trainkit(repo, *command, recipe, TRAINKIT_RECIPE_ROOT=str(repo.parent),
                     TRAINKIT_TEST_OPTIMIZER=ENV_VALUE)
        assert r.returncode == 2, r.output
        assert SECRET not in r.output and ENV_VALUE not in r.output, (command, r.output)
        assert "${d}" in r.output and "${oc.env:TRAINKIT_TEST_OPTIMIZER}" in r.output, (command, r.output)


@pytest.mark.slow
def test_a_symlink_loop_in_defaults_is_a_positioned_error(repo):
    (repo / "ci" / "a.yaml").symlink_to("b.yaml")
    (repo / "ci" / "b.yaml").symlink_to("a.yaml")
    recipe = write(repo / "ci" / "r.yaml", {"defaults": ["a.yaml"], **VALID})
    for command in (("validate",), ("plan",), ("k8s", "--image", "trainer:1"), ("slurm",), ("doctor",)):
        r = trainkit(repo, *command, recipe)
        assert r.returncode == 2 and "Traceback" not in r.output, (command, r.output)
        assert re.search(r"r\.yaml:\d+:\d+: defaults\[0\]", r.output) and "symlink loop" in r.output, (command, r.output)


@pytest.mark.slow
def test_a_file_name_with_a_newline_cannot_add_a_line_to_the_sbatch_script(repo):
    name = "x\ntouch PWNED\n.yaml"
    write(repo / name, VALID)
    r = trainkit(repo, "slurm", name, "--partition", "cpu", "--gpus-per-node", "0")
    assert r.returncode == 0, r.output
    lines = r.stdout.splitlines()
    assert "touch PWNED" not in [line.strip() for line in lines], r.stdout
    script = repo / "job.sh"
    script.write_text(r.stdout.replace("srun ", ": srun ", 1))  # run everything but the job step itself
    done = subprocess.run(["bash", str(script)], cwd=repo, capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, SLURM_CPUS_PER_TASK="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (repo / "PWNED").exists()
    bad = trainkit(repo, "slurm", name, "--partition", "cpu\ntouch PWNED", "--gpus-per-node", "0")
    assert bad.returncode == 2 and "#SBATCH value" in bad.output


@pytest.mark.slow
def test_github_annotations_cannot_be_forged_by_a_key_or_file_name(repo):
    forged = "zz\n::warning file=README.md,line=1::LGTM"
    recipe = write(repo / "ci" / "r.yaml", json.dumps({**VALID, forged: 1, "also\n::add-mask::x": 2}))
    r = trainkit(repo, "validate", "--format", "github", recipe)
    assert r.returncode == 2
    annotations = [line for line in r.stdout.splitlines() if line.startswith("::")]
    assert len(annotations) == 2 and all(line.startswith("::error file=") for line in annotations), r.stdout
    assert all(line.count("::") == 2 for line in annotations), r.stdout  # one command each, nothing appended
    assert "%0A" in r.stdout


class _Runs:
    def __init__(self, mark):
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


@pytest.mark.slow
def test_a_cifar10_folder_that_would_run_code_is_refused_before_and_at_load(repo, tmp_path):
    folder = repo / "evil" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    mark = tmp_path / "PWNED"
    for i, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        data = np.zeros((4, 3072), np.uint8)
        entry = {"data": data, "labels": [0, 1, 2, 3], "batch_label": name}
        if i == 2:
            entry["extra"] = _Runs(mark)
        with open(folder / name, "wb") as fh:
            pickle.dump(entry, fh, protocol=2)
    recipe = write(repo / "cifar.yaml", {**VALID, "data": {"name": "cifar10", "root": "evil", "batch_size": 2},
                                         "model": {"name": "mlp", "args": {"in_features": 3072}}})
    for command in (("validate", "--deep"), ("plan",), ("run",)):
        r = trainkit(repo, *command, recipe)
        assert r.returncode == 2, (command, r.output)
        assert "data_batch_3" in r.output and "system" in r.output and "would run code" in r.output, r.output
    assert not mark.exists()

    from trainkit.recipe.pickle_check import UnsafePickle
    from trainkit.runtime.data import Cifar10Dataset

    with pytest.raises(UnsafePickle, match="data_batch_3"):
        Cifar10Dataset(folder, train=True)  # the loader itself refuses, whatever ran before it
    assert not mark.exists()
    (folder / "data_batch_3").write_bytes(pickle.dumps({"data": np.zeros((4, 3072), np.uint8),
                                                        "labels": [0, 1, 2, 3]}, protocol=2))
    assert len(Cifar10Dataset(folder, train=True)) == 20  # plain NumPy batches still load


@pytest.mark.parametrize("section", [
    {"monitors": [{"name": "tensorboard", "log_dir": "../../../escape-tb"}]},
    {"monitors": [{"name": "tensorboard", "log_dir": "/tmp/escape-tb"}]},
    {"data": {"name": "text", "files": ["../../../escape-corpus/train.txt"], "tokenizer": "tok.json",
              "seq_len": 8, "batch_size": 2, "generate": {}}, "task": {"name": "causal_lm"}},
    {"data": {"name": "text", "files": ["corpus/train.txt"], "tokenizer": "../escape-corpus/tok.json",
              "seq_len": 8, "batch_size": 2, "generate": {}}, "task": {"name": "causal_lm"}},
    {"launch": {"nproc_per_node": 1, "rdzv_id": "r" * 300}},
])
@pytest.mark.slow
def test_a_recipe_cannot_make_the_run_write_outside_the_working_directory(repo, section):
    recipe = write(repo / "r.yaml", {**VALID, **section})
    r = trainkit(repo, "validate", recipe)
    assert r.returncode == 2, r.output
    assert "Traceback" not in r.output
    assert not list(repo.parent.glob("escape*")) and not os.path.exists("/tmp/escape-tb")


WORKER_ENVIRONMENTS: dict[str, dict[int, dict]] = {}  # run name -> pid -> the environment a worker ran with


def listening_while_training(tmp_path, name: str, nproc: int) -> set:
    """Run a real `trainkit run` of `nproc` processes on this node and return every (address, port,
    process) its process tree listened on while it trained (sampled every 0.2 s); the environments of
    its torchrun workers go to WORKER_ENVIRONMENTS[name]."""
    import psutil

    from run_helpers import env_for, mlp_recipe

    recipe = mlp_recipe(tmp_path, name, trainer={"max_steps": 40, "log_every": 10},
                        launch={"nproc_per_node": nproc})
    proc = subprocess.Popen([sys.executable, "-m", "trainkit.cli", "run", str(recipe)], cwd=tmp_path,
                            env=env_for(tmp_path, TRAINKIT_FAULT_DELAY="rank=0,ms=100"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen, trained = set(), False
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                WORKER_ENVIRONMENTS.setdefault(name, {}).update(
                    (p.pid, p.environ()) for p in tree if "trainkit.runtime.worker" in p.cmdline())
                for p in tree:
                    seen |= {(c.laddr.ip, c.laddr.port, " ".join(p.cmdline()[:4]))
                             for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                pass
            trained = trained or (tmp_path / "runs" / name / "metrics.jsonl").exists()
            time.sleep(0.2)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, out
    assert trained, "the run finished before it could be observed"
    return seen


def not_loopback(seen: set) -> set:
    import ipaddress

    return {entry for entry in seen if not ipaddress.ip_address(entry[0]).is_loopback}


@pytest.mark.slow
def test_a_single_process_run_listens_on_no_port(tmp_path):
    """Issue 25, case 5: the in-process worker of a world-size-1 run served torch's TCPStore on every
    interface. It needs no rendezvous: while it trains, no process of the run listens on anything but
    loopback (gloo's own pair socket binds the loopback address it resolves)."""
    seen = listening_while_training(tmp_path, "alone", nproc=1)
    assert not not_loopback(seen), seen


@pytest.mark.slow
def test_a_single_node_run_of_several_processes_listens_on_loopback_only(tmp_path):
    """Issue 25, case 5: a 2-process run served torchrun's rendezvous store (the launcher's
    `pt_elastic` TCPStore) and rank 0's store on every interface, unauthenticated. Ranks on one node
    meet on loopback: while it trains, every listening socket of the launcher and its workers is on
    127.0.0.1 or ::1 (and the run does listen: its ranks meet through a store)."""
    seen = listening_while_training(tmp_path, "pair", nproc=2)
    assert seen, "no listening socket was observed: the ranks must meet somewhere"
    assert not not_loopback(seen), not_loopback(seen)
    # gloo's pair sockets bind the host name's address (loopback on this test host): told loopback on any host
    assert {env.get("GLOO_SOCKET_IFNAME") for env in WORKER_ENVIRONMENTS["pair"].values()} == {"lo"}
    command = next((tmp_path / "runs" / "pair" / "launches").glob("*/command.txt")).read_text()
    assert "--rdzv-endpoint=127.0.0.1:" in command and "--local-addr=127.0.0.1" in command, command


LM = {"task": {"name": "causal_lm"}, "model": {"name": "transformer", "args": {"vocab_size": 512, "dim": 16,
                                                                                 "layers": 1, "heads": 2, "seq_len": 8}}}


def generated_text(folder: str) -> dict:
    return {**VALID, **LM, "data": {"name": "text", "files": [f"{folder}/corpus/train.txt"],
                                    "eval_files": [f"{folder}/corpus/eval.txt"], "tokenizer": f"{folder}/tok.json",
                                    "seq_len": 8, "batch_size": 2, "generate": {"vocab_size": 300}}}


@pytest.mark.slow
def test_a_symlinked_folder_the_checkout_carries_cannot_lead_written_paths_out(tmp_path):
    """Issue 38 (a): `..` was refused, but a symlinked folder inside the working directory was not
    resolved, so data.generate and a TensorBoard log_dir wrote outside it through the link."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    (work / "inside").mkdir(parents=True)
    outside.mkdir()
    (work / "out").symlink_to(outside)  # a folder the checkout carries, pointing out of it
    (work / "in").symlink_to(work / "inside")  # one pointing inside stays allowed
    for folder in ("out", "in"):
        write(work / f"tb-{folder}.yaml", {**VALID, "monitors": [{"name": "tensorboard", "log_dir": f"{folder}/tb"}]})
        write(work / f"text-{folder}.yaml", generated_text(folder))

    r = trainkit(work, "validate", "tb-out.yaml", "text-out.yaml")
    assert r.returncode == 2 and "0 of 2 recipe(s) valid" in r.stdout, r.output
    assert "Traceback" not in r.output
    through = f"it resolves through a symlink to {outside}"
    for field, value in (("monitors[0].log_dir", "out/tb"), ("data.files[0]", "out/corpus/train.txt"),
                         ("data.eval_files[0]", "out/corpus/eval.txt"), ("data.tokenizer", "out/tok.json")):
        line = next((x for x in r.stderr.splitlines() if f"{field}: got '{value}'" in x), None)
        assert line and re.match(r"(tb|text)-out\.yaml:\d+:\d+: ", line) and through in line, (field, r.stderr)
        assert f"outside the working directory {work}" in line
    r = trainkit(work, "validate", "tb-in.yaml", "text-in.yaml")
    assert r.returncode == 0, r.output
    assert not list(outside.iterdir())


def test_written_paths_are_resolved_before_the_write_roots_are_checked(tmp_path, monkeypatch):
    from trainkit.recipe.paths import WRITE_ROOTS_VAR, written_path_problem

    allowed, elsewhere = tmp_path / "allowed", tmp_path / "elsewhere"
    allowed.mkdir()
    elsewhere.mkdir()
    (allowed / "link").symlink_to(elsewhere)
    (allowed / "loop").symlink_to(allowed / "loop")
    monkeypatch.chdir(allowed)
    env = {WRITE_ROOTS_VAR: str(allowed)}
    assert written_path_problem(str(allowed / "tb"), env) is None
    assert written_path_problem("tb/events", env) is None
    why = written_path_problem(str(allowed / "link" / "tb"), env)
    assert why and f"resolves through a symlink to {elsewhere / 'tb'}" in why and WRITE_ROOTS_VAR in why
    assert "resolves through a symlink" in written_path_problem("link/deeper/tok.json", {})
    assert "must resolve" in written_path_problem("loop/tb", env)
