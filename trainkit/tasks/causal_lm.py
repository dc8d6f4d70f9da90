"""`task: causal_lm`: next-token prediction on `(tokens, targets)` batches, where targets are the
tokens shifted by one and `ignore_index` marks positions that do not count (padding).

Logged: loss, perplexity and tokens/s. Evaluation: loss, perplexity and next-token accuracy over
the held-out tokens, from float64 sums (negative log-likelihood, correct, tokens) all-reduced over
ranks, so eval perplexity is exactly that of one process on the same tokens. The training loss is
the mean over a micro-batch's counted tokens; with packed sequences every micro-batch has the same
count, so the mean over ranks is the token-weighted mean.

FLOPs per token (MFU): 6·N for the weights a token passes through (N: parameters without the
embedding lookups) plus 12·layers·dim·seq_len for attention scores and values (forward and
backward), as in PaLM's appendix B and torchtitan.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.model import build_model


class NextTokenLoss:
    """Mean cross-entropy over the counted tokens of logits [..., vocab] against targets [...]."""

    def __init__(self, ignore_index: int):
        self.ignore_index = ignore_index

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=self.ignore_index)


def lm_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """6·N + 12·layers·dim·seq_len; `model` may live on the meta device."""
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)
    # a head tied to the input embedding still multiplies: count it once
    n += sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and id(m.weight) in embeddings)
    layers, dim = attention_dims(model)
    return 6.0 * n + 12.0 * layers * dim * seq_len


def attention_dims(model: nn.Module) -> tuple[int, int]:
    """(layers, model width) of a built-in or Hugging Face transformer; (0, 0) if unknown."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "layers"):  # trainkit.models.transformer
        return config.layers, config.dim
    hf = getattr(getattr(model, "model", None), "config", None)
    if hf is not None:
        return (getattr(hf, "num_hidden_layers", 0) or getattr(hf, "n_layer", 0),
                getattr(hf, "hidden_size", 0) or getattr(hf, "n_embd", 0))
    return 0, 0


class CausalLMTask:
    num_eval_sums = 3

    def __init__(self, options: Any, *, device: torch.device, model_spec: Any, data: Any):
        """`model_spec` and `data`: the recipe's model and data blocks (sequence length, micro-batch and
        the model the FLOPs estimate counts)."""
        self.options, self.device, self.model_spec, self.data = options, device, model_spec, data
        self.ignore_index = options.ignore_index
        self.loss_fn = NextTokenLoss(options.ignore_index)
        self.seq_len = getattr(data, "seq_len", None)

    @classmethod
    def run_inputs(cls, recipe) -> dict:
        """The constructor keywords taken from the resolved recipe beyond the task's own block."""
        return {"model_spec": recipe.model, "data": recipe.data}

    def to_device(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """(token ids, or TokensWithPositions with their position ids; targets) on the device."""
        x, y = batch[0], batch[1]
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """[negative log-likelihood sum, correct next tokens, counted tokens] in float64."""
        logits, flat = outputs.flatten(0, -2).float(), targets.flatten()
        counted = flat != self.ignore_index
        nll = F.cross_entropy(logits, flat, ignore_index=self.ignore_index, reduction="sum")
        correct = ((logits.argmax(-1) == flat) & counted).sum()
        return torch.stack([nll.double(), correct.double(), counted.sum().double()])

    def eval_metrics(self, sums: torch.Tensor) -> dict:
        n = max(sums[2].item(), 1.0)
        loss = sums[0].item() / n
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_accuracy": sums[1].item() / n, "eval_tokens": int(sums[2].item())}

    def log_metrics(self, metrics: dict) -> dict:
        out = {"perplexity": math.exp(min(metrics["loss"], 700.0))}
        if self.seq_len and metrics.get("samples_per_s"):
            out["tokens_per_s"] = metrics["samples_per_s"] * self.seq_len
        return out

    def flops_per_microbatch(self) -> Optional[float]:
        """Forward+backward FLOPs of one micro-batch per rank (6·N + attention, per token)."""
        if not self.seq_len:
            return None
        with torch.device("meta"):
            model = build_model(self.model_spec.model_copy(update={"weights": None}))
        return lm_flops_per_token(model, self.seq_len) * self.seq_len * self.data.batch_size
