"""Run by test_tensor_parallel.py as `torchrun --nproc_per_node 2 tests/tensor_parallel_runs.py OUT.json`:
every tensor-parallel configuration in one 2-process gloo launch (processes are slow to start on 2 cores).

The models: the built-in transformer, a tiny HF Llama and the example model of docs/plugins.md.
Each configuration builds the model twice from one seed: a reference kept whole, as one process runs it,
and a copy split over the 2 ranks by `apply_tensor_parallel`. Both take 3 AdamW steps on the same
batches with trainkit's next-token loss; rank 0 writes the relative differences (loss, gradients and
weights gathered with full_tensor, the worst over both ranks) and how the copy was split, and the
refusals of HF models trainkit cannot split (here, where transformers is imported anyway).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from trainkit.models.hf import hf_causal_lm
from trainkit.models.transformer import transformer
from trainkit.strategies.tensor_parallel import apply_tensor_parallel, full_tensor, loss_context
from trainkit.tasks.causal_lm import NextTokenLoss

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64
LLAMA = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, tie_word_embeddings=False)
PLUGINS_DOC = Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def docs_example(marker: str) -> dict:
    """What the docs/plugins.md python block that starts with `marker` defines."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", PLUGINS_DOC.read_text(), re.S) if b.startswith(marker))
    namespace: dict = {}
    exec(compile(block, str(PLUGINS_DOC), "exec"), namespace)
    return namespace


def tokens(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
    return t[:, :-1], t[:, 1:]


def features(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 16, generator=generator), torch.randint(0, 8, (BATCH,), generator=generator)


HF_REFUSED = {  # configs whose transformers plan trainkit must refuse to split
    "no plan (gpt2)": dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB),
    "untranslated style (qwen3)": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
                                       tie_word_embeddings=False),
    "tied embeddings (llama)": dict(LLAMA, num_hidden_layers=1, tie_word_embeddings=True),
}
MODELS = {  # name: (build, a batch from a generator)
    "transformer": (lambda: transformer(vocab_size=VOCAB, dim=32, layers=2, heads=4, kv_heads=2, seq_len=SEQ), tokens),
    "hf_llama": (lambda: hf_causal_lm(config=LLAMA), tokens),
    "docs_example": (lambda: docs_example("# trainkit_tp_mlp/model.py")["TwoLayerMLP"](), features),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| over the whole tensor (elementwise ratios of near-zero entries say nothing)."""
    a, b = full_tensor(a).detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def worst_over_ranks(value: float) -> float:
    t = torch.tensor(value, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def placements(model: torch.nn.Module) -> dict[str, str]:
    return {name: str(p.placements[0]) if isinstance(p, DTensor) else "plain" for name, p in model.named_parameters()}


def compare(build, batch, tp_mesh, *, loss_parallel: bool) -> dict:
    """One configuration: the split copy against the whole reference, step by step."""
    torch.manual_seed(0)
    reference = build()
    model = apply_tensor_parallel(copy.deepcopy(reference), tp_mesh, loss_parallel=loss_parallel)
    loss_fn = NextTokenLoss(ignore_index=-100)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    batches = torch.Generator().manual_seed(1)
    out = {"placements": placements(model), "loss": [], "grad": [], "weight": []}
    for _ in range(STEPS):
        x, y = batch(batches)
        expected = loss_fn(reference(x), y)
        expected.backward()
        with loss_context(loss_parallel):
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
        out["logits"] = str(logits.placements[0]) if isinstance(logits, DTensor) else "plain"
        out["loss"].append(worst_over_ranks(relative(loss, expected)))
        params = dict(reference.named_parameters())
        out["grad"].append(worst_over_ranks(max(relative(p.grad, params[n].grad) for n, p in model.named_parameters())))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["weight"].append(worst_over_ranks(max(relative(p, params[n]) for n, p in model.named_parameters())))
    return out


def uneven_sequence_refusal(tp_mesh) -> str:
    """What the transformer says to a sequence that its sequence-parallel plan cannot split evenly."""
    model = apply_tensor_parallel(MODELS["transformer"][0](), tp_mesh, loss_parallel=False)
    try:
        model(torch.zeros(BATCH, SEQ - 1, dtype=torch.long))
    except ValueError as e:
        return str(e)
    return "not refused"


def refusal(config: dict) -> str:
    try:
        hf_causal_lm(config=config).tensor_parallel_plan()
    except RuntimeError as e:
        return str(e)
    return "not refused"


def main(path: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    tp_mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {f"{name} loss_parallel={lp}": compare(build, batch, tp_mesh, loss_parallel=lp)
               for name, (build, batch) in MODELS.items() for lp in (False, True)}
    results["uneven sequence"] = uneven_sequence_refusal(tp_mesh)  # every rank refuses before any collective
    if dist.get_rank() == 0:
        results["hf refusals"] = {name: refusal(config) for name, config in HF_REFUSED.items()}
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()  # no rank leaves while another still talks to it (gloo aborts on a closed peer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # As trainkit's worker leaves (runtime/worker.py): without interpreter finalization, which can race
    # gloo's threads still holding the device mesh's group (CI saw rank 1 abort here with
    # "terminate called without an active exception" after every result was written).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)
