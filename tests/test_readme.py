"""README's two commands are the contract with a new user and with CI: keep them true."""

import re

from conftest import REPO


def readme_commands() -> list[str]:
    return re.findall(r"```sh\n(.+?)\n```", (REPO / "README.md").read_text())[:2]


def test_readme_opens_with_the_run_and_the_test_command():
    run, test = readme_commands()
    assert run.startswith("python3 -m venv .venv") and "trainkit run recipes/" in run
    assert test.startswith("python3 -m venv .venv") and "pytest" in test


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci


def test_the_main_job_recipe_exists_and_its_data_command_matches_it():
    run = readme_commands()[0]
    recipe = re.search(r"trainkit run (\S+)", run).group(1)
    assert (REPO / recipe).is_file()
    root = re.search(r"make-imagefolder (\S+)", run).group(1)
    assert f"root: {root}" in (REPO / recipe).read_text()


def test_the_main_job_evaluates_on_held_out_images():
    """Guards the demo's evaluation split: make-imagefolder writes train/ and val/, and the recipe
    trains on one and evaluates on the other (not on the training images)."""
    run = readme_commands()[0]
    root = re.search(r"make-imagefolder (\S+)", run).group(1)
    assert re.search(r"--val-per-class [1-9]", run)
    text = (REPO / re.search(r"trainkit run (\S+)", run).group(1)).read_text()
    assert re.search(rf"^  root: {root}/train$", text, re.M) and re.search(rf"^  val_root: {root}/val\b", text, re.M)
