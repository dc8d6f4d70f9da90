"""Chat data (issue 39): conversations rendered with the tokenizer's own chat template, the loss on the
assistant's tokens only, no sample attending to another (one conversation per sequence, or packed with
position ids that restart at each: runtime/packed_sequences.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from chat_fixtures import save_chat_tokenizer, write_chat

pytest.importorskip("transformers")

OPTIONS = SimpleNamespace(messages_field="messages", prompt_field="prompt", response_field="response", packing=False)


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


def test_packing_puts_whole_conversations_in_each_row_with_positions_restarting(tmp_path, tokenizer_dir):
    from trainkit.runtime.chat_data import IGNORE, build_chat
    from trainkit.models.inputs import TokensWithPositions

    path = write_chat(tmp_path / "chat.jsonl", 24, seed=0)
    common = dict(files=[str(path)], eval_files=[], tokenizer=tokenizer_dir, seq_len=128)
    padded = build_chat(SimpleNamespace(**common, **vars(OPTIONS)), split="train", seed=0)
    packed = build_chat(SimpleNamespace(**common, **{**vars(OPTIONS), "packing": True}), split="train", seed=0)
    assert len(packed) <= len(padded) / 2  # conversations of 36-68 tokens: two or more per row of 128
    rows = [packed[i] for i in range(len(packed))]
    assert all(isinstance(x, TokensWithPositions) and x.tokens.shape == x.position_ids.shape == y.shape == (128,)
               for x, y in rows)
    # the rows hold every conversation once, whole and in order: its inputs and targets, positions from 0
    pieces = []
    for x, y in rows:
        starts = [i for i, p in enumerate(x.position_ids.tolist()) if p == 0] + [128]
        pieces += [(x.tokens[a:b].tolist(), y[a:b].tolist()) for a, b in zip(starts, starts[1:])]
    alone = [(xs[:n].tolist(), ys[:n].tolist()) for xs, ys in padded
             for n in [int((xs != padded.pad_id).sum())]]
    assert [p for p in pieces if any(t != IGNORE for t in p[1])] == alone
    counted = sum(int((y != IGNORE).sum()) for _, y in rows)
    assert counted == sum(int((y != IGNORE).sum()) for _, y in padded)  # the loss counts the same tokens


def test_a_packed_row_gives_each_conversation_the_logits_it_has_alone(tmp_path, tokenizer_dir):
    """The effect packing must not have: a conversation attending to the one before it in its row. A
    transformers Llama through trainkit's wrapper: every conversation's logits in a packed row equal its
    logits run alone (fp32)."""
    import torch

    from trainkit.models.hf import hf_causal_lm
    from trainkit.runtime.chat_data import build_chat

    torch.manual_seed(0)
    model = hf_causal_lm(config={"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
                                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "max_position_embeddings": 128}).eval()
    path = write_chat(tmp_path / "chat.jsonl", 6, seed=1)
    common = dict(files=[str(path)], eval_files=[], tokenizer=tokenizer_dir, seq_len=128)
    packed = build_chat(SimpleNamespace(**common, **{**vars(OPTIONS), "packing": True}), split="train", seed=0)
    padded = build_chat(SimpleNamespace(**common, **vars(OPTIONS)), split="train", seed=0)
    x, _ = packed[0]
    starts = [i for i, p in enumerate(x.position_ids.tolist()) if p == 0]
    assert len(starts) >= 3  # at least two conversations and the padding after them
    with torch.no_grad():
        together = model(type(x)(x.tokens[None], x.position_ids[None]))[0]
        for k, (a, b) in enumerate(zip(starts, starts[1:])):
            alone_tokens = padded[k][0][: b - a]
            alone = model(alone_tokens[None])[0]
            assert torch.equal(alone_tokens, x.tokens[a:b])
            torch.testing.assert_close(together[a:b], alone, rtol=1e-5, atol=1e-5)
        # without the position ids the same row mixes them: the check can fail
        mixed = model(x.tokens[None])[0]
        a, b = starts[1], starts[2]
        assert not torch.allclose(mixed[a:b], model(padded[1][0][: b - a][None])[0], atol=1e-3)


def test_validate_refuses_packing_where_samples_could_not_be_kept_apart(tmp_path, tokenizer_dir, corpus, capsys):
    from run_helpers import write_recipe

    from trainkit.cli import main

    path = write_chat(tmp_path / "chat.jsonl", 4, seed=0)
    base = {"task": {"name": "causal_lm"}, "optimizer": {"name": "adamw", "lr": 1e-3}, "trainer": {"max_steps": 2},
            "launch": {"nproc_per_node": 2}, "tracking": {"enabled": False},
            "data": {"name": "chat", "files": [str(path)], "tokenizer": tokenizer_dir, "seq_len": 64, "batch_size": 2,
                     "packing": True}}
    builtin = write_recipe(tmp_path, "builtin", base, strategy={"name": "ddp"},
                           model={"name": "transformer", "args": {"vocab_size": 320, "dim": 32, "layers": 2,
                                                                  "heads": 2, "seq_len": 64}})
    assert main(["validate", str(builtin)]) == 2
    err = capsys.readouterr().err
    assert "data.packing with model transformer is refused: its attention is causal over the whole sequence" in err
    hf = {"name": "hf_causal_lm", "args": {"config": {"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                                                      "intermediate_size": 64, "num_hidden_layers": 2,
                                                      "num_attention_heads": 2, "max_position_embeddings": 64}}}
    staged = write_recipe(tmp_path, "staged", base, model=hf, strategy={"name": "pipeline", "split_points": ["model.layers.1"]})
    assert main(["validate", str(staged)]) == 2
    assert "data.packing with strategy pipeline is refused" in capsys.readouterr().err
    fine = write_recipe(tmp_path, "fine", base, model=hf, strategy={"name": "fsdp"})
    assert main(["validate", str(fine)]) == 0, capsys.readouterr()
