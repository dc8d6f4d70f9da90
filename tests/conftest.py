import os
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
