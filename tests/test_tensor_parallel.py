"""Tensor parallel (issue 30): the built-in transformer, a Hugging Face Llama and the example model of
docs/plugins.md split over 2 gloo ranks by `apply_tensor_parallel`, with the plans the models declare,
train as one process does: the loss, every gradient and every weight of 3 AdamW steps within fp32
relative 1e-5, with and without loss parallel.

All six configurations run in one 2-process torchrun launch (tensor_parallel_runs.py), shared by the
tests here, with the refusals of HF models that cannot be split (transformers is slow to import).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from run_helpers import env_for
from tensor_parallel_runs import docs_example
from trainkit.models import mlp
from trainkit.strategies.tensor_parallel import apply_tensor_parallel

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)


RUNS = Path(__file__).parent / "tensor_parallel_runs.py"
LAUNCH_TIMEOUT_S = 180
TOLERANCE = 1e-5  # fp32, relative (|a - b| / |b| per tensor); measured: losses <= 1.2e-7, gradients and weights <= 4.1e-6
CONFIGS = [f"{model} loss_parallel={lp}" for model in ("transformer", "hf_llama", "docs_example") for lp in (False, True)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    out = tmp / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(RUNS), str(out)]
    proc = subprocess.Popen(command, cwd=tmp, env=env_for(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        raise AssertionError(f"the tensor-parallel launch did not finish in {LAUNCH_TIMEOUT_S}s\n{log[-6000:]}")
    assert proc.returncode == 0 and out.exists(), log[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("config", CONFIGS)
def test_two_tensor_parallel_ranks_train_as_one_process(results, config):
    run = results[config]
    for what in ("loss", "grad", "weight"):
        assert len(run[what]) == 3 and max(run[what]) <= TOLERANCE, f"{config}: relative {what} differences {run[what]}"


def test_the_transformer_is_split_as_torchtitan_splits_llama(results):
    split = results["transformer loss_parallel=False"]["placements"]
    for block in ("layers.0", "layers.1"):
        for colwise in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            assert split[f"{block}.{colwise}.weight"] == "S(0)"
        for rowwise in ("attention.wo", "feed_forward.w2"):
            assert split[f"{block}.{rowwise}.weight"] == "S(1)"
        for norm in ("attention_norm", "ffn_norm"):  # sequence parallel: replicated weight, sharded activations
            assert split[f"{block}.{norm}.weight"] == "R"
    assert split["tok_embeddings.weight"] == split["output.weight"] == "S(0)"  # on the vocabulary
    assert split["norm.weight"] == "R"


def test_the_hf_llama_is_split_by_transformers_own_plan(results):
    split = results["hf_llama loss_parallel=False"]["placements"]
    layer = "model.model.layers.0"
    for colwise in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert split[f"{layer}.{colwise}.weight"] == "S(0)"
    for rowwise in ("self_attn.o_proj", "mlp.down_proj"):
        assert split[f"{layer}.{rowwise}.weight"] == "S(1)"
    assert split["model.model.embed_tokens.weight"] == split["model.lm_head.weight"] == "S(0)"
    assert split["model.model.norm.weight"] == "plain"  # transformers' llama plan leaves the norms whole


@pytest.mark.parametrize("model", ["transformer", "hf_llama"])
def test_loss_parallel_keeps_the_logits_sharded_on_the_vocabulary(results, model):
    assert results[f"{model} loss_parallel=True"]["logits"] == "S(2)"  # [batch, seq, vocab / tp] on each rank
    assert results[f"{model} loss_parallel=False"]["logits"] == "plain"


def test_the_transformer_refuses_a_sequence_tp_does_not_divide(results):
    assert results["uneven sequence"] == ("a sequence of 15 tokens does not split over tp 2 ranks: the transformer's "
                                          "tensor-parallel plan shards the sequence between its blocks (sequence "
                                          "parallel); make data.seq_len a multiple of 2")


def test_the_docs_example_model_is_split_as_its_plan_says(results):
    split = results["docs_example loss_parallel=False"]["placements"]
    assert (split["up.weight"], split["up.bias"], split["head.weight"], split["head.bias"]) == ("S(0)", "S(0)", "S(1)", "R")
    assert results["docs_example loss_parallel=True"]["logits"] == "plain"  # it ignores loss_parallel: whole logits


def test_the_docs_example_facts_refuse_a_width_tp_does_not_divide():
    facts = docs_example("# trainkit_tp_mlp/facts.py")["TwoLayerMLPFacts"]()
    assert facts.tensor_parallel_refusal(8, {"hidden": 60}) == ("model.args.hidden 60 is not divisible by tp 8; "
                                                                "make it a multiple of 8")
    assert facts.tensor_parallel_refusal(2, {"hidden": 60}) is None


def test_a_model_without_a_plan_is_refused_by_its_class_name():
    with pytest.raises(RuntimeError, match=r"torch\.nn\.modules\.container\.Sequential declares no tensor-parallel "
                                           r"plan: .* tensor_parallel_plan\(self, \*, loss_parallel=False\)"):
        apply_tensor_parallel(mlp(), None, loss_parallel=False)


@pytest.mark.parametrize(("config", "refusal"), [
    ("no plan (gpt2)", r"^transformers declares no tensor-parallel plan for GPT2LMHeadModel .*use parallel.tp: 1"),
    ("untranslated style (qwen3)", r"shards model\.layers\.\*\.self_attn\.q_norm as 'replicated_with_grad_allreduce', "
                                   r"which trainkit does not translate"),
    ("tied embeddings (llama)", r"^LlamaForCausalLM ties its input and output embeddings"),
])
def test_an_hf_model_without_a_translatable_plan_is_refused(results, config, refusal):
    assert re.search(refusal, results["hf refusals"][config]), results["hf refusals"][config]
