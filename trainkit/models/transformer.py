"""A small decoder-only transformer in plain PyTorch (torchtitan's Llama, trimmed): RMSNorm, rotary
embeddings, SwiGLU feed-forward, causal scaled-dot-product attention.

The model is an `nn.Sequential` of `tok_embeddings`, `layers` (one `TransformerBlock` per layer),
`norm` and `output`, and every block takes and returns only the hidden states, so each strategy
handles it unchanged: FSDP shards each `TransformerBlock` (`wrap: [TransformerBlock]`, with
activation checkpointing per block), the pipeline splits at `layers.N`, ZeRO-3 partitions it,
DDP replicates it, and tensor parallel splits it with the plan `tensor_parallel_plan` declares
(torchtitan's). Rotary angles are computed in fp32 in each forward (no buffers, so nothing
is cast to bf16 by DeepSpeed or sharded by FSDP).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


@dataclass(kw_only=True, frozen=True)
class TransformerConfig:
    vocab_size: int
    dim: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: Optional[int] = None  # grouped-query attention (None: as many as heads)
    seq_len: int = 512  # the longest sequence the model is built for
    ffn_hidden: Optional[int] = None  # None: 8/3 * dim rounded up to a multiple of 64 (Llama's SwiGLU width)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.dim % self.heads:
            raise ValueError(f"dim {self.dim} is not divisible by heads {self.heads}")
        if self.heads % (self.kv_heads or self.heads):
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")

    @property
    def hidden(self) -> int:
        return self.ffn_hidden or 64 * -(-int(8 * self.dim / 3) // 64)


def rotary(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [seq_len, head_dim / 2], in fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [batch, heads, seq, head_dim] by the position's angles."""
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads or c.heads, c.dim // c.heads
        self.theta = c.rope_theta
        self.wq = nn.Linear(c.dim, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not self.heads: under tensor parallel each rank holds heads / tp of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rotary(t, self.head_dim, self.theta, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.feed_forward = FeedForward(c.dim, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Sequential):
    """tokens [batch, seq] -> logits [batch, seq, vocab]."""

    # the unit FSDP shards, activation checkpointing recomputes and the memory plan gathers
    # (runtime.performance.repeated_blocks reads it, as Accelerate reads a Hugging Face model's)
    _no_split_modules = ["TransformerBlock"]

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.Sequential(*(TransformerBlock(config) for _ in range(config.layers)))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """torchtitan's scheme: normal embeddings, truncated normal projections whose output
        projections shrink with depth, and a head scaled by 1/sqrt(dim)."""
        nn.init.normal_(self.tok_embeddings.weight)
        for i, block in enumerate(self.layers):
            std = 0.02 / (2 * (i + 1)) ** 0.5
            for lin in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            for lin in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)
        s = self.config.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=s, a=-3 * s, b=3 * s)

    @property
    def max_seq_len(self) -> int:
        return self.config.seq_len

    def tensor_parallel_plan(self, *, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
        """torchtitan's Llama plan: Megatron's column/row pairs in attention and the MLP, sequence
        parallel norms (the residual stream between them sharded on the sequence, so the sequence
        length must divide by tp), a vocabulary-sharded embedding and head; with `loss_parallel`, the
        logits stay a Shard(-1) DTensor for torch's loss_parallel()."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                       SequenceParallel)

        to_whole_sequence = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        return {
            "tok_embeddings": sequence_sharded_embedding(),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(**to_whole_sequence),
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wk": ColwiseParallel(),
            "layers.*.attention.wv": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.feed_forward": PrepareModuleInput(**to_whole_sequence),
            "layers.*.feed_forward.w1": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.feed_forward.w3": ColwiseParallel(),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel),
        }

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.shape[-1] > self.config.seq_len:
            raise ValueError(f"sequence of {tokens.shape[-1]} tokens; the model is built for {self.config.seq_len}")
        return super().forward(tokens)


def sequence_sharded_embedding() -> ParallelStyle:
    """The embedding split on the vocabulary, its output split on the sequence (torchtitan's), refusing
    first a sequence that does not split evenly over the tp ranks: uneven shards break the collectives of
    the blocks that follow (gloo aborts the process)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    class SequenceShardedEmbedding(RowwiseParallel):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            module.register_forward_pre_hook(partial(refuse_uneven_sequence, tp=device_mesh.size()))
            return super()._apply(module, device_mesh)

    return SequenceShardedEmbedding(input_layouts=Replicate(), output_layouts=Shard(1))


def refuse_uneven_sequence(_module: nn.Module, args: tuple, *, tp: int) -> None:
    length = args[0].shape[-1]
    if length % tp:
        raise ValueError(f"a sequence of {length} tokens does not split over tp {tp} ranks: the transformer's "
                         f"tensor-parallel plan shards the sequence between its blocks (sequence parallel); make "
                         f"data.seq_len a multiple of {tp}")


def transformer(*, vocab_size: int, dim: int = 256, layers: int = 4, heads: int = 4, kv_heads: Optional[int] = None,
                seq_len: int = 512, ffn_hidden: Optional[int] = None, rope_theta: float = 10000.0,
                norm_eps: float = 1e-5) -> Transformer:
    """The built-in decoder-only transformer (`model: {name: transformer, args: {...}}`)."""
    return Transformer(TransformerConfig(vocab_size=vocab_size, dim=dim, layers=layers, heads=heads,
                                         kv_heads=kv_heads, seq_len=seq_len, ffn_hidden=ffn_hidden,
                                         rope_theta=rope_theta, norm_eps=norm_eps))
