"""Importing DeepSpeed into a training rank without what only its autotuner uses.

Why: `import deepspeed` reaches `deepspeed.runtime.config`, which imports `deepspeed.autotuning`,
whose autotuner imports MLflow when it is installed (`try: import mlflow`, only to log autotuning
experiments). trainkit installs MLflow for its tracking, which runs in the launcher, never in a rank,
and trainkit never runs DeepSpeed's autotuner. MLflow brings pandas, FastAPI, SQLAlchemy and
OpenTelemetry: about 110 MiB resident in every rank, measured (docs/benchmarks.md, "No rank holds the
whole model"); DeepSpeed itself adds about 20 MiB. So a rank imports DeepSpeed with MLflow marked
absent (Python's own convention: a `None` in `sys.modules` makes `import mlflow` raise ImportError,
which the autotuner catches), then takes the mark away: a later `import mlflow` in the same process
imports it normally. A process that already imported MLflow is left as it is.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

# imported by DeepSpeed only for features trainkit does not use (the autotuner's experiment logging)
UNUSED_BY_TRAINKIT = ("mlflow",)


@contextmanager
def absent(names: tuple[str, ...]):
    """Within the block, `import NAME` raises ImportError for each NAME not imported yet."""
    marked = [name for name in names if name not in sys.modules]
    for name in marked:
        sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in marked:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]


def import_deepspeed():
    """`deepspeed`, imported once per process without MLflow; the CPU accelerator where CUDA is absent."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "deepspeed" not in sys.modules:
        with absent(UNUSED_BY_TRAINKIT):
            import deepspeed  # noqa: F401
    return sys.modules["deepspeed"]
