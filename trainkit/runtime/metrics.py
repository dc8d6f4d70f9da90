"""metrics.jsonl: the run directory's own record of every logged step (a `protocols.MetricSink`)."""

from __future__ import annotations

import json
import time
from pathlib import Path


class JsonlSink:
    """One JSON object per logged step in RUN_DIR/metrics.jsonl (appended across launches)."""

    def __init__(self, path: Path):
        self.fh = open(path, "a", buffering=1)

    def log(self, metrics: dict, step: int) -> None:
        self.fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self.fh.close()
