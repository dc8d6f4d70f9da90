"""Writing a plugin: `trainkit plugins new` scaffolds an installable package whose own test passes;
installed into a throwaway folder (never the suite's environment), a recipe uses it in a real run;
`trainkit plugins` lists it with its package and options, and warns about options modules that import
torch at module level; an unknown kind is a clear error."""

from __future__ import annotations

import pytest
import json
import os
import subprocess
import sys

from run_helpers import mlp_recipe, trainkit

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


TIMEOUT = 240


def with_site(site) -> dict:
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def test_scaffolded_monitor_installs_passes_its_test_and_runs_in_a_recipe(tmp_path):
    made = trainkit(tmp_path, "plugins", "new", "monitor", "step_alarm", "--dir", str(tmp_path / "src"))
    assert made.returncode == 0, made.output
    package = tmp_path / "src" / "trainkit-step-alarm"
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(package)], capture_output=True, text=True, timeout=TIMEOUT,
                         cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = dict(os.environ, **with_site(site))
    tested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
                            capture_output=True, text=True, timeout=TIMEOUT, cwd=package, env=env)
    assert tested.returncode == 0 and "2 passed" in tested.stdout, tested.stdout + tested.stderr

    listed = trainkit(tmp_path, "plugins", "monitor", **with_site(site))
    assert listed.returncode == 0, listed.output
    assert "step_alarm" in listed.stdout and "trainkit-step-alarm 0.1.0" in listed.stdout
    assert "options: limit_s=10.0" in listed.stdout

    recipe = mlp_recipe(tmp_path, "alarmed", launch={"nproc_per_node": 1}, trainer={"max_steps": 6, "log_every": 2},
                        monitors=[{"name": "step_alarm", "limit_s": 60}])
    result = trainkit(tmp_path, "run", str(recipe), **with_site(site))
    assert result.returncode == 0, result.output
    run_dir = tmp_path / "runs" / "alarmed"
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("step_alarm/slowest_step_s" in r for r in logged)
    assert "## step_alarm" in (run_dir / "reports" / "bottleneck.md").read_text()


def test_plugins_warns_about_torch_in_an_options_module_and_rejects_unknown_kinds(tmp_path):
    site = tmp_path / "site"
    (site / "heavy_opts.py").parent.mkdir(parents=True)
    (site / "heavy_opts.py").write_text(
        "from typing import ClassVar, Literal\nimport torch\nfrom trainkit.recipe.blocks import MonitorOptions\n\n"
        "class HeavyOptions(MonitorOptions):\n    component: ClassVar[str] = 'heavy_opts:nothing'\n"
        "    name: Literal['heavy']\n")
    info = site / "trainkit_heavy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: trainkit-heavy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[trainkit.monitors]\nheavy = heavy_opts:HeavyOptions\n")
    listed = trainkit(tmp_path, "plugins", "monitors", **with_site(site))
    assert listed.returncode == 0, listed.output
    assert "monitor plugin 'heavy' (trainkit-heavy 0.1): heavy_opts imports torch at module level" in listed.stderr
    assert "slows down" in listed.stderr

    wrong = trainkit(tmp_path, "plugins", "new", "widget", "thing")
    assert wrong.returncode == 2
    assert "no plugin kind 'widget' (kinds: model, dataset, strategy, monitor)" in wrong.stderr
    assert trainkit(tmp_path, "plugins", "new", "monitor", "Bad-Name").returncode == 2


def test_every_kind_scaffolds_a_package_with_an_entry_point(tmp_path):
    for kind in ("model", "dataset", "strategy"):
        made = trainkit(tmp_path, "plugins", "new", kind, f"my_{kind}", "--dir", str(tmp_path))
        assert made.returncode == 0, made.output
        root = tmp_path / f"trainkit-my-{kind}"
        assert f'my_{kind} = "trainkit_my_{kind}.' in (root / "pyproject.toml").read_text()
        assert (root / "tests" / f"test_my_{kind}.py").is_file()
