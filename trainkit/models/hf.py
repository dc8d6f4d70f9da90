"""Hugging Face transformers causal LMs built from a config in the recipe (never downloaded):

    model: {name: hf_causal_lm, args: {config: {model_type: llama, hidden_size: 256, ...}}}

`AutoConfig.for_model(model_type, **config)` then `AutoModelForCausalLM.from_config`: random
weights, no hub access. The wrapper returns the logits tensor, so tasks and strategies see the same
`tokens -> logits` module as the built-in transformer. Runs under DDP, FSDP (wrap the model's
decoder-layer class, e.g. `LlamaDecoderLayer`) and DeepSpeed; not the pipeline strategy (the model
is not an nn.Sequential of blocks). Tensor parallel with the plan transformers declares for the
model family (`tensor_parallel_plan`). Needs the optional extra: `pip install 'trainkit-recipes[hf]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

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

    def tensor_parallel_plan(self, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
        """transformers' own plan for the model (`tp_plan`: the config's `base_model_tp_plan`, the vocabulary-
        sharded embedding and the head's `_tp_plan`) in torch's styles; with `loss_parallel`, the head's logits
        stay a Shard(-1) DTensor for torch's loss_parallel().

        Raises:
            RuntimeError: transformers declares no plan for the model, a style trainkit does not translate,
                or tied input and output embeddings.
        """
        plan, kind = getattr(self.model, "tp_plan", None), type(self.model).__name__
        if not plan:
            raise RuntimeError(f"transformers declares no tensor-parallel plan for {kind} (its config has no "
                               "base_model_tp_plan); use parallel.tp: 1 or a model family that has one (e.g. llama)")
        head, embedding = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        if head is not None and embedding is not None and head.weight is embedding.weight:
            raise RuntimeError(f"{kind} ties its input and output embeddings, which tensor parallel would shard "
                               "twice and untie; set tie_word_embeddings: false in model.args.config")
        head_name = next((name for name, module in self.model.named_modules() if module is head), None)
        return {f"model.{name}": translated_style(style, name, keep_logits_sharded=loss_parallel and name == head_name)
                for name, style in plan.items()}


def translated_style(style: str, module: str, *, keep_logits_sharded: bool = False) -> ParallelStyle:
    """torch's ParallelStyle for one of transformers' plan strings (transformers.distributed.tensor_parallel
    registers what each means). Only the styles whose meaning torch's own expresses exactly; the others
    (packed, expert, MLA, norms whose gradients transformers all-reduces by hand) are refused."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if keep_logits_sharded and style in ("colwise", "colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    styles = {
        "colwise": ColwiseParallel,  # weight rows (output features) split; replicated in, sharded out
        "rowwise": RowwiseParallel,  # weight columns split; sharded in, all-reduced out
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary split, sums
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),  # embedding width split
    }
    if style not in styles:
        raise RuntimeError(f"the transformers tensor-parallel plan shards {module} as '{style}', which trainkit "
                           f"does not translate to a torch ParallelStyle (it knows {', '.join(styles)}); use "
                           "parallel.tp: 1")
    return styles[style]()


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
