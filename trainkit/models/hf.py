"""Hugging Face transformers causal LMs built from a config in the recipe (never downloaded):

    model: {name: hf_causal_lm, args: {config: {model_type: llama, hidden_size: 256, ...}}}

`AutoConfig.for_model(model_type, **config)` then `AutoModelForCausalLM.from_config`: random
weights, no hub access. The wrapper returns the logits tensor, so tasks and strategies see the same
`tokens -> logits` module as the built-in transformer. Runs under DDP, FSDP (wrap the model's
decoder-layer class, e.g. `LlamaDecoderLayer`) and DeepSpeed; not the pipeline strategy (the model
is not an nn.Sequential of blocks). Needs the optional extra: `pip install 'trainkit-recipes[hf]'`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


class HFCausalLM(nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab] of a transformers causal LM."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def max_seq_len(self) -> Optional[int]:
        return max_positions(self.model.config.to_dict())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


def max_positions(config: dict) -> Optional[int]:
    for key in MAX_POSITION_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def hf_causal_lm(*, config: dict[str, Any]) -> HFCausalLM:
    """Build a transformers causal LM from `config` (which names its `model_type`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    options = dict(config)
    model_type = options.pop("model_type", None)
    if model_type is None:
        raise ValueError("model.args.config needs model_type (e.g. llama, gpt2, qwen2)")
    options.setdefault("use_cache", False)
    hf_config = AutoConfig.for_model(model_type, **options)
    return HFCausalLM(AutoModelForCausalLM.from_config(hf_config))
