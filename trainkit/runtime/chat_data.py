"""`data: {name: chat}`: conversations rendered with the tokenizer's own chat template, the loss on the
assistant's tokens only (trainkit.recipe.blocks.data.ChatData).

Which tokens are the assistant's: the conversation is rendered turn by turn with the template
(transformers' `apply_chat_template`, the template from the tokenizer directory's config), and the
tokens each assistant turn adds after the prompt that asks for it (`add_generation_prompt=True`) are
counted; everything else -- system and user turns, the template's role headers, padding -- gets the
target IGNORE. This assumes the template renders a conversation's prefix as a prefix of the whole,
which templates that render turns independently (Llama, Qwen, Mistral, ChatML) do; a conversation
where it does not hold is refused with its line number rather than masked wrongly.

Each conversation is its own sequence, truncated to seq_len or padded up to it; with `packing: true`
several share a sequence, with position ids that restart at each, which Hugging Face models honour as
boundaries (runtime.packed_sequences): no sample attends to another either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import Dataset

from ..models.inputs import TokensWithPositions
from .packed_sequences import IGNORE, pack, shifted  # IGNORE: the causal_lm task's default ignore_index


class ChatDataError(ValueError):
    """A conversation that cannot be rendered; the message names the file and line."""


def load_chat_tokenizer(directory: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(directory).expanduser()), local_files_only=True,
                                              trust_remote_code=False)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatDataError(f"{directory}: the tokenizer has no chat template (tokenizer_config.json's chat_template)")
    return tokenizer


def conversations(files: list[str], options: Any) -> Iterator[tuple[str, int, list[dict]]]:
    """(file, line, messages) of every record: its messages field, or prompt/response as two turns."""
    for file in files:
        with open(Path(file).expanduser(), encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ChatDataError(f"{file}:{line_no}: not JSON ({exc})") from None
                yield file, line_no, messages_of(record, options, f"{file}:{line_no}")


def messages_of(record: Any, options: Any, where: str) -> list[dict]:
    if not isinstance(record, dict):
        raise ChatDataError(f"{where}: not a JSON object")
    if options.messages_field in record:
        messages = record[options.messages_field]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise ChatDataError(f"{where}: {options.messages_field} must be a list of {{role, content}} strings")
        return messages
    if options.prompt_field in record and options.response_field in record:
        return [{"role": "user", "content": str(record[options.prompt_field])},
                {"role": "assistant", "content": str(record[options.response_field])}]
    raise ChatDataError(f"{where}: no '{options.messages_field}' and no '{options.prompt_field}'/"
                        f"'{options.response_field}' fields")


def _ids(tokenizer, messages: list[dict], *, generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # newer transformers return a BatchEncoding
        out = out["input_ids"]
    return list(out)


def render(tokenizer, messages: list[dict], where: str) -> tuple[list[int], list[bool]]:
    """The conversation's token ids and, per token, whether it is the assistant's (counted)."""
    ids: list[int] = []
    counted: list[bool] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(tokenizer, messages[:i], generation_prompt=True)
        whole = _ids(tokenizer, messages[:i + 1], generation_prompt=False)
        if whole[:len(prompt)] != prompt or prompt[:len(ids)] != ids:
            raise ChatDataError(f"{where}: the chat template does not render this conversation's turns as prefixes "
                                "of the whole, so the assistant's tokens cannot be told apart")
        counted += [False] * (len(prompt) - len(ids)) + [True] * (len(whole) - len(prompt))
        ids = whole
    full = _ids(tokenizer, messages, generation_prompt=False)
    if full[:len(ids)] != ids:
        raise ChatDataError(f"{where}: the chat template does not render this conversation's turns as prefixes "
                            "of the whole")
    counted += [False] * (len(full) - len(ids))
    return full, counted


class ChatSequences(Dataset):
    """Sample i: (input ids [T], targets [T]): the conversation's tokens and the next token where it is the
    assistant's, IGNORE elsewhere; truncated or padded (pad id, IGNORE) to T = seq_len."""

    def __init__(self, rendered: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        self.items = rendered
        self.seq_len, self.pad_id = seq_len, pad_id

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, counted = self.items[int(i)]
        T = self.seq_len
        inputs, targets = shifted(ids, counted, T)
        pad = T - len(inputs)
        return (torch.tensor(inputs + [self.pad_id] * pad, dtype=torch.long),
                torch.tensor(targets + [IGNORE] * pad, dtype=torch.long))


class PackedChatSequences(Dataset):
    """Sample i: (TokensWithPositions(input ids [T], position ids [T]), targets [T]): row i of the conversations
    packed whole into rows of T = seq_len (runtime.packed_sequences)."""

    def __init__(self, rendered: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int):
        self.rows = pack(rendered, seq_len, pad_id)
        self.conversations = len(rendered)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> tuple[TokensWithPositions, torch.Tensor]:
        inputs, targets, positions = self.rows[int(i)]
        return (TokensWithPositions(torch.tensor(inputs, dtype=torch.long), torch.tensor(positions, dtype=torch.long)),
                torch.tensor(targets, dtype=torch.long))


def build_chat(options: Any, *, split: str, seed: int) -> Optional[Dataset]:
    files = options.files if split == "train" else options.eval_files
    if not files:
        return None
    tokenizer = load_chat_tokenizer(options.tokenizer)
    rendered = [render(tokenizer, messages, f"{file}:{line}") for file, line, messages in conversations(files, options)]
    if not any(any(c[1:options.seq_len + 1]) for _, c in rendered):
        raise ChatDataError(f"{', '.join(files)}: no assistant token within the first seq_len {options.seq_len} "
                            "tokens of any conversation: nothing to learn")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    return (PackedChatSequences if options.packing else ChatSequences)(rendered, options.seq_len, pad)


def preflight_chat(r) -> Iterator[tuple[tuple, str, str]]:
    """Before launch: the files exist and every record renders; the tokenizer directory has a chat
    template; the task's ignore_index is the one the dataset writes."""
    d = r.data
    for key in ("files", "eval_files"):
        for i, f in enumerate(getattr(d, key)):
            if not Path(f).expanduser().is_file():
                yield ("data", key, i), f"chat file not found: {f} (absolute: {Path(f).expanduser().resolve()})", \
                    "error"
    if getattr(r.task, "ignore_index", IGNORE) != IGNORE:
        yield ("task", "ignore_index"), f"chat data marks the targets that do not count with {IGNORE}; set " \
            f"task.ignore_index: {IGNORE}", "error"
    if not Path(d.tokenizer).expanduser().is_dir():
        yield ("data", "tokenizer"), f"tokenizer directory not found: {d.tokenizer} (a Hugging Face tokenizer " \
            "directory with a chat template, e.g. the pretrained model's)", "error"
        return
    try:
        tokenizer = load_chat_tokenizer(d.tokenizer)
        present = [f for f in [*d.files, *d.eval_files] if Path(f).expanduser().is_file()]
        for file, line, messages in conversations(present, d):
            render(tokenizer, messages, f"{file}:{line}")
    except ChatDataError as exc:
        yield ("data", "files"), str(exc), "error"
    except (OSError, ValueError) as exc:
        yield ("data", "tokenizer"), f"{d.tokenizer}: not a usable tokenizer directory ({type(exc).__name__}: " \
            f"{exc})", "error"


build_chat.preflight = preflight_chat  # the dataset component's hook (runtime.preflight._data)
