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
