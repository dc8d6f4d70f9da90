"""task: causal_lm on the built-in transformer through `trainkit run` (2 gloo processes): the same
trajectory on 1 and 2 ranks, exact resume (data position included), eval perplexity equal to one
process's computation on the same tokens, the FLOPs estimate against FlopCounterMode, the
tokenizer CLI, and the recipe errors for text and language models.

Tolerance: see lm_runs (strategy_runs.RTOL, fp32 summation order only); resume is bit for bit.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from lm_runs import STEPS, TINY, tiny_lm
from run_helpers import logged_transformers_pipeline, losses, summary, trainkit, write_recipe
from strategy_runs import RTOL, run

REPO = Path(__file__).resolve().parent.parent



@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, corpus):
    tmp = tmp_path_factory.mktemp("ddp")
    path = write_recipe(tmp, "ddp", tiny_lm(corpus), trainer={"eval_every": 4, "eval_steps": 100})
    return tmp, path, run(tmp, path)


# ----------------------------------------------------------------------------- training
@pytest.mark.distributed
def test_two_ranks_follow_the_one_rank_trajectory(one_rank, ddp_run):
    _, _, run_dir = ddp_run
    assert losses(run_dir) == pytest.approx(one_rank, rel=RTOL)
    assert summary(run_dir)["replicas_identical"]


@pytest.mark.distributed
def test_log_steps_report_perplexity_and_tokens_per_second(ddp_run):
    _, _, run_dir = ddp_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"])) for r in rows)
    assert rows[-1]["tokens_per_s"] == pytest.approx(rows[-1]["samples_per_s"] * 32)
    assert {"eval_loss", "eval_perplexity", "eval_accuracy", "eval_tokens"} <= set(rows[3])


@pytest.mark.distributed
def test_eval_perplexity_equals_one_process_on_the_same_tokens(ddp_run, corpus):
    """The final checkpoint's model over every held-out block, in this process, in float64 sums."""
    from trainkit.models.transformer import transformer
    from trainkit.recipe import resolve
    from trainkit.runtime.text_data import build_text

    _, path, run_dir = ddp_run
    model = transformer(**TINY["args"])
    model.load_state_dict(torch.load(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.pt", weights_only=True))
    data = build_text(resolve(path).recipe.data, split="eval", seed=0)
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(len(data)):
            x, y = data[i]
            nll += torch.nn.functional.cross_entropy(model(x[None])[0], y, reduction="sum").double().item()
            tokens += y.numel()
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert logged["eval_tokens"] == tokens
    assert logged["eval_perplexity"] == pytest.approx(math.exp(nll / tokens), rel=1e-6)


@pytest.mark.distributed
def test_resume_repeats_the_uninterrupted_run_exactly(ddp_run):
    """Drop the last checkpoint and relaunch: steps 5..8 (data position, RNG, optimizer) bit for bit."""
    tmp, path, run_dir = ddp_run
    uninterrupted = losses(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step-{STEPS:08d}")
    result = trainkit(tmp, "run", str(path))
    assert result.returncode == 0, result.output[-6000:]
    assert Path(summary(run_dir)["resumed_from"]).name == "step-00000004"
    assert losses(run_dir) == uninterrupted  # exactly


@pytest.mark.distributed
def test_lm_demo_recipe_halves_its_loss_from_a_fresh_checkout(tmp_path):
    """recipes/lm-demo-cpu.yaml from an empty folder: the corpus and tokenizer are written on first
    use (data/lm-demo/), then the last logged loss is at most 0.8x the first."""
    (tmp_path / "recipes").mkdir()
    shutil.copy(REPO / "recipes" / "lm-demo-cpu.yaml", tmp_path / "recipes")
    result = trainkit(tmp_path, "run", "recipes/lm-demo-cpu.yaml", "tracking.enabled=false", "trainer.max_steps=40",
                      "trainer.eval_every=40", "trainer.checkpoint.every=40", timeout=300)
    assert result.returncode == 0, result.output[-6000:]
    assert (tmp_path / "data" / "lm-demo" / "tokenizer.json").is_file()
    out = losses(tmp_path / "runs" / "lm-demo-cpu")
    assert out[-1] <= 0.8 * out[0], out


# ----------------------------------------------------------------------------- FLOPs
def _counted(model: torch.nn.Module, batch: int, seq_len: int, vocab: int) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randint(0, vocab, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).float().sum().backward()
    return float(counter.get_total_flops())


def _estimate(tmp: Path, corpus: dict, model: dict, batch: int) -> float:
    from trainkit.runtime.components import build_task
    from trainkit.recipe import resolve

    recipe = resolve(write_recipe(tmp, "flops", tiny_lm(corpus), model=model, data={"batch_size": batch})).recipe
    task = build_task(recipe, torch.device("cpu"))
    return task.flops_per_microbatch()


def test_causal_lm_flops_estimate_is_within_10_percent_of_counted(tmp_path, corpus):
    from trainkit.models.transformer import transformer

    model = {"name": "transformer", "args": {"vocab_size": VOCAB_FLOPS, "dim": 64, "layers": 3, "heads": 4, "seq_len": 32}}
    counted = _counted(transformer(**model["args"]), 2, 32, VOCAB_FLOPS)
    assert _estimate(tmp_path, corpus, model, 2) == pytest.approx(counted, rel=0.10)


def test_hf_causal_lm_flops_estimate_is_within_10_percent_of_counted(tmp_path, corpus):
    pytest.importorskip("transformers")
    from trainkit.models.hf import hf_causal_lm

    config = {"model_type": "llama", "vocab_size": VOCAB_FLOPS, "hidden_size": 64, "intermediate_size": 172,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64}
    counted = _counted(hf_causal_lm(config=config), 2, 32, VOCAB_FLOPS)
    model = {"name": "hf_causal_lm", "args": {"config": config}, "init": "auto"}
    assert _estimate(tmp_path, corpus, model, 2) == pytest.approx(counted, rel=0.10)


VOCAB_FLOPS = 320


# ----------------------------------------------------------------------------- tokenizer CLI
@pytest.mark.slow
def test_a_tokenizer_trained_by_the_cli_round_trips_the_corpus(tmp_path):
    from trainkit.runtime.text_data import load_tokenizer

    made = trainkit(tmp_path, "data", "make-corpus", "corpus", "--documents", "300", timeout=120)
    assert made.returncode == 0, made.output
    result = trainkit(tmp_path, "data", "train-tokenizer", "corpus/train.txt", "--out", "tok.json",
                      "--vocab-size", "400", timeout=120)
    assert result.returncode == 0, result.output
    tok = load_tokenizer(str(tmp_path / "tok.json"))
    assert 257 < tok.get_vocab_size() <= 400
    for line in (tmp_path / "corpus" / "eval.txt").read_text().splitlines():
        ids = tok.encode(line).ids
        assert tok.decode(ids) == line
        assert len(ids) < len(line.encode())  # merges were learned: fewer tokens than bytes


def test_the_synthetic_corpus_is_deterministic(tmp_path):
    from trainkit.runtime.text_data import synthetic_corpus

    assert synthetic_corpus(50, 4) == synthetic_corpus(50, 4)
    assert synthetic_corpus(50, 4) != synthetic_corpus(50, 4, stream=1)


# ----------------------------------------------------------------------------- Hugging Face models
@pytest.mark.distributed
def test_a_hugging_face_model_from_a_recipe_config_trains_under_fsdp(tmp_path, corpus):
    """AutoModelForCausalLM.from_config (no download), each LlamaDecoderLayer an FSDP unit; with
    `tracking.log_model` the model lands in MLflow's transformers flavour with the recipe's tokenizer
    file (a model built from a config has no tokenizer files of its own)."""
    pytest.importorskip("transformers")
    config = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}
    path = write_recipe(tmp_path, "hf", tiny_lm(corpus),
                        model={"name": "hf_causal_lm", "args": {"config": config}, "init": "auto"},
                        strategy={"name": "fsdp", "wrap": ["LlamaDecoderLayer"]}, trainer={"max_steps": 4},
                        tracking={"enabled": True, "experiment": "hf", "log_model": True})
    run_dir = run(tmp_path, path)
    out = losses(run_dir)
    assert len(out) == 4 and out[-1] < out[0]
    assert summary(run_dir)["replicas_identical"]

    pipe = logged_transformers_pipeline(tmp_path, "hf")
    assert type(pipe).__name__ == "TextGenerationPipeline" and pipe.tokenizer is not None
    assert pipe.tokenizer("a b")["input_ids"]  # the recipe's tokenizer, not an empty stand-in
