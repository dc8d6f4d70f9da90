"""Several conversations in one sequence, none attending to another (`data.packing` for chat data).

Why: chat samples are mostly shorter than `seq_len`, so one sample per sequence spends most of each
step's positions on padding. Packed, the positions hold real tokens.

How no sample attends to another: each row carries position ids that restart at 0 where a
conversation starts, and the model honours them. Hugging Face models do: transformers'
`create_causal_mask` reads a restart in `position_ids` as a sequence boundary
(`masking_utils.find_packed_sequence_indices`) and makes the mask block-causal for the sdpa and eager
kernels (flash-attention-2 takes the same ids as varlen boundaries); the rotary embedding reads the same
ids, so every conversation sees the positions it would alone. The built-in transformer has no such
mask, so `validate` refuses packing with it (blocks/data.py). The target of a conversation's last
token (the next conversation's first) is IGNORE, as is the padding that fills a row's tail.

Greedy, in file order: a conversation goes into the current row if it fits, else opens the next; one
longer than the row is truncated as it would be unpacked. The sampler shuffles rows, not conversations.
"""

from __future__ import annotations

IGNORE = -100


def shifted(ids: list[int], counted: list[bool], seq_len: int) -> tuple[list[int], list[int]]:
    """One conversation as model inputs and next-token targets (IGNORE where the next token is not the
    assistant's), at most seq_len of each."""
    ids, counted = ids[:seq_len + 1], counted[:seq_len + 1]
    return ids[:-1], [t if c else IGNORE for t, c in zip(ids[1:], counted[1:])]


def pack(conversations: list[tuple[list[int], list[bool]]], seq_len: int,
         pad_id: int) -> list[tuple[list[int], list[int], list[int]]]:
    """Rows of (inputs, targets, position ids), each seq_len long, holding whole conversations."""
    rows: list[tuple[list[int], list[int], list[int]]] = []
    inputs: list[int] = []
    targets: list[int] = []
    positions: list[int] = []

    def close() -> None:
        pad = seq_len - len(inputs)
        rows.append((inputs + [pad_id] * pad, targets + [IGNORE] * pad, positions + list(range(pad))))

    for ids, counted in conversations:
        x, y = shifted(ids, counted, seq_len)
        if not x:
            continue
        if len(inputs) + len(x) > seq_len:
            close()
            inputs, targets, positions = [], [], []
        inputs, targets, positions = inputs + x, targets + y, positions + list(range(len(x)))
    if inputs:
        close()
    return rows
