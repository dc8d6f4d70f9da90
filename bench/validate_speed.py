"""How long `trainkit validate` takes on 20 recipes: the CI use case (goal: median < 0.5 s).

Usage: python bench/validate_speed.py [--repeats 7]
Writes 20 recipes (the shipped ones plus variants) to a temp folder, runs the real CLI as a
subprocess `--repeats` times and prints the median wall time, plus the import check.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_recipes(folder: Path, count: int = 20) -> list[str]:
    shutil.copytree(REPO / "recipes", folder, dirs_exist_ok=True)
    shipped = sorted(p for p in folder.glob("*.yaml"))
    files = [str(p) for p in shipped]
    i = 0
    while len(files) < count:
        src = shipped[i % len(shipped)]
        dst = folder / f"variant-{i}.yaml"
        dst.write_text(src.read_text().replace("name: ", f"name: v{i}-", 1))
        files.append(str(dst))
        i += 1
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = make_recipes(Path(tmp))
        cmd = [sys.executable, "-m", "trainkit.cli", "validate", *files]
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            res = subprocess.run(cmd, capture_output=True, text=True)
            times.append(time.perf_counter() - start)
            if res.returncode != 0:
                sys.exit(f"validate failed:\n{res.stderr}")
        heavy = subprocess.run([sys.executable, "-c", "import sys; from trainkit.cli import main\n"
                                "try: main(['validate', *sys.argv[1:]])\nexcept SystemExit: pass\n"
                                "print([m for m in ('torch','deepspeed','mlflow') if m in sys.modules])", *files],
                               capture_output=True, text=True).stdout.strip().splitlines()[-1]
    median = statistics.median(times)
    print(f"trainkit validate, {len(files)} recipes, {args.repeats} runs: median {median:.3f} s "
          f"(min {min(times):.3f}, max {max(times):.3f}); goal < 0.5 s -> {'PASS' if median < 0.5 else 'FAIL'}")
    print(f"heavy modules imported by validate: {heavy}")


if __name__ == "__main__":
    main()
