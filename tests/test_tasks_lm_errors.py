"""Bad text / language-model recipes are refused before launch with file:line:col and exit 2, and
the LM recipes in recipes/ validate and plan."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from lm_runs import make_corpus, tiny_lm
from run_helpers import trainkit, write_recipe

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    return make_corpus(tmp_path_factory.mktemp("corpus"), documents=200)


def refused(tmp: Path, path: Path, *args: str) -> str:
    result = trainkit(tmp, "validate", *args, str(path), timeout=120)
    assert result.returncode == 2, result.output
    return result.output


def line_of(path: Path, key: str) -> str:
    """`file:line:` of the first line that starts with `key` (after indentation)."""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip().startswith(key):
            return f"{path}:{i}:"
    raise AssertionError(key)


def test_a_missing_tokenizer_file_is_refused(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm({**corpus, "tokenizer": str(tmp_path / "nope.json")}))
    out = refused(tmp_path, path, "--deep")
    assert line_of(path, "tokenizer:") in out and "tokenizer file not found" in out and "train-tokenizer" in out


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus),
                        model={"name": "transformer",
                               "args": {"vocab_size": 200, "dim": 32, "layers": 1, "heads": 2, "seq_len": 32}})
    out = refused(tmp_path, path, "--deep")
    assert line_of(path, "tokenizer:") in out and "the model's vocabulary has 200" in out


def test_seq_len_longer_than_the_model_maximum_is_refused(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus), data={"seq_len": 64})
    out = refused(tmp_path, path)
    assert line_of(path, "seq_len: 64") in out and "longer than the model's maximum 32" in out


def test_a_jsonl_record_without_the_text_field_is_refused(tmp_path, corpus):
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"text": "a b c"}) + "\n" + json.dumps({"body": "d e f"}) + "\n")
    path = write_recipe(tmp_path, "bad", tiny_lm({**corpus, "files": [str(data)], "eval_files": []}))
    out = refused(tmp_path, path, "--deep")
    assert f"{data}:2: the record has no field 'text'" in out and "data.text_field" in out


def test_classification_on_text_is_refused(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus), task={"name": "classification"})
    out = refused(tmp_path, path)
    assert line_of(path, "name: text") in out and "task: {name: causal_lm}" in out


def test_an_unknown_hugging_face_model_type_suggests_the_right_one(tmp_path, corpus):
    pytest.importorskip("transformers")
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus),
                        model={"name": "hf_causal_lm",
                               "args": {"config": {"model_type": "lama", "vocab_size": 320, "hidden_size": 32}}})
    out = refused(tmp_path, path, "--deep")
    assert line_of(path, "model_type: lama") in out and "did you mean 'llama'" in out


def test_a_hugging_face_model_cannot_be_pipelined(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus), data={"batch_size": 8},
                        model={"name": "hf_causal_lm", "args": {"config": {"model_type": "llama"}}},
                        strategy={"name": "pipeline", "microbatches": 2})
    out = refused(tmp_path, path)
    assert "cannot be pipelined" in out and re.search(r"bad\.yaml:\d+:\d+: strategy\.name", out)


def test_an_unknown_task_is_refused(tmp_path, corpus):
    path = write_recipe(tmp_path, "bad", tiny_lm(corpus), task={"name": "causal_llm"})
    out = refused(tmp_path, path)
    assert line_of(path, "name: causal_llm") in out or "causal_llm" in out


def test_the_llama_1b_recipe_validates_and_plans(tmp_path):
    """The real multi-GPU recipe, planned here with stand-in data files and tokenizer."""
    (tmp_path / "data" / "corpus").mkdir(parents=True)
    for split in ("train", "eval"):
        (tmp_path / "data" / "corpus" / f"{split}.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    from trainkit.runtime.text_data import train_tokenizer

    train_tokenizer([str(tmp_path / "data" / "corpus" / "train.jsonl")], tmp_path / "data" / "tokenizer.json",
                    vocab_size=300)
    shutil.copy(REPO / "recipes" / "llama-1b-fsdp.yaml", tmp_path)
    result = trainkit(tmp_path, "plan", "llama-1b-fsdp.yaml", timeout=180)
    assert result.returncode == 0, result.output
    assert "nproc_per_node" in result.output or "torchrun" in result.output
    recipe = yaml.safe_load((REPO / "recipes" / "llama-1b-fsdp.yaml").read_text())
    assert recipe["strategy"]["wrap"] == ["TransformerBlock"] and recipe["task"]["name"] == "causal_lm"
