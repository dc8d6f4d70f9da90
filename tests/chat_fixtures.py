"""A Hugging Face tokenizer directory with a chat template, made from the test corpus's tokenizer
(no downloads), and chat JSONL files: shared by the chat-data and LoRA tests."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"]


def save_chat_tokenizer(tokenizer_json: str, folder: Path) -> None:
    """save_pretrained of a fast tokenizer over `tokenizer_json`, with the template and its role markers."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer_json, eos_token="<|end|>", pad_token="<|pad|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)


def write_chat(path: Path, conversations: int, seed: int) -> Path:
    """JSONL: half `messages` records (system, user, assistant, user, assistant), half prompt/response."""
    import random

    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "tensor", "shard", "rank"]
    say = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
    lines = []
    for i in range(conversations):
        if i % 2:
            lines.append({"prompt": say(4), "response": say(3)})
        else:
            lines.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": say(3)},
                                       {"role": "assistant", "content": say(2)}, {"role": "user", "content": say(2)},
                                       {"role": "assistant", "content": say(3)}]})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path
