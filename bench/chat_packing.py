"""Conversations per second with and without `data.packing` (issue 39, item 3), side by side.

    python bench/chat_packing.py [--pairs 7] [--steps 30] [--seq-len 256] [--hidden 256 --layers 4]

Chat SFT data of short conversations (36-68 tokens, tests/chat_fixtures.write_chat) and a transformers
Llama built from its config (`hf_causal_lm`), one process (`nproc_per_node: 1`), fp32, AdamW. Each pair
trains the same recipe once one conversation per sequence (padded to seq_len) and once packed, in
alternating order. Per run: the median step time over the steps after warm-up; conversations/s = the
micro-batch's sequences x conversations per sequence / that step time; tokens/s counts the
conversations' own tokens the same way (padding is not a token). The packed/unpacked ratio is taken
per pair; its median and spread are printed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from trainkit.run_dir import METRICS

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the chat fixtures the tests use: one way to make the data


def prepare(folder: Path, conversations: int) -> tuple[Path, Path, int]:
    """A tokenizer directory with a chat template, a chat JSONL file, and the conversations' own token count."""
    from chat_fixtures import save_chat_tokenizer, write_chat

    from trainkit.runtime.chat_data import conversations as records, load_chat_tokenizer, render
    from trainkit.runtime.text_data import train_tokenizer, write_corpus

    train, _ = write_corpus(folder / "corpus", documents=200, seed=0)
    tokenizer_json = train_tokenizer([str(train)], folder / "corpus" / "tokenizer.json", vocab_size=300)
    save_chat_tokenizer(str(tokenizer_json), folder / "tokenizer")
    chat = write_chat(folder / "chat.jsonl", conversations, seed=0)
    options = argparse.Namespace(messages_field="messages", prompt_field="prompt", response_field="response")
    tok = load_chat_tokenizer(str(folder / "tokenizer"))
    tokens = sum(len(render(tok, m, "bench")[0]) - 1 for _, _, m in records([str(chat)], options))
    return folder / "tokenizer", chat, tokens


def recipe(folder: Path, name: str, tokenizer: Path, chat: Path, packing: bool, args) -> Path:
    import yaml

    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "seed": 0, "task": {"name": "causal_lm"},
        "model": {"name": "hf_causal_lm", "args": {"config": {
            "model_type": "llama", "vocab_size": 320, "hidden_size": args.hidden, "intermediate_size": 2 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": 4, "max_position_embeddings": args.seq_len}}},
        "data": {"name": "chat", "files": [str(chat)], "tokenizer": str(tokenizer), "seq_len": args.seq_len,
                 "batch_size": args.batch, "packing": packing},
        "strategy": {"name": "ddp"}, "optimizer": {"name": "adamw", "lr": 1e-4},
        "trainer": {"max_steps": args.steps, "log_every": 1, "checkpoint": {"every": 10_000}},
        "launch": {"nproc_per_node": 1}, "tracking": {"enabled": False}}, sort_keys=False))
    return path


def one_run(folder: Path, path: Path, conversations: int, tokens: int, batch: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "trainkit.cli", "run", str(path)], cwd=folder, capture_output=True,
                         text=True, timeout=900)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    sequences = int(re.search(r"data ready: ([\d,]+) training samples", out.stdout).group(1).replace(",", ""))
    rows = [json.loads(line) for line in (folder / "runs" / path.stem / METRICS).read_text().splitlines()]
    step = statistics.median(r["step_time_s"] for r in rows[3:] if "step_time_s" in r)
    per_sequence = conversations / sequences
    return {"sequences": sequences, "step_s": step, "conversations_per_s": batch * per_sequence / step,
            "tokens_per_s": batch * (tokens / sequences) / step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=400)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    tokenizer, chat, tokens = prepare(folder, args.conversations)
    paths = {packing: recipe(folder, f"packing-{packing}", tokenizer, chat, packing, args) for packing in (False, True)}
    results = {False: [], True: []}
    for pair in range(args.pairs):
        for packing in ((False, True) if pair % 2 == 0 else (True, False)):
            results[packing].append(one_run(folder, paths[packing], args.conversations, tokens, args.batch))
            subprocess.run(["rm", "-rf", str(folder / "runs")])
        print(f"pair {pair + 1}: unpacked {results[False][-1]['conversations_per_s']:.1f} conv/s, "
              f"packed {results[True][-1]['conversations_per_s']:.1f} conv/s", flush=True)
    ratios = [p["conversations_per_s"] / u["conversations_per_s"] for u, p in zip(results[False], results[True])]
    print(f"\n{args.conversations} conversations ({tokens / args.conversations:.0f} tokens each on average), "
          f"seq_len {args.seq_len}, micro-batch {args.batch}, Llama hidden {args.hidden} x {args.layers} layers")
    print("| data | sequences | step (ms) | conversations/s | conversation tokens/s |")
    print("|---|---|---|---|---|")
    for packing in (False, True):
        runs = results[packing]
        print(f"| {'packed' if packing else 'one per sequence'} | {runs[0]['sequences']} | "
              f"{statistics.median(r['step_s'] for r in runs) * 1000:.1f} | "
              f"{statistics.median(r['conversations_per_s'] for r in runs):.1f} | "
              f"{statistics.median(r['tokens_per_s'] for r in runs):,.0f} |")
    print(f"\npacked / one per sequence, conversations/s, per pair: median {statistics.median(ratios):.2f}x "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}, {len(ratios)} pairs)")


if __name__ == "__main__":
    main()
