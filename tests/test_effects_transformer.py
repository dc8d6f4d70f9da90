"""The model families get the effect users pick FSDP and activation checkpointing for (issue 37): the
built-in transformer, a Hugging Face Llama and a ResNet with BatchNorm. The built-in transformer:
its blocks are the `TransformerBlock`s, so FSDP gathers one block at a time and checkpointing recomputes
each block -- not the whole stack as one unit, which saved nothing and no equality test noticed.

Measured as tests/test_sharded_memory.py does: each worker's resident high-water mark over its whole
life (build, steps, a checkpoint, the end-of-run checks) above its baseline before the model
(tests/fault_injection.py TRAINKIT_FAULT_PROBE_MEMORY), 2 CPU ranks, fp32, AdamW.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from run_helpers import planned_per_rank, planned_saving_against_ddp, trainkit, write_recipe

from trainkit.recipe.compatibility.effects import record_effect

pytestmark = pytest.mark.distributed

MiB = 2**20


def transformer_recipe(tmp, name: str, corpus: dict, *, model: dict, data: dict, family: str = "transformer",
                       **sections):
    preset = {
        "seed": 0, "task": {"name": "causal_lm"},
        "model": {"name": family, "args": model, "init": "auto" if family == "transformer" else "constructor"},
        "data": {"name": "text", "files": corpus["files"], "tokenizer": corpus["tokenizer"], **data},
        "strategy": {"name": "ddp"},
        "optimizer": {"name": "adamw", "lr": 1e-4},
        "trainer": {"max_steps": 3, "log_every": 1, "checkpoint": {"every": 3}},
        "launch": {"nproc_per_node": 2, "timeout_s": 180},
        "tracking": {"enabled": False},
    }
    return write_recipe(tmp, name, preset, **sections)


def peaks_above_baseline(tmp, path) -> list[int]:
    probe = tmp / f"memory-{path.stem}"
    probe.mkdir()
    result = trainkit(tmp, "run", str(path), TRAINKIT_FAULT_PROBE_MEMORY=str(probe))
    assert result.returncode == 0, result.output[-4000:]
    records = [json.loads((probe / f"memory-rank{r}.json").read_text()) for r in range(2)]
    return [r["peak"] - r["baseline"] for r in records]


def test_fsdp_gathers_one_transformer_block_at_a_time(tmp_path, corpus):
    """16 blocks of 1.77 M parameters (28 M in the stack, 30 M in all), sharded over 2 ranks, by default
    and with the whole stack as one unit (`wrap: [Sequential]`, what the default was): one unit gathers the
    stack's parameters and holds its unsharded gradients (8 bytes x 28 M = 216 MiB more per rank); the
    default must save at least half of that. Measured: 457 vs 766 MiB above the baseline per rank."""
    model = {"vocab_size": 2048, "dim": 384, "layers": 16, "heads": 6, "seq_len": 64}
    stack = 16 * (4 * 384 * 384 + 3 * 384 * 1024 + 2 * 384)  # TransformerBlock: attention, SwiGLU 1024, norms
    data = {"seq_len": 64, "batch_size": 1}
    per_block = transformer_recipe(tmp_path, "fsdp-blocks", corpus, model=model, data=data, strategy={"name": "fsdp"})
    as_one = transformer_recipe(tmp_path, "fsdp-one-unit", corpus, model=model, data=data,
                                strategy={"name": "fsdp", "wrap": ["Sequential"]})
    blocks, one_unit = peaks_above_baseline(tmp_path, per_block), peaks_above_baseline(tmp_path, as_one)
    print(f"fsdp transformer, above the baseline per rank: blocks {[b // MiB for b in blocks]} MiB, "
          f"the stack as one unit {[b // MiB for b in one_unit]} MiB")
    saved = min(one_unit) - max(blocks)
    record_effect("fsdp/transformer", reference=one_unit, chosen=blocks, holds=saved > 4 * stack,
                  predicted_saving=lambda: planned_per_rank(as_one) - planned_per_rank(per_block),
                  criterion=f"saves > the stack's unsharded gradients and gathered parameters, {4 * stack // MiB} MiB")
    assert saved > 4 * stack, (
        f"FSDP's default units saved {saved // MiB} MiB per rank against one unit for the whole stack; "
        f"gathering one block at a time should save > {4 * stack // MiB} MiB (blocks {blocks}, one unit {one_unit})")


HF_LLAMA = {"config": {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704,
                       "num_hidden_layers": 8, "num_attention_heads": 4, "max_position_embeddings": 512}}


LLAMA_27M = {**HF_LLAMA["config"], "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8}
LLAMA_27M_LAYERS = 8 * (4 * 512 * 512 + 3 * 512 * 1408 + 2 * 512)  # attention, SwiGLU, norms
LLAMA_27M_PARAMS = 2 * 2048 * 512 + LLAMA_27M_LAYERS + 512  # + embedding, head, final norm
SHORT = {"seq_len": 64, "batch_size": 1}  # the model's state dominates: 443 MiB on a DDP rank


@pytest.fixture(scope="module")
def llama_under_ddp(tmp_path_factory, corpus) -> tuple[list[int], Path]:
    """The 27.7 M Llama under DDP, the reference of its sharding effects: each rank's peak above its
    baseline, and the recipe (for the plan's prediction)."""
    tmp = tmp_path_factory.mktemp("llama-ddp")
    path = transformer_recipe(tmp, "hf-ddp", corpus, model={"config": LLAMA_27M}, data=SHORT, family="hf_causal_lm")
    return peaks_above_baseline(tmp, path), path


def test_fsdp_shards_a_hugging_face_models_state_against_ddp(tmp_path, corpus, llama_under_ddp):
    """A transformers Llama of 27.7 M parameters (8 LlamaDecoderLayers, its `_no_split_modules`: FSDP's
    units), 64 tokens x 1 sequence: the model's state dominates (fp32 parameters, gradients, AdamW's two
    moments: 443 MiB on a DDP rank). FSDP on 2 ranks must lower each rank's whole-run peak by at least a
    quarter of that against DDP (each strategy with its own CPU defaults). Measured: see
    docs/compatibility.md, "Effects"."""
    ddp, replicas = llama_under_ddp
    sharded = transformer_recipe(tmp_path, "hf-fsdp", corpus, model={"config": LLAMA_27M}, data=SHORT,
                                 family="hf_causal_lm", strategy={"name": "fsdp"})
    fsdp = peaks_above_baseline(tmp_path, sharded)
    full_state = 16 * LLAMA_27M_PARAMS
    saved = min(ddp) - max(fsdp)
    print(f"hf llama, above the baseline per rank: ddp {[b // MiB for b in ddp]} MiB, fsdp {[b // MiB for b in fsdp]} "
          f"MiB; the whole training state {full_state // MiB} MiB")
    record_effect("fsdp/hf-llama", reference=ddp, chosen=fsdp, holds=saved > full_state / 4,
                  predicted_saving=lambda: planned_per_rank(replicas) - planned_per_rank(sharded),
                  criterion=f"saves > a quarter of the training state, {full_state // 4 // MiB} MiB")
    assert saved > full_state / 4, (
        f"FSDP saved {saved // MiB} MiB per rank against DDP on a {LLAMA_27M_PARAMS:,}-parameter Llama; its training "
        f"state is {full_state // MiB} MiB (ddp {ddp}, fsdp {fsdp})")


def test_tensor_parallel_splits_a_hugging_face_models_layers_against_ddp(tmp_path, corpus, llama_under_ddp):
    """The same Llama split over 2 ranks by tensor parallel (`parallel: {dp_shard: 1, tp: 2}`, the
    model's own tp plan: each decoder layer's projections column- or row-wise; the embedding, the head
    and the norms stay whole): each rank holds half of the layers' 25.7 M parameters, with their
    gradients and AdamW's moments, and no gradient buckets (DDP's hold another copy of the gradients).
    It must save more than the halving frees (16 bytes x 12.8 M = 196 MiB) against DDP; a run that split
    nothing saves nothing. Measured: 806 -> 494 MiB per rank, the plan predicts 318 MiB saved."""
    ddp, replicas = llama_under_ddp
    split = transformer_recipe(tmp_path, "hf-tp", corpus, model={"config": LLAMA_27M}, data=SHORT,
                               family="hf_causal_lm", strategy={"name": "fsdp"}, parallel={"dp_shard": 1, "tp": 2})
    tp = peaks_above_baseline(tmp_path, split)
    halved = 16 * LLAMA_27M_LAYERS // 2
    saved = min(ddp) - max(tp)
    print(f"hf llama, above the baseline per rank: ddp {[b // MiB for b in ddp]} MiB, tp 2 {[b // MiB for b in tp]} "
          f"MiB; halving the layers' training state frees {halved // MiB} MiB")
    record_effect("tp/hf-llama", reference=ddp, chosen=tp, holds=saved > halved,
                  predicted_saving=lambda: planned_per_rank(replicas) - planned_per_rank(split),
                  criterion=f"saves > what halving the layers' training state frees, {halved // MiB} MiB")
    assert saved > halved, (
        f"tensor parallel 2 saved {saved // MiB} MiB per rank against DDP (ddp {ddp}, tp {tp}); halving the decoder "
        f"layers' parameters, gradients and moments frees {halved // MiB} MiB")


@pytest.mark.parametrize("family", ["transformer", "hf_causal_lm"])
def test_activation_checkpointing_frees_the_transformer_blocks_activations(tmp_path, corpus, family):
    """DDP, 8 blocks at 512 tokens x 2 sequences: activations dominate (the plan's trace: the model's
    saved tensors with and without recomputing each block). Checkpointing each block -- the built-in
    TransformerBlock, and a Hugging Face Llama's LlamaDecoderLayer (its `_no_split_modules`) -- must
    lower each rank's whole-run peak by at least half of what the trace says it frees (the stack as one
    block, as before, freed nothing: 1.03x)."""
    from trainkit.recipe import resolve
    from trainkit.runtime.memory_trace import model_sizes

    model = {"vocab_size": 2048, "dim": 256, "layers": 8, "heads": 4, "seq_len": 512} if family == "transformer" \
        else HF_LLAMA
    data = {"seq_len": 512, "batch_size": 2}
    # both return freed host memory at once (`release`): the peak follows what is live, not how each rank's
    # heap fragmented (with the CPU's `retain` one rank's peak rose ~30 MiB above the other's, run to run)
    kept = transformer_recipe(tmp_path, "ddp-keep", corpus, model=model, data=data, family=family,
                              performance={"host_allocator": "release"})
    recomputed = transformer_recipe(tmp_path, "ddp-recompute", corpus, model=model, data=data, family=family,
                                    performance={"host_allocator": "release", "activation_checkpointing": "full"})
    sizes = model_sizes(resolve(recomputed).recipe)
    freed = sizes.activation_bytes - sizes.checkpointed_activation_bytes
    with_all, with_checkpointing = peaks_above_baseline(tmp_path, kept), peaks_above_baseline(tmp_path, recomputed)
    saved = min(with_all) - max(with_checkpointing)
    print(f"ddp {family}, above the baseline per rank: {[b // MiB for b in with_all]} MiB, with checkpointing "
          f"{[b // MiB for b in with_checkpointing]} MiB; the trace frees {freed // MiB} MiB")
    record_effect({"transformer": "activation_checkpointing/transformer",
                   "hf_causal_lm": "activation_checkpointing/hf-llama"}[family], reference=with_all,
                  chosen=with_checkpointing, predicted_saving=freed, holds=saved > freed / 2,
                  criterion="saves > half of what the plan's trace frees")
    assert saved > freed / 2, (
        f"activation checkpointing saved {saved // MiB} MiB per rank; the plan's trace says it frees "
        f"{freed // MiB} MiB (without {with_all}, with {with_checkpointing})")


RESNET_PRESET = {
    "seed": 0, "model": {"name": "torchvision.resnet18", "args": {"num_classes": 10}},
    "data": {"name": "synthetic", "shape": [3, 224, 224], "num_classes": 10, "batch_size": 16, "num_samples": 96},
    "strategy": {"name": "ddp"}, "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
    # freed host memory goes back at once (blocks >= 1 MiB): the peak follows what is live, not how
    # each rank's heap happened to fragment (with `retain` the ranks' peaks differed by ~100 MiB)
    "performance": {"host_allocator": "release"},
    "trainer": {"max_steps": 3, "log_every": 1, "checkpoint": {"every": 3}},
    "launch": {"nproc_per_node": 2, "timeout_s": 180}, "tracking": {"enabled": False}}


@pytest.fixture(scope="module")
def resnet_under_ddp(tmp_path_factory) -> list[int]:
    """ResNet-18 under DDP, the reference of both ResNet effects: each rank's peak above its baseline."""
    tmp = tmp_path_factory.mktemp("resnet-ddp")
    return peaks_above_baseline(tmp, write_recipe(tmp, "resnet-keep", RESNET_PRESET))


def test_activation_checkpointing_frees_a_resnets_activations(tmp_path, resnet_under_ddp):
    """A CNN with BatchNorm: torchvision's ResNet-18 under DDP, 16 images of 224x224 per rank, with and
    without every BasicBlock checkpointed (its repeated blocks; the recomputation leaves BatchNorm's
    running statistics as the forward left them: tests/test_performance.py). The whole-run peak must
    drop by at least half of what the plan's trace says checkpointing frees. Both runs return freed host
    memory at once (`host_allocator: release`): with the CPU's default `retain` the two ranks' peaks
    differed by up to 120 MiB run to run (how each heap fragmented), as much as the effect. Measured:
    553-560 -> 466-467 MiB per rank above the baseline; the trace frees 88 MiB."""
    from trainkit.recipe import resolve
    from trainkit.runtime.memory_trace import model_sizes

    recomputed = write_recipe(tmp_path, "resnet-recompute", RESNET_PRESET,
                              performance={"host_allocator": "release", "activation_checkpointing": "full"})
    sizes = model_sizes(resolve(recomputed).recipe)
    freed = sizes.activation_bytes - sizes.checkpointed_activation_bytes
    with_all, with_checkpointing = resnet_under_ddp, peaks_above_baseline(tmp_path, recomputed)
    saved = min(with_all) - max(with_checkpointing)
    print(f"ddp resnet18, above the baseline per rank: {[b // MiB for b in with_all]} MiB, with checkpointing "
          f"{[b // MiB for b in with_checkpointing]} MiB; the trace frees {freed // MiB} MiB "
          f"({sizes.blocks} blocks)")
    record_effect("activation_checkpointing/resnet18", reference=with_all, chosen=with_checkpointing,
                  predicted_saving=freed, holds=saved > freed / 2, criterion="saves > half of what the plan's trace frees")
    assert sizes.blocks == 8 and freed > 0
    assert saved > freed / 2, (
        f"activation checkpointing saved {saved // MiB} MiB per rank; the plan's trace says it frees "
        f"{freed // MiB} MiB (without {with_all}, with {with_checkpointing})")


def test_fsdp_shards_a_cnns_state_against_ddp(tmp_path, resnet_under_ddp):
    """A CNN with BatchNorm under FSDP: ResNet-18 (11.2 M parameters, 43 MiB), its BasicBlocks the units,
    SGD with momentum: a DDP rank holds the parameters, gradients, momentum and its gradient buckets,
    four copies; FSDP on 2 ranks keeps half of three, but gathers a block with its whole gradients, and
    layer4's blocks hold 42% of the model (4.7 M parameters each): the plan predicts 53 MiB saved, 1.2
    copies of the parameters. It must save more than half a copy (a strategy that did not shard saves
    nothing). Measured: 553 -> 506-509 MiB per rank above the baseline."""
    params = 11_181_642  # torchvision resnet18 with 10 classes
    sharded = write_recipe(tmp_path, "resnet-fsdp", RESNET_PRESET, strategy={"name": "fsdp"})
    fsdp = peaks_above_baseline(tmp_path, sharded)
    saved = min(resnet_under_ddp) - max(fsdp)
    print(f"resnet18, above the baseline per rank: ddp {[b // MiB for b in resnet_under_ddp]} MiB, "
          f"fsdp {[b // MiB for b in fsdp]} MiB; the parameters {4 * params // MiB} MiB")
    record_effect("fsdp/resnet18", reference=resnet_under_ddp, chosen=fsdp, holds=saved > 2 * params,
                  predicted_saving=lambda: planned_saving_against_ddp(sharded),
                  criterion=f"saves > half the parameters, {2 * params // MiB} MiB")
    assert saved > 2 * params, (
        f"FSDP saved {saved // MiB} MiB per rank against DDP on ResNet-18 (ddp {resnet_under_ddp}, fsdp {fsdp}); "
        f"sharding the state over 2 ranks should save more than half a copy of the parameters, {2 * params // MiB} MiB")


def build_probe(tmp, path) -> dict:
    """tests/pretrained_build_probe.py under torchrun on 2 ranks for the recipe at `path`: rank 0's high-water
    marks (start, end of the build, after the read) and what the probe checked."""
    import subprocess
    import sys

    from run_helpers import env_for

    probe = Path(__file__).with_name("pretrained_build_probe.py")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(probe), str(path)], cwd=tmp, env=env_for(tmp), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_built_as_shards(case: str, what: str, whole: dict, sharded: dict, params: int) -> None:
    """Rank 0's build (start to the end of set-up) as shards must be lower than the whole build by more than a
    quarter of the model's fp32 size; recorded as effect `case`."""
    reference, chosen = [whole["built"] - whole["started"]], [sharded["built"] - sharded["started"]]
    saved = reference[0] - chosen[0]
    print(f"{what}, rank 0 at the end of the build: whole {reference[0] // MiB} MiB, as shards {chosen[0] // MiB} MiB "
          f"above its start; after the read {whole['read'] // MiB} / {sharded['read'] // MiB} MiB; the model "
          f"{4 * params // MiB} MiB")
    record_effect(case, reference=reference, chosen=chosen, predicted_saving=None, holds=saved > params,
                  criterion=f"saves > a quarter of the model's fp32 size, {params // MiB} MiB")
    assert saved > params, (
        f"building on the meta device saved {saved // MiB} MiB on rank 0 (whole {whole}, as shards {sharded}); the "
        f"whole fp32 model is {4 * params // MiB} MiB")


def test_a_pretrained_model_under_fsdp_is_built_without_a_whole_copy_per_rank(tmp_path, corpus):
    """LoRA on a pretrained transformers Llama (27.7 M parameters, 106 MiB in fp32) under FSDP, 2 ranks:
    with `model.init: auto` the model is built on the meta device and each rank allocates only its shards
    (runtime/pretrained.py), where the factory's own build (`model.init: constructor`) makes the whole fp32
    model on every rank first. Measured where the build ends (the model built and sharded, before the
    read: tests/pretrained_build_probe.py under torchrun), rank 0's high-water mark must be lower by more
    than a quarter of the model. The read that follows maps the safetensors file (clean page-cache pages,
    counted in RSS while mapped) the same way in both: docs/models.md states it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config, params = LLAMA_27M, LLAMA_27M_PARAMS
    folder = tmp_path / "pretrained"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})).save_pretrained(folder)
    model = {"pretrained": str(folder), "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}}
    data = {"seq_len": 64, "batch_size": 1}

    def build(name: str, init: str) -> dict:
        path = transformer_recipe(tmp_path, name, corpus, model=model, data=data, family="hf_causal_lm",
                                  strategy={"name": "fsdp"})
        path.write_text(path.read_text().replace("init: constructor", f"init: {init}"))
        return build_probe(tmp_path, path)

    whole, sharded = build("built-whole", "constructor"), build("built-sharded", "auto")
    assert (whole["init"], sharded["init"]) == ("constructor", "seeded")
    assert whole["lora_b_max"] == sharded["lora_b_max"] == 0.0  # both start as the checkpoint (HFCausalLM.after_seeded_init)
    assert_built_as_shards("pretrained-build/hf-llama", "pretrained llama + lora under fsdp", whole, sharded, params)


def test_a_weights_file_under_fsdp_is_read_into_shards_without_a_whole_copy_per_rank(tmp_path):
    """`model.weights` (a torch.save state dict, as torchvision and timm checkpoints are) of a ResNet-50
    (23.5 M parameters with 10 classes, 90 MiB in fp32, BatchNorm statistics in it too) under FSDP, 2 ranks: with
    `model.init: auto` the model is built on the meta device, each rank allocates its shards and copies
    its slices out of the memory-mapped file (runtime/pretrained.py `WeightsFile`); with `constructor`
    every rank builds the whole model and loads the whole state dict first. Both must end with every entry
    of the file in the model exactly (the shards gathered back); rank 0's high-water mark at the end of
    the build (before the sharded read) must be lower by more than a quarter of the model. Measured: 297 -> 122
    MiB."""
    import torch
    import torchvision

    torch.manual_seed(0)
    trained = torchvision.models.resnet50(num_classes=10)
    for module in trained.modules():  # statistics a fresh model does not have, so a missed buffer shows
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
    torch.save({"model": trained.state_dict()}, tmp_path / "resnet50.pt")  # a training script's checkpoint
    params = sum(p.numel() for p in trained.parameters())
    del trained

    def build(init: str) -> dict:
        path = write_recipe(tmp_path, f"weights-{init}", RESNET_PRESET, strategy={"name": "fsdp"},
                            model={"name": "torchvision.resnet50", "args": {"num_classes": 10},
                                   "weights": str(tmp_path / "resnet50.pt"), "init": init})
        return build_probe(tmp_path, path)

    whole, sharded = build("constructor"), build("auto")
    assert (whole["init"], sharded["init"]) == ("constructor", "seeded")
    assert whole["weights_diff"] == sharded["weights_diff"] == 0.0  # every parameter and buffer, exactly
    assert_built_as_shards("weights-build/resnet50", "resnet50 weights file under fsdp", whole, sharded, params)
