"""A stand-in for a pretrained chat model and its SFT data, written to disk for the CPU demo of LoRA
fine-tuning (`trainkit data make-chat-demo DIR`, recipes/lora-sft-demo-cpu.yaml): nothing is ever
downloaded, so the demo brings its own.

- DIR/chat-llama/: what `save_pretrained` writes for a small transformers Llama (4 layers, 128 wide; random
  weights: it stands in for a pretrained checkpoint, it is not one) with its tokenizer -- a byte-level
  BPE trained on the conversations, the chat template and its role tokens.
- DIR/train.jsonl, DIR/eval.jsonl: conversations in the `messages` format; the assistant answers which
  city is the capital of a made-up country (24 pairs), so what the adapters learn shows as the eval loss
  on the responses falling.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"]
SYLLABLES = ["zor", "bia", "quen", "tar", "mel", "ovo", "kra", "dun", "sil", "vex", "ama", "rhu"]


def capitals(seed: int, pairs: int = 24) -> dict[str, str]:
    rng = random.Random(seed)
    word = lambda n: "".join(rng.choice(SYLLABLES) for _ in range(n)).capitalize()  # noqa: E731
    out: dict[str, str] = {}
    while len(out) < pairs:
        out[word(2)] = word(2)
    return out


def conversations(count: int, seed: int, table: dict[str, str]) -> list[dict]:
    rng = random.Random(seed)
    countries = sorted(table)
    out = []
    for _ in range(count):
        country = rng.choice(countries)
        out.append({"messages": [{"role": "system", "content": "Answer in one word."},
                                 {"role": "user", "content": f"What is the capital of {country}?"},
                                 {"role": "assistant", "content": f"{table[country]}."}]})
    return out


def make_chat_demo(folder: Path, seed: int = 0, train: int = 1200, held_out: int = 96) -> dict:
    """Write the demo's model directory and JSONL files under `folder`; returns their paths."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = Path(folder)
    model_dir = folder / "chat-llama"
    model_dir.mkdir(parents=True, exist_ok=True)
    table = capitals(seed)
    files = {}
    for name, count, offset in (("train", train, 1), ("eval", held_out, 2)):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(c) + "\n" for c in conversations(count, seed + offset, table)))
        files[name] = path
    texts = [m["content"] for line in files["train"].read_text().splitlines() for m in json.loads(line)["messages"]]
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=384, min_frequency=1, special_tokens=ROLE_TOKENS, show_progress=False)
    bpe.save(str(model_dir / "tokenizer.json"))  # then wrapped, with its chat template, as transformers saves it
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|end|>",
                                        pad_token="<|pad|>", additional_special_tokens=ROLE_TOKENS[:3])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(model_dir)  # safetensors
    return {"model": model_dir, "train": files["train"], "eval": files["eval"]}
