"""Bring your own model (issue 39): a pretrained Hugging Face directory (save_pretrained's layout,
bf16 safetensors) fine-tuned with PEFT LoRA under FSDP and DDP on 2 ranks, and the adapter handed back
in PEFT's format.

What a user relies on, measured on the files the run leaves:
- every frozen base weight after training equals the pretrained checkpoint's (read into each rank's
  FSDP shard by DCP's Hugging Face reader; bf16 -> fp32 exactly), so loading is right and the base stays
  frozen; the adapters moved;
- the adapter directory loads with PEFT on top of `from_pretrained`, and that model's logits equal
  trainkit's trained model's (the exported checkpoint loaded into `hf_causal_lm`);
- the optimizer holds state for the adapters only (the checkpoint's optimizer state is that small).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest
import torch

from chat_fixtures import save_chat_tokenizer, write_chat
from strategy_runs import deepspeed_env
from run_helpers import logged_transformers_pipeline, losses, summary, trainkit, write_recipe

pytestmark = pytest.mark.distributed
pytest.importorskip("peft")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, corpus) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    save_chat_tokenizer(corpus["tokenizer"], folder)  # the directory carries its tokenizer and chat template
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)  # safetensors, as users' checkpoints are
    return str(folder)


def chat_data(tmp, pretrained: str) -> dict:
    """Chat SFT data: the tokenizer and chat template of the pretrained directory itself."""
    return {"name": "chat", "files": [str(write_chat(tmp / "train.jsonl", 32, seed=0))],
            "eval_files": [str(write_chat(tmp / "eval.jsonl", 8, seed=1))], "tokenizer": pretrained, "seq_len": 48,
            "batch_size": 4}


def lora_run(tmp, name: str, data: dict, pretrained: str, strategy: dict, precision: str = "fp32",
             steps: int = 3, tracking: dict = {"enabled": False}, parallel: Optional[dict] = None,  # noqa: B006
             **env: str) -> tuple:
    path = write_recipe(tmp, name, {
        "seed": 0, "task": {"name": "causal_lm"}, "precision": precision,
        "model": {"name": "hf_causal_lm", "args": {"pretrained": pretrained, "lora": LORA}},
        "data": data,
        "strategy": strategy, "optimizer": {"name": "adamw", "lr": 1e-2},
        "trainer": {"max_steps": steps, "log_every": 1, "checkpoint": {"every": 2 if steps > 3 else 3},
                    # the 8 held-out conversations, 4 per replica batch
                    "eval_every": steps, "eval_steps": 2 if parallel and parallel.get("tp", 1) > 1 else 1},
        "launch": {"nproc_per_node": 2, "timeout_s": 180, "max_restarts": 1}, "tracking": tracking,
        **({"parallel": parallel} if parallel else {})})
    result = trainkit(tmp, "run", str(path), **env)
    assert result.returncode == 0, result.output[-4000:]
    return path, tmp / "runs" / name


@pytest.mark.parametrize("strategy,data,precision", [({"name": "fsdp"}, "chat", "fp32"),
                                                     ({"name": "ddp"}, "text", "bf16"),
                                                     ({"name": "deepspeed", "zero_stage": 3}, "chat", "fp32"),
                                                     ({"name": "fsdp", "tp": 2}, "chat", "fp32")],
                         ids=["fsdp-chat-fp32", "ddp-text-bf16-restarted", "zero3-chat-fp32", "tp-chat-fp32"])
def test_lora_on_a_pretrained_checkpoint_trains_the_adapters_and_hands_back_a_peft_adapter(
        request, tmp_path_factory, tmp_path, corpus, pretrained, strategy, data, precision):
    """FSDP: a chat SFT run (the pretrained directory's own chat template; its evaluation counts exactly
    the held-out conversations' assistant tokens, so nothing else is in the loss). DDP: plain text in
    bf16 autocast, and rank 1 dies after step 3: torchrun restarts the ranks, they resume the LoRA run
    from its step-2 checkpoint (not from the pretrained files again) and redo step 3 to the first
    attempt's loss (relative 1e-6). ZeRO-3: the model is built partitioned (zero.Init) and each
    module, gathered once, gets the checkpoint's tensors before DeepSpeed's engine takes its fp32 master
    partitions (a read after set-up would leave the optimizer stepping the random initial weights).
    Tensor parallel 2 (`parallel: {dp_shard: 1, tp: 2}`): the model is built on the meta device, each
    rank allocates its column/row slices and reads only those."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainkit.models.hf import hf_causal_lm
    from trainkit.runtime.export import export

    block = chat_data(tmp_path, pretrained) if data == "chat" else {
        "name": "text", "files": corpus["files"], "eval_files": corpus["eval_files"], "tokenizer": corpus["tokenizer"],
        "seq_len": 32, "batch_size": 4}
    restarted = precision == "bf16"
    steps = 4 if restarted else 3
    # the FSDP run also logs its model to MLflow (tracking.log_model): the merged model in MLflow's transformers
    # flavour (written from the consolidated checkpoint, as `export --hf` is in every case here)
    tp = strategy.get("tp", 1)  # a parallel: block, not a strategy option (the parametrized dict stays as it is)
    strategy = {k: v for k, v in strategy.items() if k != "tp"}
    logs_model = strategy == {"name": "fsdp"} and tp == 1
    tracking = {"enabled": True, "experiment": "lora", "log_model": True} if logs_model else {"enabled": False}
    env = {"TRAINKIT_FAULT_INJECT": "rank=1,step=3"} if restarted else {}
    if strategy["name"] == "deepspeed":
        env.update(deepspeed_env(request, tmp_path_factory))
    _, run_dir = lora_run(tmp_path, f"lora-{strategy['name']}", block, pretrained, strategy, precision, steps,
                          tracking, parallel={"dp_shard": 1, "tp": tp} if tp > 1 else None, **env)
    assert summary(run_dir)["model_init"] == "pretrained"
    if restarted:  # the redone step 3 equals the first attempt's step 3 (its metrics, kept as rewound)
        assert summary(run_dir)["resumed_from"].endswith("step-00000002"), summary(run_dir)
        steps_logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in steps_logged if "loss" in r] == list(range(1, steps + 1))
        rewound = [json.loads(line) for f in run_dir.glob("metrics.rewound-*.jsonl") for line in f.read_text().splitlines()]
        first_step_3 = [r["loss"] for r in rewound if r.get("step") == 3 and "loss" in r]
        assert first_step_3 and losses(run_dir)[2] == pytest.approx(first_step_3[0], rel=1e-6), (first_step_3, losses(run_dir))
    if data == "chat":
        from types import SimpleNamespace

        from trainkit.runtime.chat_data import IGNORE, build_chat

        held_out = build_chat(SimpleNamespace(**{**block, "files": block["eval_files"], "messages_field": "messages",
                                                 "prompt_field": "prompt", "response_field": "response", "packing": False}),
                              split="train", seed=0)
        responses = sum(int((targets != IGNORE).sum()) for _, targets in held_out)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evaluated = [r for r in rows if "eval_tokens" in r]
        assert evaluated and evaluated[-1]["eval_tokens"] == responses, (evaluated, responses)
    exported = tmp_path / "model.pt"
    export(str(run_dir / "checkpoints" / f"step-{steps:08d}"), str(exported))
    state = torch.load(exported, weights_only=True)
    model = hf_causal_lm(pretrained=pretrained, lora=LORA)
    model.load_state_dict(state)

    original = {k: v.float() for k, v in load_file(f"{pretrained}/model.safetensors").items()}
    trained = {model.pretrained_name(k): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(original) <= set(trained)
    changed = [k for k in original if not torch.equal(original[k], trained[k])]
    assert not changed, f"frozen base weights differ from the pretrained checkpoint: {changed[:5]}"
    lora_b = [v for k, v in model.state_dict().items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b), "the adapters did not train (lora_B still zero)"

    adapter = run_dir / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["r"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32),
                                           str(adapter)).eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = peft_model(input_ids=tokens).logits
    assert torch.allclose(model.eval()(tokens), expected, rtol=1e-5, atol=1e-6)

    # `trainkit export --hf`: one Hugging Face directory, adapters merged, that plain transformers serves
    from safetensors import safe_open

    from trainkit.runtime.export_hf import export_hf

    merged_dir = tmp_path / "merged"
    export_hf(run_dir / "checkpoints" / f"step-{steps:08d}", merged_dir)
    with safe_open(str(merged_dir / "model.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "lora_" in k or "base_layer" in k], list(f.keys())[:10]
    assert {p.name for p in Path(pretrained).iterdir() if p.name.startswith("tokenizer")} <= \
        {p.name for p in merged_dir.iterdir()}
    served = AutoModelForCausalLM.from_pretrained(str(merged_dir), torch_dtype=torch.float32).eval()
    assert torch.allclose(served(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-5)

    if logs_model:  # tracking.log_model: what MLflow's transformers flavour gives back serves the same model
        pipe = logged_transformers_pipeline(tmp_path, "lora")
        assert type(pipe).__name__ == "TextGenerationPipeline"
        assert torch.allclose(pipe.model.float().eval()(input_ids=tokens).logits, expected, rtol=1e-4, atol=1e-5)


def test_export_hf_refuses_a_model_that_is_not_a_hugging_face_one(tmp_path):
    """A checkpoint of the built-in MLP cannot become a Hugging Face directory: refused, naming the
    model and the export that does work, before anything is read or written."""
    from trainkit.run_dir import CHECKPOINT_RECIPE
    from trainkit.runtime.export import ExportError
    from trainkit.runtime.export_hf import export_hf

    folder = tmp_path / "step-00000003"
    folder.mkdir()
    (folder / CHECKPOINT_RECIPE).write_text(json.dumps({"model": {"name": "mlp", "args": {"in_features": 8}}}))
    with pytest.raises(ExportError, match=r"not a Hugging Face model \(model: hf_causal_lm\).*without --hf"):
        export_hf(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_validate_refuses_a_bad_pretrained_directory_with_file_level_messages(tmp_path, pretrained):
    import shutil

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(f"{pretrained}/config.json", pickled / "config.json")
    torch.save({"w": torch.zeros(1)}, pickled / "pytorch_model.bin")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    shutil.copy(f"{pretrained}/model.safetensors", no_config / "model.safetensors")
    for folder, expected in ((pickled, "pickle files"), (no_config, "config.json not found")):
        path = write_recipe(tmp_path, folder.name, {
            "model": {"name": "hf_causal_lm", "args": {"pretrained": str(folder)}}, "task": {"name": "causal_lm"},
            "data": {"name": "text", "files": ["x.txt"], "tokenizer": "t.json", "seq_len": 32, "batch_size": 4},
            "strategy": {"name": "fsdp"}, "optimizer": {"name": "adamw", "lr": 1e-3},
            "trainer": {"max_steps": 1}, "launch": {"nproc_per_node": 2}, "tracking": {"enabled": False}})
        result = trainkit(tmp_path, "validate", str(path))
        assert result.returncode == 2 and expected in result.output and "Traceback" not in result.output, result.output
    pipelined = write_recipe(tmp_path, "pipelined", {
        "model": {"name": "hf_causal_lm", "args": {"pretrained": pretrained}}, "task": {"name": "causal_lm"},
        "data": {"name": "text", "files": ["x.txt"], "tokenizer": "t.json", "seq_len": 32, "batch_size": 4},
        "strategy": {"name": "pipeline"}, "optimizer": {"name": "adamw", "lr": 1e-3},
        "trainer": {"max_steps": 1}, "launch": {"nproc_per_node": 2}, "tracking": {"enabled": False}})
    result = trainkit(tmp_path, "validate", str(pipelined))
    assert result.returncode == 2 and "cannot read pretrained weights" in result.output, result.output
    # a directory that is not on this machine (CI validating recipes/, a laptop) is, as a data path, for
    # `validate --deep`, `plan` and `run` to refuse
    elsewhere = write_recipe(tmp_path, "elsewhere", {
        "model": {"name": "hf_causal_lm", "args": {"pretrained": str(tmp_path / "not-here")}},
        "task": {"name": "causal_lm"}, "data": {"name": "text", "files": ["x.txt"], "tokenizer": "t.json",
                                                "seq_len": 32, "batch_size": 4},
        "strategy": {"name": "fsdp"}, "trainer": {"max_steps": 1}, "launch": {"nproc_per_node": 2},
        "tracking": {"enabled": False}})
    assert trainkit(tmp_path, "validate", str(elsewhere)).returncode == 0
    deep = trainkit(tmp_path, "validate", "--deep", str(elsewhere))
    assert deep.returncode == 2 and f"pretrained directory not found: {tmp_path / 'not-here'}" in deep.output \
        and "model_type" not in deep.output and "Traceback" not in deep.output, deep.output


# ZeRO-2 only: under FSDP the sharded build's read of every checkpoint weight is what the LoRA cases check
# (every base weight equal to the checkpoint's after training; a weight left merely allocated would differ)
@pytest.mark.parametrize("strategy", [{"name": "deepspeed", "zero_stage": 2}], ids=["zero2"])
def test_a_full_fine_tune_starts_from_the_pretrained_weights(request, tmp_path_factory, tmp_path, corpus, pretrained,
                                                             strategy):
    """ZeRO-2's engine takes its own copy of the weights when it is set up and writes it back into the
    model at every step, so the weights are read before set-up; FSDP builds the model on the meta device
    and reads each rank's shards after set-up, every weight of the model from the directory (a weight left
    as allocated would be garbage). One full fine-tuning step at lr 1e-6 must end within 1e-5 of the
    pretrained weights: measured 1.0e-6 (one AdamW step); under ZeRO-2 with the weights read after set-up
    instead, 2.4e-4."""
    from safetensors.torch import load_file

    from trainkit.models.hf import hf_causal_lm
    from trainkit.runtime.export import export

    path = write_recipe(tmp_path, "full-zero2", {
        "seed": 0, "task": {"name": "causal_lm"},
        "model": {"name": "hf_causal_lm", "args": {"pretrained": pretrained}},
        "data": {"name": "text", "files": corpus["files"], "tokenizer": corpus["tokenizer"], "seq_len": 32,
                 "batch_size": 4},
        "strategy": strategy, "optimizer": {"name": "adamw", "lr": 1e-6},
        "trainer": {"max_steps": 1, "log_every": 1, "checkpoint": {"every": 1}},
        "launch": {"nproc_per_node": 2, "timeout_s": 180}, "tracking": {"enabled": False}})
    env = deepspeed_env(request, tmp_path_factory) if strategy["name"] == "deepspeed" else {}
    result = trainkit(tmp_path, "run", str(path), **env)
    assert result.returncode == 0, result.output[-4000:]
    run_dir = tmp_path / "runs" / "full-zero2"
    assert summary(run_dir)["model_init"] == "pretrained"
    export(str(run_dir / "checkpoints" / "step-00000001"), str(tmp_path / "model.pt"))
    model = hf_causal_lm(pretrained=pretrained)
    model.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    trained = {model.pretrained_name(k): v for k, v in model.state_dict().items()}
    original = {k: v.float() for k, v in load_file(f"{pretrained}/model.safetensors").items()}
    far = {k: float((trained[k] - v).abs().max()) for k, v in original.items()
           if not torch.allclose(trained[k], v, rtol=0, atol=1e-5)}
    print("largest distance from the pretrained weights:", max(float((trained[k] - v).abs().max())
                                                              for k, v in original.items()))
    assert not far, f"weights left the pretrained checkpoint's after one step at lr 1e-6: {dict(list(far.items())[:5])}"


def test_packed_chat_data_is_evaluated_exactly_as_one_conversation_per_sequence(tmp_path, pretrained):
    """`data.packing` end to end: the held-out conversations packed into rows (several per sequence) and
    evaluated under FSDP on 2 ranks give the loss the same conversations give one per sequence in one
    process, token for token: the model is the pretrained checkpoint in both (SGD at lr 1e-30), so any
    conversation that attended to its neighbour in a row would move the packed loss. (The reference runs
    in the launcher's own process: the evaluation covers every held-out conversation whatever the ranks.)"""
    def run(name: str, strategy: str, packing: bool, ranks: int) -> dict:
        data = {"name": "chat", "files": [str(short)], "eval_files": [str(short)], "tokenizer": pretrained,
                "seq_len": 64, "batch_size": 2, "packing": packing}
        path = write_recipe(tmp_path, name, {
            "seed": 0, "task": {"name": "causal_lm"},
            "model": {"name": "hf_causal_lm", "args": {"pretrained": pretrained}}, "data": data,
            "strategy": {"name": strategy}, "optimizer": {"name": "sgd", "lr": 1e-30},  # moves no fp32 weight
            "trainer": {"max_steps": 1, "log_every": 1, "checkpoint": {"every": 1}, "eval_every": 1,
                        "eval_steps": 50},
            "launch": {"nproc_per_node": ranks, "timeout_s": 180}, "tracking": {"enabled": False}})
        result = trainkit(tmp_path, "run", str(path))
        assert result.returncode == 0, result.output[-4000:]
        rows = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        sequences = int(re.search(r"data ready: (\d+) training samples", result.stdout).group(1))
        return {**[r for r in rows if "eval_tokens" in r][-1], "sequences": sequences}

    words = ["alpha", "beta", "gamma", "delta", "omega", "tensor"]
    short = tmp_path / "short.jsonl"  # ~15 tokens a conversation: three or four to a row of 64
    short.write_text("".join(json.dumps({"prompt": f"{words[i % 6]} {words[(i * 5) % 6]}", "response": words[(i * 7) % 6]})
                             + "\n" for i in range(12)))
    packed, padded = run("packed", "fsdp", True, ranks=2), run("padded", "ddp", False, ranks=1)
    assert packed["eval_tokens"] == padded["eval_tokens"] > 0
    assert padded["sequences"] == 12 and packed["sequences"] <= 4, (packed, padded)  # the run did pack
    assert packed["eval_loss"] == pytest.approx(padded["eval_loss"], rel=1e-5), (packed, padded)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_qlora_trains_adapters_on_a_4bit_base_resumes_exactly_and_exports(tmp_path, corpus, pretrained, strategy):
    """QLoRA (`lora.quantize_base: nf4`) under DDP and FSDP on 2 ranks, bf16: the adapted layers' frozen base
    weights are read from the pretrained directory, then held as torchao NF4 tensors (4 bits and their block
    scales) before the strategy wraps the model: DDP neither broadcasts nor reduces them; FSDP2 shards them as
    NF4 (each rank its rows) and all-gathers them per block. Rank 1 dies after step 3; the
    restart resumes from the step-2 checkpoint (the NF4 base in it) and redoes step 3 to the same loss. The
    effect, measured on the checkpoint: each quantized weight holds under a fifth of its fp32 bytes. The
    adapter loads with PEFT, and `export --hf` merges the adapters into the dequantized base: plain
    transformers serves the trained model (logits equal trainkit's)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainkit.models.hf import hf_causal_lm
    from trainkit.runtime.export import export
    from trainkit.runtime.export_hf import export_hf

    qlora = {**LORA, "quantize_base": "nf4"}
    block = {"name": "text", "files": corpus["files"], "tokenizer": corpus["tokenizer"], "seq_len": 32, "batch_size": 4}
    path = write_recipe(tmp_path, "qlora", {
        "seed": 0, "task": {"name": "causal_lm"}, "precision": "bf16",
        "model": {"name": "hf_causal_lm", "args": {"pretrained": pretrained, "lora": qlora}},
        "data": block, "strategy": {"name": strategy}, "optimizer": {"name": "adamw", "lr": 1e-2},
        # FSDP saves in the background: the flattened 4-bit weights go through DCP's async write too
        "trainer": {"max_steps": 4, "log_every": 1, "checkpoint": {"every": 2, "async_save": strategy == "fsdp"}},
        "launch": {"nproc_per_node": 2, "timeout_s": 180, "max_restarts": 1}, "tracking": {"enabled": False}})
    # under async_save the crash waits for the step-2 write: one in flight is lost with the rank (as it should be)
    result = trainkit(tmp_path, "run", str(path), TRAINKIT_FAULT_INJECT="rank=1,step=3,saved=wait")
    assert result.returncode == 0, result.output[-4000:]
    assert "base quantized: 4 adapted Linear weights held in 4 bits (nf4, torchao)" in result.output, result.output
    run_dir = tmp_path / "runs" / "qlora"
    assert summary(run_dir)["resumed_from"].endswith("step-00000002"), summary(run_dir)
    rewound = [json.loads(line) for f in run_dir.glob("metrics.rewound-*.jsonl") for line in f.read_text().splitlines()]
    first_step_3 = [r["loss"] for r in rewound if r.get("step") == 3 and "loss" in r]
    assert first_step_3 and losses(run_dir)[2] == pytest.approx(first_step_3[0], rel=1e-6), (first_step_3, losses(run_dir))

    final = run_dir / "checkpoints" / "step-00000004"
    if strategy == "fsdp":  # each rank wrote its own rows of each 4-bit weight: sharded, not gathered to save
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(str(final)).read_metadata().state_dict_metadata
        data = {k: v for k, v in stored.items() if k.endswith("/nf4.quantized_data")}
        assert len(data) == 4 and all(len(v.chunks) == 2 for v in data.values()), {k: v.chunks for k, v in data.items()}
    exported = tmp_path / "model.pt"
    export(str(final), str(exported))  # FSDP: the shards of each NF4 weight merged back into one
    state = torch.load(exported, weights_only=False)
    quantized = {k: v for k, v in state.items() if type(v).__name__ == "NF4Tensor"}
    assert len(quantized) == 4 and all("base_layer" in k and ("q_proj" in k or "v_proj" in k) for k in quantized), \
        sorted(quantized)
    for name, weight in quantized.items():
        held = sum(getattr(weight, inner).nbytes for inner in weight.__tensor_flatten__()[0])
        assert held < 4 * weight.numel() / 5, (name, held, weight.numel())

    trained = hf_causal_lm(pretrained=pretrained, lora=qlora)
    assert trained.quantize_frozen_base() == 4
    trained.load_state_dict(state)
    lora_b = [v for k, v in trained.state_dict().items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b), "the adapters did not train (lora_B still zero)"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pretrained, torch_dtype=torch.float32),
                              str(run_dir / "adapter"))  # PEFT's format, onto the unquantized base

    merged_dir = tmp_path / "merged"
    export_hf(final, merged_dir)
    served = AutoModelForCausalLM.from_pretrained(str(merged_dir), torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(served(input_ids=tokens).logits, trained.eval()(tokens), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy, parallel, refused, fix", [
    ({"name": "ddp", "init": "seeded"}, None, "quantize_base: nf4 builds the model whole", "leave init at auto"),
    ({"name": "fsdp", "cpu_offload": True}, None, "quantize_base: nf4 with strategy fsdp is refused",
     "set cpu_offload: false"),
    ({"name": "fsdp"}, {"dp_replicate": 2, "dp_shard": 1}, "quantize_base: nf4 with HSDP", "set parallel.dp_replicate: 1"),
    ({"name": "deepspeed", "zero_stage": 3}, None, "quantize_base: nf4 with strategy deepspeed is refused",
     "use strategy ddp"),
    ({"name": "ddp"}, {"tp": 2}, "quantize_base: nf4 with tensor parallel is refused", "set parallel.tp: 1")])
def test_validate_refuses_qlora_where_the_4bit_base_cannot_be_held(tmp_path, pretrained, strategy, parallel, refused,
                                                                     fix):
    """A 4-bit base is trained where each rank keeps its whole model as built (DDP, one process) or FSDP2
    shards it as NF4 over one dimension; it is quantized from the whole weights, so never built seeded.
    Elsewhere validate names the combination and what to use, before anything starts."""
    from trainkit.recipe import resolve
    from trainkit.recipe.problems import RecipeError

    strategy = dict(strategy)
    init = strategy.pop("init", "auto")
    path = write_recipe(tmp_path, "qlora-refused", {
        "task": {"name": "causal_lm"}, "strategy": strategy, **({"parallel": parallel} if parallel else {}),
        "model": {"name": "hf_causal_lm", "init": init,
                  "args": {"pretrained": pretrained, "lora": {**LORA, "quantize_base": "nf4"}}},
        "data": {"name": "text", "files": ["t.txt"], "tokenizer": pretrained, "seq_len": 32, "batch_size": 4},
        "trainer": {"max_steps": 2}, "launch": {"nproc_per_node": 2}})
    with pytest.raises(RecipeError) as caught:
        resolve(path)
    message = str(caught.value)
    assert refused in message and fix in message, message


def test_the_lora_sft_demo_learns_its_capitals_from_a_fresh_checkout(tmp_path):
    """recipes/lora-sft-demo-cpu.yaml as shipped, in an empty folder after `trainkit data make-chat-demo
    data/sft-demo` (a stand-in model directory with its chat tokenizer, and conversations asking the
    capitals of 24 made-up countries): LoRA on a frozen random-weight Llama, DDP on 2 ranks, packed chat
    data. At the end every response token of the held-out conversations is predicted (eval accuracy 1;
    the punctuation and end tokens alone give about two thirds: measured 0.66 after 50 steps), and the
    adapter directory is PEFT's. Measured: 19 s for the whole run on this machine."""
    import shutil

    (tmp_path / "recipes").mkdir()
    shutil.copy(Path(__file__).resolve().parent.parent / "recipes" / "lora-sft-demo-cpu.yaml", tmp_path / "recipes")
    made = trainkit(tmp_path, "data", "make-chat-demo", "data/sft-demo")
    assert made.returncode == 0, made.output
    result = trainkit(tmp_path, "run", "recipes/lora-sft-demo-cpu.yaml", "tracking.enabled=false", timeout=300)
    assert result.returncode == 0, result.output[-6000:]
    run_dir = tmp_path / "runs" / "lora-sft-demo-cpu"
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "eval_accuracy" in line]
    assert evals and evals[-1]["step"] == 100 and evals[-1]["eval_accuracy"] >= 0.99, evals
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
