import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAINKIT = [sys.executable, "-m", "trainkit.cli"]


@pytest.fixture(scope="session")
def _session_trainkit_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trainkit-cache")


@pytest.fixture(scope="session")
def _session_inductor_cache(pytestconfig, tmp_path_factory) -> Path:
    """Inductor's cache for every test: pytest's cache folder where it has one (the grid's compile cells
    keep theirs there too: tests/test_compatibility.py), so the session builds each kernel once."""
    cache = getattr(pytestconfig, "cache", None)
    return cache.mkdir("torchinductor") if cache is not None else tmp_path_factory.mktemp("torchinductor")


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch, _session_trainkit_cache, _session_inductor_cache):
    """Keep extension caches and temp files of every test in its own folder; trainkit's own cache (the
    memory plan's model traces, runtime/model_sizes_cache.py) and inductor's compiled kernels are the
    session's, as a user's are shared by their launches, and never the home folder's. Inductor keys
    each entry by the graph, its inputs, the config and torch's version, so a test that compiles what
    another compiled reads it back instead of running g++ again (its C++ prelude, the precompiled
    header, is built once)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(_session_inductor_cache))
    monkeypatch.setenv("TRAINKIT_CACHE_DIR", str(_session_trainkit_cache))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    yield


# --------------------------------------------------------------------------- the strategies' reference
@pytest.fixture(scope="session")
def single(tmp_path_factory) -> list[float]:
    """The seeded MLP trained by one process at the 2-rank global batch: the trajectory the FSDP,
    DeepSpeed and pipeline tests follow (strategy_runs.single_process_losses), trained once per session."""
    from strategy_runs import single_process_losses

    return single_process_losses(tmp_path_factory.mktemp("single"))


# --------------------------------------------------------------------------- language-model runs
# Shared by test_tasks_lm.py and test_strategies_lm.py: one corpus and one 1-rank reference run per session.
@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict:
    from lm_runs import make_corpus

    return make_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory, corpus) -> list[float]:
    from lm_runs import STEPS, tiny_lm
    from run_helpers import losses, write_recipe
    from strategy_runs import run

    tmp = tmp_path_factory.mktemp("one")
    path = write_recipe(tmp, "one", tiny_lm(corpus), data={"batch_size": 8}, launch={"nproc_per_node": 1})
    out = losses(run(tmp, path))
    assert len(out) == STEPS and out[-1] < out[0]
    return out


# --------------------------------------------------------------------------- tiers: `pytest -m "not slow"`
# A test that starts a process (a CLI subprocess, torchrun, an MLflow server, a browser) is marked
# `slow` (or `distributed` or `gpu`, which imply it); the development tier `pytest -m "not slow"` is what
# runs in-process. The check below is what keeps the marks true: a test that starts a process without
# the mark fails, naming the mark to add (TRAINKIT_MARKER_AUDIT=FILE lists offenders instead).
def pytest_collection_modifyitems(config, items):
    for item in items:
        if (item.get_closest_marker("distributed") or item.get_closest_marker("gpu")) \
                and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


# --------------------------------------------------------------------------- DeepSpeed's ops, built once
# DeepSpeed JIT-compiles its CPU comm op (~30 s) and CPU Adam (~60 s) on first use, into the extension
# folder every DeepSpeed launch of the session shares (strategy_runs.deepspeed_env: pytest's cache). The
# first launch that needs them waited for that build on one core while the other sat idle. When the
# session runs DeepSpeed's tests, one background process at the lowest CPU priority builds both from the
# start, on what the tests leave idle; a launch that needs an op meanwhile waits on torch's build lock for
# the build in progress instead of starting another. Its own session: a Ctrl-C of pytest does not cut
# a build and leave the lock behind.
_op_builder = None

DEEPSPEED_OPS_BUILD = (
    "import os\n"
    "os.nice(19)\n"
    "from deepspeed.accelerator import get_accelerator\n"
    "for name in ('ShareMemCommBuilder', 'CPUAdamBuilder'):\n"
    "    builder = get_accelerator().create_op_builder(name)\n"
    "    if builder is not None:\n"
    "        builder.load(verbose=False)\n")


def pytest_collection_finish(session):
    global _op_builder
    import importlib.util
    import subprocess

    if getattr(session.config, "cache", None) is None or session.config.option.collectonly \
            or importlib.util.find_spec("deepspeed") is None:
        return
    # only for a session that launches DeepSpeed (its test modules share the ops through deepspeed_env):
    # `pytest tests/test_run_ddp.py` neither builds them nor waits for a build at its end
    if not any(getattr(getattr(item, "module", None), "deepspeed_env", None) for item in session.items):
        return
    from strategy_runs import deepspeed_extensions_folder

    folder = deepspeed_extensions_folder(session.config)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder), "DS_ACCELERATOR": "cpu"}
    _op_builder = subprocess.Popen([sys.executable, "-c", DEEPSPEED_OPS_BUILD], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session):
    if _op_builder is not None and _op_builder.poll() is None:
        try:
            _op_builder.wait(timeout=300)  # never cut a build: its lock would stop the next session's launches
        except Exception:
            pass


@pytest.fixture(autouse=True)
def _launches_are_marked(request, monkeypatch):
    import multiprocessing
    import subprocess

    if request.node.get_closest_marker("slow"):
        yield
        return
    started: list[str] = []
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recording_popen(self, args, *a, **k):
        if not _library_lookup():
            started.append(str(args if isinstance(args, str) else " ".join(map(str, args)))[:120])
        return popen_init(self, args, *a, **k)

    def recording_start(self):
        started.append(f"multiprocessing.Process({self.name})")
        return process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    yield
    if started:
        audit = os.environ.get("TRAINKIT_MARKER_AUDIT")
        if audit:
            with open(audit, "a") as f:
                f.write(f"{request.node.nodeid}\t{started[0]}\n")
        else:
            pytest.fail(f"{request.node.nodeid} starts processes ({started[0]} ...) but is not marked slow: "
                        f"add @pytest.mark.slow (or pytestmark = pytest.mark.slow) so `pytest -m 'not slow'` "
                        f"stays the in-process tier", pytrace=False)


def _library_lookup() -> bool:
    """A process started by `ctypes.util.find_library` (ldconfig, gcc) while some library is imported for
    the first time (torch does on import): not the test's launch, and which test pays for it depends on
    the order tests run in."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith("ctypes/util.py"):
            return True
        frame = frame.f_back
    return False
