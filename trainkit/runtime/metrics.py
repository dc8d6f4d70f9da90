"""metrics.jsonl: the run directory's own record of every logged step (a `protocols.MetricSink`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..run_dir import rewound_metrics_path


class JsonlSink:
    """One JSON object per logged step in RUN_DIR/metrics.jsonl (appended across launches)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = open(path, "a", buffering=1)

    def rewind(self, step: int) -> None:
        """Training continues from `step`: set the lines of later steps aside (metrics.rewound-*.jsonl),
        so metrics.jsonl holds one line per logged step of the timeline that is being trained."""
        self.fh.close()
        lines = self.path.read_text().splitlines(keepends=True)
        later = [line for line in lines if _step(line) > step]
        if later:
            aside = rewound_metrics_path(self.path, time.strftime('%Y%m%d-%H%M%S'), step)
            with open(aside, "a") as fh:
                fh.writelines(later)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line for line in lines if _step(line) <= step))
            os.replace(tmp, self.path)
        self.fh = open(self.path, "a", buffering=1)

    def log(self, metrics: dict, step: int) -> None:
        self.fh.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")

    def close(self) -> None:
        self.fh.close()


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return -1  # a line torn by a crash: kept where it is
