"""`trainkit export` of a ZeRO-3 checkpoint: the exporting process's peak RSS against the model's size.

    python bench/export_memory.py [--depth 7] [--hidden 4096] [--repeats 2]

A real 2-rank ZeRO-3 `trainkit run` (CPU, fp32, AdamW, one step) of bench/strategies_memory.py's model
(an MLP 1024 -> hidden x depth -> 10: 105 M parameters at the defaults) writes a checkpoint. Then, each
in a fresh process that has imported torch, DeepSpeed and trainkit and reset its high-water mark
(/proc/self/clear_refs), alternately: DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` + the save
export used to do ("deepspeed"), and trainkit's export ("trainkit"). Reported: VmHWM above the
process's RSS before the export, as a multiple of the model's fp32 size.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from trainkit.run_dir import CHECKPOINTS, checkpoint_name

MEASURE = """
import sys
from pathlib import Path
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import torch, deepspeed
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from trainkit.runtime.export import export
from trainkit.runtime.files import fsync_save
folder, out, how = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")
start = status("VmRSS")
if how == "deepspeed":
    fsync_save(dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag="zero")), out)
else:
    export(folder, out)
print(status("VmHWM") - start, sum(v.numel() for v in torch.load(out, mmap=True, weights_only=True).values()))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        recipe = {
            "name": "export-z3", "seed": 0,
            "model": {"name": "mlp", "args": {"in_features": 1024, "hidden": args.hidden, "num_classes": 10,
                                              "depth": args.depth}},
            "data": {"name": "synthetic", "batch_size": 2, "num_samples": 16, "shape": [1024], "num_classes": 10},
            "strategy": {"name": "deepspeed", "zero_stage": 3}, "precision": "fp32",
            "optimizer": {"name": "adamw", "lr": 1.0e-4}, "trainer": {"max_steps": 1},
            "launch": {"nproc_per_node": 2, "run_dir": str(folder)}, "tracking": {"enabled": False},
        }
        path = folder / "export-z3.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        run = subprocess.run([sys.executable, "-m", "trainkit.cli", "run", str(path)], capture_output=True,
                             text=True, env=env, timeout=1800)
        if run.returncode:
            raise SystemExit(f"the ZeRO-3 run failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
        checkpoint = folder / "export-z3" / CHECKPOINTS / checkpoint_name(1)
        for _ in range(args.repeats):
            for how in ("deepspeed", "trainkit"):
                out = subprocess.run([sys.executable, "-c", MEASURE, str(checkpoint), str(folder / f"{how}.pt"), how],
                                     capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode:
                    raise SystemExit(f"{how} failed:\n{out.stderr[-4000:]}")
                above, values = map(int, out.stdout.split()[-2:])
                print(f"{how}: {values:,} parameters ({4 * values / 2**30:.2f} GiB fp32), peak above the "
                      f"process's start {above / 2**30:.2f} GiB = {above / (4 * values):.2f}x the model", flush=True)


if __name__ == "__main__":
    main()
