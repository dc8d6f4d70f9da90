import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRAINKIT = [sys.executable, "-m", "trainkit.cli"]


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    """Keep compile/extension caches and temp files of every test in its own folder."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    yield


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
