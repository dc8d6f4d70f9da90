"""Shared set-up of the language-model tests: a small synthetic corpus with its tokenizer (made
once per module, in-process), and recipes for the built-in transformer trained on it.

Tolerance (strategy_runs.RTOL, 1e-5 relative on each step's loss): the runs compared hold the
same global batch of packed sequences (every micro-batch counts the same number of tokens), so
their per-rank token means average to the one-process mean up to fp32 summation order.
"""

from __future__ import annotations

from pathlib import Path

STEPS = 8
VOCAB = 320  # >= the tokenizer's 256 bytes + merges + end-of-text
# `init: seeded` everywhere, as in strategy_runs: FSDP and ZeRO-3 resolve `auto` to seeded, so the
# one-process reference must start from the same (seed, name) weights
TINY = {"name": "transformer", "args": {"vocab_size": VOCAB, "dim": 32, "layers": 2, "heads": 2, "seq_len": 32},
        "init": "seeded"}


def make_corpus(folder: Path, *, documents: int = 400, world: int = 2, batch: int = 4) -> dict:
    """train.txt, eval.txt (trimmed so its blocks split evenly over `world` ranks x `batch`, so no
    rank pads its share) and tokenizer.json in `folder`; returns the data block's paths."""
    from trainkit.runtime.text_data import PackedTokens, encode, load_tokenizer, read_texts, train_tokenizer, \
        write_corpus

    train, held_out = write_corpus(folder, documents=documents, seed=0)
    tok = train_tokenizer([str(train)], folder / "tokenizer.json", vocab_size=300)
    lines = held_out.read_text().splitlines()
    tokenizer = load_tokenizer(str(tok))
    while len(PackedTokens(encode(lines, tokenizer), TINY["args"]["seq_len"])) % (world * batch):
        lines.pop()
    held_out.write_text("\n".join(lines) + "\n")
    assert read_texts([str(held_out)]) == lines
    return {"files": [str(train)], "eval_files": [str(held_out)], "tokenizer": str(tok)}


def tiny_lm(corpus: dict) -> dict:
    """The preset of the language-model tests, on `corpus` (make_corpus's data paths):
    write_recipe(tmp, name, tiny_lm(corpus), strategy=...)."""
    return {
        "name": "tiny-lm", "seed": 3, "task": {"name": "causal_lm"}, "model": TINY,
        "data": {"name": "text", **corpus, "seq_len": 32, "batch_size": 4, "shuffle": True},
        "strategy": {"name": "ddp"},
        "optimizer": {"name": "sgd", "lr": 0.5, "momentum": 0.9},
        "trainer": {"max_steps": STEPS, "log_every": 1, "checkpoint": {"every": 4, "keep": 3}},
        "launch": {"nproc_per_node": 2, "timeout_s": 120},
        "tracking": {"enabled": False},
    }
