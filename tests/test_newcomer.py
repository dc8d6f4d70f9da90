"""What a new user meets first (issue 27, "Newcomer friction"): the commands the docs show work as
written after the README's set-up, installed names that do not collide, and clear answers to the
first mistakes."""

from __future__ import annotations

import re
import sys

from conftest import REPO
from run_helpers import trainkit

BARE = re.compile(r"^(trainkit|pip|pytest)\b")  # found on PATH only once the venv is activated


def shell_blocks(page: str) -> list[list[str]]:
    text = (REPO / page).read_text()
    return [block.splitlines() for block in re.findall(r"```(?:sh|bash)\n(.*?)```", text, re.S)]


def test_docs_commands_run_after_the_readme_set_up_without_an_activated_venv():
    """The README's set-up never activates .venv: a bare `trainkit`/`pip` line is `command not found`
    unless its block activates the venv first."""
    for page in ("README.md", "docs/plugins.md"):
        for block in shell_blocks(page):
            activated = False
            for line in block:
                activated = activated or line.startswith(". .venv/bin/activate")
                assert activated or not BARE.match(line), f"{page}: {line!r} needs `. .venv/bin/activate` first"


def test_plugins_new_says_how_to_install_into_the_environment_that_runs_trainkit(tmp_path):
    made = trainkit(tmp_path, "plugins", "new", "monitor", "step_alarm", "--dir", str(tmp_path))
    assert made.returncode == 0, made.output
    assert f"install: {sys.executable} -m pip install {tmp_path / 'trainkit-step-alarm'}" in made.stdout
    assert f"test:    {sys.executable} -m pytest " in made.stdout
    readme = (tmp_path / "trainkit-step-alarm" / "README.md").read_text()
    assert "`pip install" not in readme and "-m pip install ." in readme


def declared_name(pyproject) -> tuple[str, list[str]]:
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    return project["name"], project.get("dependencies", [])


def test_the_distribution_has_its_own_name_on_the_package_index_and_plugins_depend_on_it(tmp_path):
    """`trainkit` on the package index is an unrelated project: a plugin depending on it would pull
    that in wherever this checkout is not installed. The import name and the command stay `trainkit`."""
    from importlib.metadata import distribution

    from trainkit.registry import DISTRIBUTION, names

    name, _ = declared_name(REPO / "pyproject.toml")
    assert name == DISTRIBUTION and name != "trainkit"
    assert declared_name(REPO / "plugins/example/pyproject.toml")[1] == [DISTRIBUTION]
    made = trainkit(tmp_path, "plugins", "new", "model", "tiny", "--dir", str(tmp_path))
    assert made.returncode == 0, made.output
    assert declared_name(tmp_path / "trainkit-tiny" / "pyproject.toml")[1] == [DISTRIBUTION]
    installed = distribution(DISTRIBUTION)  # the checkout installed under that name, its command still `trainkit`
    assert "trainkit = trainkit.cli:main" in installed.read_text("entry_points.txt")
    assert set(names("strategies", builtin_only=True)) >= {"ddp", "fsdp", "pipeline", "deepspeed"}
