"""Metric sinks: objects with `log(metrics, step)` and `close()`. MLflow and monitors plug in here."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Protocol


class MetricsSink(Protocol):
    def log(self, metrics: dict, step: int) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per logged step in RUN_DIR/metrics.jsonl (appended across launches)."""

    def __init__(self, path: Path):
        self.fh = open(path, "a", buffering=1)

    def log(self, metrics: dict, step: int) -> None:
        self.fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self.fh.close()
