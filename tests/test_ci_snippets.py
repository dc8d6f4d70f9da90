"""Every CI and editor snippet in docs/validation-in-ci.md works with the real tool: pre-commit on a
scratch repository using this checkout's hook, the GitHub Actions step's command and its
annotations, and the VS Code schema as a JSON Schema that accepts a shipped recipe."""

import pytest
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import yaml

from conftest import REPO, TRAINKIT

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


DOC = (REPO / "docs" / "validation-in-ci.md").read_text()
GOOD = "name: ok\nmodel: {name: mlp}\ndata: {name: synthetic, batch_size: 8}\nstrategy: {name: ddp}\ntrainer: {max_steps: 5}\n"


def snippet(lang: str, marker: str) -> str:
    return next(block for block in re.findall(rf"```{lang}\n(.*?)```", DOC, re.S) if marker in block)


def git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def test_pre_commit_snippet_runs_this_checkouts_hook(tmp_path):
    config = yaml.safe_load(snippet("yaml", ".pre-commit-config.yaml"))
    assert list(config) == ["repos"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    config["repos"][0].update(repo=str(REPO), rev=head)  # this checkout instead of the team's mirror
    work = tmp_path / "project"
    (work / "recipes/base").mkdir(parents=True)
    git("init", "-q", cwd=work)
    (work / ".pre-commit-config.yaml").write_text(yaml.safe_dump(config))
    (work / "recipes/good.yaml").write_text(GOOD)
    (work / "recipes/base/fragment.yaml").write_text("seed: 1\n")  # not a whole recipe: skipped
    bin_dir = tmp_path / "bin"  # `language: system` runs the trainkit on PATH
    bin_dir.mkdir()
    (bin_dir / "trainkit").write_text(f"#!/bin/sh\nexec {sys.executable} -m trainkit.cli \"$@\"\n")
    (bin_dir / "trainkit").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PRE_COMMIT_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    pre_commit = [sys.executable, "-m", "pre_commit"]
    check = subprocess.run([*pre_commit, "validate-config", ".pre-commit-config.yaml"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    git("add", ".", cwd=work)
    ok = subprocess.run([*pre_commit, "run", "--all-files"], cwd=work, env=env, capture_output=True, text=True,
                        timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (work / "recipes/bad.yaml").write_text(GOOD.replace("max_steps: 5", "max_stepz: 5"))
    git("add", ".", cwd=work)
    bad = subprocess.run([*pre_commit, "run", "--all-files"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1
    assert "recipes/bad.yaml:5:11: trainer.max_stepz: unknown key 'max_stepz'; did you mean 'max_steps'?" in bad.stdout


def test_github_actions_snippet_prints_annotations(tmp_path):
    steps = yaml.safe_load(snippet("yaml", "--format github"))
    assert isinstance(steps, list) and all(set(s) == {"run"} for s in steps)
    command = steps[-1]["run"].split()
    assert command[:2] == ["trainkit", "validate"]
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes/bad.yaml").write_text(GOOD.replace("batch_size: 8", "batch_size: 0"))
    res = subprocess.run([*TRAINKIT, *command[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stdout.strip() == ("::error file=recipes/bad.yaml,line=3,col=37::data.batch_size: Input should be "
                                  "greater than 0 (got 0)")


def test_vscode_schema_is_a_json_schema_that_accepts_a_shipped_recipe(tmp_path):
    assert "trainkit schema > .vscode/trainkit.schema.json" in snippet("sh", "trainkit schema")
    res = subprocess.run([*TRAINKIT, "schema"], cwd=REPO, capture_output=True, text=True, timeout=60)
    schema = json.loads(res.stdout)
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    settings = json.loads(re.sub(r"^\s*//.*$", "", snippet("jsonc", "yaml.schemas"), flags=re.M))
    assert settings["yaml.schemas"] == {".vscode/trainkit.schema.json": ["recipes/*.yaml"]}
    validator(schema).validate(yaml.safe_load(GOOD))
    errors = list(validator(schema).iter_errors(yaml.safe_load(GOOD.replace("max_steps", "max_stepz"))))
    assert errors, "the editor schema must flag unknown keys"
