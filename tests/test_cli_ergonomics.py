"""Recipe and CLI ergonomics, through the real command line: alias hints, overrides wherever a
recipe is taken (`~` deletes, `+` adds under free-form mappings), help with examples, what `plan`
says for one process, quiet broken pipes, interpolation named in errors, `init`, shell completion."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, TRAINKIT

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


RECIPE = """\
name: demo
model: {name: mlp, args: {hidden: 16}}
data: {name: synthetic, batch_size: 8, num_samples: 64, shape: [8]}
strategy: {name: ddp}
trainer: {max_steps: 10}
"""


def cli(*args, cwd=REPO, env=None, input=None, timeout=120):
    return subprocess.run([*TRAINKIT, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env, input=input)


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------- aliases
def test_aliases_from_other_frameworks_are_suggested_never_accepted(tmp_path):
    recipe = write(tmp_path, "r.yaml", RECIPE)
    res = cli("validate", recipe, "strategy.name=zero3", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "override 'strategy.name=zero3': strategy.name: unknown strategy \"zero3\"; did you mean strategy: "
        "{name: deepspeed, zero_stage: 3}? (registered: ddp, deepspeed, fsdp, pipeline)"]
    res = cli("validate", recipe, "strategy.name=DDP", cwd=tmp_path)
    assert "unknown strategy \"DDP\"; did you mean 'ddp'?" in res.stderr
    res = cli("validate", recipe, "max_steps=20", "optimizer.name=adamw", "optimizer.learning_rate=0.1",
              "precision=bf16-mixed", cwd=tmp_path)
    lines = res.stderr.splitlines()
    assert "override 'max_steps=20': max_steps: unknown key 'max_steps'; did you mean 'trainer.max_steps'? " \
           "(accepted: name, seed, model, task, data, strategy, parallel, precision, optimizer, scheduler, trainer, launch, " \
           "performance, monitors, tracking)" in lines
    assert "override 'optimizer.learning_rate=0.1': optimizer.learning_rate: unknown key 'learning_rate'; did " \
           "you mean 'lr'? (accepted: name, lr, betas, eps, weight_decay)" in lines
    assert "override 'precision=bf16-mixed': precision: got \"bf16-mixed\"; did you mean 'bf16'?; expected one " \
           "of: fp32, fp16, bf16" in lines


def test_the_alias_table_is_documented():
    from trainkit.recipe import aliases

    doc = (REPO / "docs" / "recipes.md").read_text()
    names = [*aliases.STRATEGY_NAMES, *aliases.PRECISIONS, *(k for t in aliases.KEYS.values() for k in t)]
    missing = [n for n in names if f"`{n}`" not in doc and not re.search(rf"`\w+\.{re.escape(n)}`", doc)]
    assert not missing, f"docs/recipes.md lacks aliases: {missing}"


# --------------------------------------------------------------------------- overrides everywhere
def test_validate_takes_overrides_after_the_recipe(tmp_path):
    recipe = write(tmp_path, "r.yaml", RECIPE)
    res = cli("validate", recipe, "strategy.name=deepspeed", "strategy.zero_stage=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "1 of 1 recipe(s) valid with the override(s) strategy.name=deepspeed strategy.zero_stage=2" in res.stdout
    res = cli("validate", recipe, "strategy.zero_stage=2", cwd=tmp_path)
    assert res.returncode == 2 and "no such file" not in res.stderr
    assert res.stderr.startswith("override 'strategy.zero_stage=2': strategy.zero_stage: unknown key 'zero_stage'")


def test_an_override_longer_than_a_file_name_gets_the_overrides_message(tmp_path):
    """Issue 38 (e): each argument was first tried as a path, and a name over the file system's limit
    raised 'File name too long' (exit 1) before the override was read."""
    recipe = write(tmp_path, "r.yaml", RECIPE)
    key, value = "trainer." + "k" * 300, "v" * 300
    res = cli("validate", recipe, f"{key}=1", f"trainer.max_steps={value}", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert f"override '{key}=1': {key}: unknown key" in res.stderr
    assert f"override 'trainer.max_steps={value}': trainer.max_steps: Input should be a valid integer" in res.stderr
    assert "Traceback" not in res.stderr and "too long" not in res.stderr


def test_data_helpers_refuse_bad_input_without_a_traceback(tmp_path):
    """Issue 38 (d): a JSONL line that is not JSON surfaced as a `datasets` traceback; a negative
    --val-per-class wrote a folder and exited 0."""
    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "a b c"}\n\n{"text": "d e f"}\n{"text": broken\n{"text": "g"}\n')
    res = cli("data", "train-tokenizer", data.name, "--out", "tok.json", "--vocab-size", "300", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("trainkit: error: docs.jsonl:4: not JSON (Expecting value at column 10)"), res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "tok.json").exists()
    for flag, value in (("--val-per-class", "-2"), ("--seed", "-1")):  # numpy refused a negative seed
        res = cli("data", "make-imagefolder", "imgs", "--classes", "1", "--size", "8", flag, value, cwd=tmp_path)
        assert res.returncode == 2 and f"argument {flag}: expected a whole number, 0 or more" in res.stderr, res.stderr
        assert "Traceback" not in res.stderr
    assert not (tmp_path / "imgs").exists()


def test_overrides_apply_to_each_recipe_and_messages_say_which(tmp_path):
    write(tmp_path, "recipes/a.yaml", RECIPE)
    write(tmp_path, "recipes/b.yaml", RECIPE.replace("name: demo", "name: other"))
    res = cli("validate", "recipes/", "precision=fp8", cwd=tmp_path)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        f"recipes/{n}.yaml: override 'precision=fp8': precision: got \"fp8\"; expected one of: fp32, fp16, bf16"
        for n in "ab"]
    assert res.stdout.startswith("0 of 2 recipe(s) valid with the override(s) precision=fp8 applied to each")
    gh = cli("validate", "--format", "github", "recipes/", "precision=fp8", cwd=tmp_path)
    assert gh.stdout.splitlines()[0].startswith("::error file=recipes/a.yaml::override 'precision=fp8': precision:")


def test_tilde_deletes_an_inherited_key_and_plus_adds_under_a_free_form_mapping(tmp_path):
    write(tmp_path, "base/b.yaml", "data: {name: synthetic, batch_size: 8, num_workers: 0, prefetch_factor: 2}\n")
    recipe = write(tmp_path, "r.yaml", "defaults: [base/b.yaml]\n" + RECIPE.replace(
        "data: {name: synthetic, batch_size: 8, num_samples: 64, shape: [8]}\n", ""))
    res = cli("validate", recipe, cwd=tmp_path)
    assert "r.yaml" not in res.stderr and "base/b.yaml:1:" in res.stderr and "prefetch_factor" in res.stderr
    res = cli("validate", recipe, "~data.prefetch_factor", "+model.args.depth=3", "trainer.grad_clip=1.0",
              cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    res = cli("validate", recipe, "model.args.depth=3", "~trainer.max_steps", "~data.nope", cwd=tmp_path)
    assert res.stderr.splitlines() == [
        "override '~data.nope': data.nope: nothing to delete: the recipe has no such key"]
    res = cli("validate", recipe, "model.args.depth=3", "~trainer.max_steps", cwd=tmp_path)
    assert sorted(res.stderr.splitlines()) == sorted([
        "override '~trainer.max_steps': trainer.max_steps: required field missing (optimizer steps to train)",
        "override 'model.args.depth=3': model.args.depth: model.args is a free-form mapping (keyword "
        "arguments for the model factory) and has no key 'depth'; to add it, write +model.args.depth=3",
    ])


def test_plan_and_doctor_take_the_same_overrides(tmp_path):
    recipe = write(tmp_path, "r.yaml", RECIPE)
    res = cli("plan", recipe, "~model.args.hidden", "+model.args.hidden=24", "trainer.max_steps=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "hidden: 24" in res.stdout and "max_steps: 3" in res.stdout
    res = cli("doctor", recipe, "strategy.name=fsdp2", cwd=tmp_path)
    assert res.returncode == 2 and "did you mean 'fsdp'?" in res.stderr


# --------------------------------------------------------------------------- plan
def test_plan_for_one_process_says_it_runs_in_process_without_restarts(tmp_path):
    recipe = write(tmp_path, "r.yaml", RECIPE + "launch: {nproc_per_node: 1, max_restarts: 3}\n")
    res = cli("plan", recipe, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "torchrun --" not in res.stdout and "--max-restarts" not in res.stdout
    assert "world size 1: the worker runs inside the `trainkit run` process, without torchrun" in res.stdout
    assert "no restarts; launch.max_restarts 3 does not apply" in res.stdout
    res = cli("plan", recipe, "launch.nproc_per_node=2", cwd=tmp_path)
    assert "torchrun --nnodes=1 --nproc-per-node=2 --standalone --max-restarts=3" in res.stdout


# --------------------------------------------------------------------------- help, pipes
COMMANDS = ["init", "validate", "schema", "plan", "run", "doctor", "export", "runs", "compare", "ui", "sync",
            "report", "completion", "data"]


def test_every_command_has_a_description_and_examples():
    code = ("import contextlib, io, sys\nfrom trainkit.cli import main\n"
            "for c in sys.argv[1:]:\n    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out):\n        try: main([*c.split(), '--help'])\n"
            "        except SystemExit: pass\n    print('=====', c); print(out.getvalue())")
    res = subprocess.run([sys.executable, "-c", code, *COMMANDS, "data make-imagefolder"], capture_output=True,
                         text=True, timeout=60, cwd=REPO)
    pages = dict(re.findall(r"===== ([^\n]+)\n(.*?)(?=\n===== |\Z)", res.stdout, re.S))
    assert sorted(pages) == sorted([*COMMANDS, "data make-imagefolder"])
    for command, page in pages.items():
        usage, description = page.split("\n\n")[:2]
        assert description.strip() and not description.startswith(("positional", "options")), command
        assert "\nexamples:\n  " in page and f"trainkit {command}" in page.split("examples:")[1], command
    top = cli("--help").stdout
    assert "examples:" in top and all(c in top for c in COMMANDS)


def test_output_piped_to_head_ends_quietly(tmp_path):
    res = subprocess.run(f"{shutil.which('python3') and sys.executable} -m trainkit.cli schema --markdown | head -1",
                         shell=True, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.stdout.startswith("#") and len(res.stdout.splitlines()) == 1
    assert res.stderr == ""
    # deterministic: the reader is gone before the first write
    proc = subprocess.Popen([*TRAINKIT, "schema", "--markdown"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == b""


# --------------------------------------------------------------------------- interpolation
def test_a_missing_data_folder_from_an_environment_default_says_which_variable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "IMAGENET_ROOT"}
    res = cli("validate", "--deep", "recipes/resnet152.yaml", env=env, timeout=180)
    assert res.returncode == 2
    assert ("recipes/base/imagenet.yaml:5:9: data.root: data folder not found: /data/imagenet/train; "
            "the value came from ${oc.env:IMAGENET_ROOT,/data/imagenet}/train (IMAGENET_ROOT "
            "is not set, so its default '/data/imagenet' was used): set IMAGENET_ROOT, or change data.root; or make "
            "a small one with `trainkit data make-imagefolder /data/imagenet/train`") in res.stderr.splitlines()


# --------------------------------------------------------------------------- init
def test_init_with_flags_writes_a_commented_recipe_that_validates(tmp_path):
    res = cli("init", "team/run.yaml", "--yes", "--data", "synthetic", "--model", "small_cnn", "--gpus-per-node", 4,
              "--nodes", 2, "--rdzv-endpoint", "node0:29400", "--strategy", "fsdp", "--precision", "bf16",
              "--tracking-uri", "http://mlflow:5000", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "team/run.yaml").read_text()
    assert "# FSDP2:" in text and "# bf16:" in text and "nproc_per_node: 4, nnodes: 2" in text
    assert 'uri: "http://mlflow:5000"' in text and "world size 8" in text
    assert cli("validate", "team/run.yaml", cwd=tmp_path).returncode == 0
    again = cli("init", "team/run.yaml", "--yes", cwd=tmp_path)
    assert again.returncode == 2 and "exists" in again.stderr
    bad = cli("init", "x.yaml", "--yes", "--strategy", "zero3", cwd=tmp_path)
    assert bad.returncode == 2 and "{name: deepspeed, zero_stage: 3}" in bad.stderr


def test_init_asks_its_questions_on_stdin(tmp_path):
    folder = tmp_path / "images"
    for cls in ("cat", "dog", "eel"):
        (folder / cls).mkdir(parents=True)
    answers = f"{folder}\n\n2\n1\npippy\npipeline\n\noff\n"  # Enter takes a default; a wrong answer is asked again
    res = cli("init", "r.yaml", input=answers, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "Training data" in res.stderr and "Strategy (ddp, fsdp, deepspeed, pipeline) [ddp]" in res.stderr
    assert "pippy is written pipeline in trainkit" in res.stderr
    text = (tmp_path / "r.yaml").read_text()
    assert "model: {name: \"torchvision.resnet50\", args: {num_classes: 3}}" in text
    assert "name: imagefolder" in text and "name: pipeline" in text and "precision: bf16" in text
    assert "tracking: {enabled: false}" in text


# --------------------------------------------------------------------------- completion
BASH_DRIVER = r"""
trainkit() { "$PYTHON" -m trainkit.cli "$@"; }
eval "$(trainkit completion bash)"
complete -p trainkit
comp() {  # what bash does on TAB: COMP_* set, words split at COMP_WORDBREAKS
    COMP_LINE="$1"; COMP_POINT=${#COMP_LINE}
    local line="${COMP_LINE//=/ = }"; read -ra COMP_WORDS <<< "$line"
    [[ $COMP_LINE == *[\ =] ]] && COMP_WORDS+=("")
    COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    _trainkit_complete trainkit "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
    echo "$1|$(IFS=,; echo "${COMPREPLY[*]}")"
}
comp "trainkit va"
comp "trainkit validate rec"
comp "trainkit validate recipes/dd"
comp "trainkit plan recipes/ddp-mlp.yaml trainer.ch"
comp "trainkit plan recipes/ddp-mlp.yaml trainer.checkpoint."
comp "trainkit run recipes/ddp-mlp.yaml strategy.name="
comp "trainkit run recipes/ddp-mlp.yaml precision=b"
comp "trainkit run recipes/ddp-mlp.yaml ~trainer.eval_e"
comp "trainkit run recipes/ddp-mlp.yaml data.name="
comp "trainkit validate --format "
comp "trainkit completion "
comp "trainkit run --acc"
"""


def test_bash_completion_completes_commands_paths_and_schema_keys():
    env = {**os.environ, "PYTHON": sys.executable}
    res = subprocess.run(["bash", "-c", BASH_DRIVER], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    got = dict(line.split("|", 1) for line in res.stdout.splitlines()[1:])
    assert res.stdout.splitlines()[0] == "complete -F _trainkit_complete trainkit"
    assert got["trainkit va"] == "validate"
    assert got["trainkit validate rec"] == "recipes/"
    assert got["trainkit validate recipes/dd"] == "recipes/ddp-mlp.yaml"
    assert got["trainkit plan recipes/ddp-mlp.yaml trainer.ch"] == "trainer.checkpoint."
    assert got["trainkit plan recipes/ddp-mlp.yaml trainer.checkpoint."] == \
        "trainer.checkpoint.async_save=,trainer.checkpoint.every=,trainer.checkpoint.keep="
    assert got["trainkit run recipes/ddp-mlp.yaml strategy.name="] == "ddp,deepspeed,fsdp,pipeline"  # after '='
    assert got["trainkit run recipes/ddp-mlp.yaml precision=b"] == "bf16"
    assert got["trainkit run recipes/ddp-mlp.yaml ~trainer.eval_e"] == "~trainer.eval_every"
    assert got["trainkit validate --format "] == "text,json,github"
    assert got["trainkit completion "] == "bash,zsh,fish"
    assert got["trainkit run --acc"] == "--accept-changes"
    try:  # an installed plugin's names and keys complete too
        import trainkit_example_plugin  # noqa: F401
    except ImportError:
        return
    assert "blobs" in got["trainkit run recipes/ddp-mlp.yaml data.name="].split(",")


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_scripts_are_valid_and_complete_keys(shell, tmp_path):
    assert shutil.which(shell), f"{shell} is required (.ci/run installs it)"
    script = cli("completion", shell).stdout
    path = tmp_path / f"trainkit.{shell}"
    path.write_text(script)
    check = subprocess.run([shell, "-n", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    if shell == "fish":  # fish can run its completion for a line directly
        fn = f"function trainkit; {sys.executable} -m trainkit.cli $argv; end; source {path}; "
        res = subprocess.run(["fish", "-c", fn + "complete -C 'trainkit plan recipes/ddp-mlp.yaml precision='"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert sorted(res.stdout.split()) == ["precision=bf16", "precision=fp16", "precision=fp32"], res.stderr


def test_completion_does_not_import_torch_or_mlflow():
    code = ("import os, sys; from trainkit.cli import main\n"
            "os.environ['TRAINKIT_COMP_LINE'] = 'trainkit run recipes/ddp-mlp.yaml strategy.'\n"
            "main(['__complete']); main(['completion', 'bash'])\n"
            "print('HEAVY', [m for m in ('torch', 'deepspeed', 'mlflow') if m in sys.modules])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert "strategy.zero_stage=" in res.stdout and "HEAVY []" in res.stdout, res.stdout + res.stderr
