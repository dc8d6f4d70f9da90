"""Chat data (issue 39): conversations rendered with the tokenizer's own chat template, the loss on the
assistant's tokens only, no sample attending to another (one conversation per sequence)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from chat_fixtures import save_chat_tokenizer, write_chat

pytest.importorskip("transformers")

OPTIONS = SimpleNamespace(messages_field="messages", prompt_field="prompt", response_field="response")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, corpus):
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    save_chat_tokenizer(corpus["tokenizer"], folder)
    return str(folder)


def test_only_the_assistants_tokens_are_counted(tokenizer_dir):
    from trainkit.runtime.chat_data import IGNORE, ChatSequences, load_chat_tokenizer, render

    tok = load_chat_tokenizer(tokenizer_dir)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"},
                {"role": "assistant", "content": "gamma"}, {"role": "user", "content": "delta"},
                {"role": "assistant", "content": "omega shard"}]
    ids, counted = render(tok, messages, "here")
    assert tok.decode([i for i, c in zip(ids, counted) if c]) == "gamma<|end|>omega shard<|end|>"
    inputs, targets = ChatSequences([(ids, counted)], seq_len=len(ids) + 5, pad_id=tok.pad_token_id)[0]
    assert inputs.tolist()[:len(ids) - 1] == ids[:-1]
    assert (inputs[len(ids) - 1:] == tok.pad_token_id).all()  # padded, never another conversation
    kept = [t for t in targets.tolist() if t != IGNORE]
    assert tok.decode(kept) == "gamma<|end|>omega shard<|end|>"  # targets: the next token where it is the assistant's
    short_inputs, short_targets = ChatSequences([(ids, counted)], seq_len=4, pad_id=0)[0]
    assert short_inputs.tolist() == ids[:4] and len(short_targets) == 4  # truncated, not spilled into a next sample


def test_a_conversation_the_data_cannot_render_is_refused_with_its_line(tmp_path, tokenizer_dir):
    from trainkit.runtime.chat_data import ChatDataError, build_chat

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "response": "y"}) + "\n" + json.dumps({"question": "no fields"}) + "\n")
    options = SimpleNamespace(files=[str(bad)], eval_files=[], tokenizer=tokenizer_dir, seq_len=16, **vars(OPTIONS))
    with pytest.raises(ChatDataError, match=r"bad.jsonl:2: no 'messages'"):
        build_chat(options, split="train", seed=0)


def test_a_chat_file_builds_one_sequence_per_conversation(tmp_path, tokenizer_dir):
    from trainkit.runtime.chat_data import IGNORE, build_chat

    path = write_chat(tmp_path / "chat.jsonl", 6, seed=0)
    options = SimpleNamespace(files=[str(path)], eval_files=[], tokenizer=tokenizer_dir, seq_len=48, **vars(OPTIONS))
    data = build_chat(options, split="train", seed=0)
    assert len(data) == 6
    for inputs, targets in data:
        assert inputs.shape == targets.shape == (48,)
        assert 0 < (targets != IGNORE).sum() < (inputs != data.pad_id).sum()
