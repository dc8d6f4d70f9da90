"""Model inputs other than a plain tensor of token ids, defined where the models that take them are.

`TokensWithPositions` is what packed chat data feeds a language model (`data.packing`,
runtime.packed_sequences): the position ids restart at each packed sample, and a model that honours
them (trainkit.models.hf) keeps the samples apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokensWithPositions(NamedTuple):
    """Token ids and their position ids, both [..., T]. A NamedTuple, so DataLoader's collate, DDP, FSDP
    and DeepSpeed pass it through as one input."""

    tokens: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device, non_blocking: bool = False) -> "TokensWithPositions":
        return TokensWithPositions(self.tokens.to(device, non_blocking=non_blocking),
                                   self.position_ids.to(device, non_blocking=non_blocking))
