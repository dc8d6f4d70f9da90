"""Text for language models: local files -> HF `datasets` -> HF `tokenizers` -> packed blocks.

`data: {name: text}` reads plain text (one document per line) or JSONL (a `text_field` per record)
with `datasets.load_dataset("text" | "json", data_files=...)` (offline: local files only), encodes
each document with a `tokenizers` tokenizer file, joins them with the end-of-text token and cuts
the stream into blocks of seq_len + 1 tokens: sample i is (block[:-1], block[1:]). Samples are
indices, so the ResumableDistributedSampler shards them over data-parallel ranks and a resumed run
starts at the exact next block.

`synthetic_corpus` writes a deterministic toy language (a small grammar over invented words) that a
tiny model learns in a minute: the corpus of the tests, the docs and recipes/lm-demo-cpu.yaml.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch.utils.data import Dataset

from ..recipe.blocks import TextData
from ..recipe.model_facts import facts_for

EOS = "<|endoftext|>"


# --------------------------------------------------------------------------- the synthetic language
def synthetic_corpus(documents: int, seed: int, *, stream: int = 0) -> list[str]:
    """`documents` lines of a toy language: subject-verb-object sentences over invented words, with
    agreement (plural nouns take verbs ending in -n) and adjectives tied to nouns, so there is
    structure beyond word frequencies to learn. `seed` fixes the language (its words); `stream`
    picks which documents of it (the held-out split is another stream of the same language)."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "zi", "pe", "sa", "do", "fu", "gri", "bel", "tor"]

    def words(n: int, parts: tuple[int, int]) -> list[str]:
        out: set[str] = set()
        while len(out) < n:
            out.add("".join(rng.choice(syllables) for _ in range(rng.randint(*parts))))
        return sorted(out)

    nouns, verbs, adjectives = words(24, (2, 3)), words(12, (2, 2)), words(10, (1, 2))
    liked = {n: rng.sample(adjectives, 2) for n in nouns}  # each noun takes two adjectives only
    rng = random.Random(f"{seed}/{stream}")

    def phrase() -> tuple[str, bool]:
        noun, plural = rng.choice(nouns), rng.random() < 0.3
        adj = f"{rng.choice(liked[noun])} " if rng.random() < 0.5 else ""
        return f"{'the' if rng.random() < 0.7 else 'a'} {adj}{noun}{'s' if plural else ''}", plural

    docs = []
    for _ in range(documents):
        sentences = []
        for _ in range(rng.randint(1, 3)):
            subject, plural = phrase()
            verb = rng.choice(verbs) + ("n" if plural else "")
            sentences.append(f"{subject} {verb} {phrase()[0]}.")
        docs.append(" ".join(sentences).capitalize())
    return docs


def write_corpus(folder: Path, *, documents: int, seed: int) -> tuple[Path, Path]:
    """train.txt (`documents` lines) and eval.txt (a tenth as many, other documents of the same
    language) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    train, held_out = folder / "train.txt", folder / "eval.txt"
    _write_atomic(train, "\n".join(synthetic_corpus(documents, seed)) + "\n")
    _write_atomic(held_out, "\n".join(synthetic_corpus(max(1, documents // 10), seed, stream=1)) + "\n")
    return train, held_out


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- reading and tokenizing
def file_format(path: str, fmt: str = "auto") -> str:
    """'json' or 'text' (the `datasets` builder names)."""
    if fmt == "jsonl" or (fmt == "auto" and Path(path).suffix.lower() in (".jsonl", ".json")):
        return "json"
    return "text"


def read_texts(files: list[str], *, fmt: str = "auto", text_field: str = "text") -> list[str]:
    """The documents of local files through `datasets` (offline; a private throw-away cache, so
    concurrent ranks never share one). Empty lines are not documents."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    builder = file_format(files[0], fmt)
    paths = [str(Path(f).expanduser().resolve()) for f in files]
    with tempfile.TemporaryDirectory(prefix="trainkit-text-") as cache:
        verbosity = datasets.logging.get_verbosity()
        datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its own log of a bad line: ours says file:line
        try:
            ds = datasets.load_dataset(builder, data_files=paths, split="train", cache_dir=cache, keep_in_memory=True)
        except Exception as exc:  # noqa: BLE001 - datasets wraps a parse error in a long chain: say file:line
            where = _first_bad_record(files) if builder == "json" else None
            cause = exc.__cause__ or exc
            raise ValueError(where or f"{', '.join(files)}: cannot be read as {builder} ({cause})") from None
        finally:
            datasets.logging.set_verbosity(verbosity)
        field = "text" if builder == "text" else text_field
        if field not in ds.column_names:
            raise ValueError(f"{', '.join(files)}: the JSONL records have no field '{field}' (fields: "
                             f"{', '.join(ds.column_names)}); set data.text_field")
        return [t for t in ds[field] if isinstance(t, str) and t.strip()]


def _first_bad_record(files: list[str]) -> Optional[str]:
    """`FILE:LINE: why` for the first line of these JSONL files that is not one JSON object (a file that is
    one JSON document, which `datasets` also reads, is skipped), or None. Only read after `datasets` failed."""
    import json

    for file in files:
        with open(Path(file).expanduser(), encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    why = f"not JSON ({exc.msg} at column {exc.colno})"
                else:
                    if isinstance(record, dict):
                        continue
                    why = "JSON, but not an object"
                try:
                    fh.seek(0)
                    json.load(fh)
                    break  # one JSON document, not JSONL
                except ValueError:
                    return f"{file}:{number}: {why}; each line of a JSONL file is one JSON object"
    return None


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # DataLoader workers fork after encoding
    return Tokenizer.from_file(str(Path(path).expanduser()))


def train_tokenizer(files: list[str], out: Path, *, vocab_size: int, fmt: str = "auto", text_field: str = "text",
                    min_frequency: int = 2) -> Path:
    """A byte-level BPE (GPT-2 style, so any text round-trips) trained on the files, with the
    end-of-text token, written as one tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    texts = read_texts(files, fmt=fmt, text_field=text_field)
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[EOS], show_progress=False)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tokenizer.save(str(tmp))
    os.replace(tmp, out)
    return out


def encode(texts: list[str], tokenizer) -> torch.Tensor:
    """One stream of token ids: each document followed by the end-of-text token (when it has one)."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class PackedTokens(Dataset):
    """Sample i: tokens[i*T : i*T+T] and the same shifted by one (T = seq_len); the tail that does
    not fill a block is dropped, so every sample has exactly T counted targets."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.blocks = max(0, (len(tokens) - 1) // seq_len)

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(i) * self.seq_len
        chunk = self.tokens[start:start + self.seq_len + 1]
        return chunk[:-1].clone(), chunk[1:].clone()


# --------------------------------------------------------------------------- the dataset builder
def corpus_missing(options: TextData) -> bool:
    paths = [*options.files, *options.eval_files, options.tokenizer]
    return any(not Path(p).expanduser().is_file() for p in paths)


def prepare(options: TextData) -> None:
    """With `generate`: write the synthetic corpus and train its tokenizer if any file is missing.
    In a process group rank 0 writes (atomically) while the others wait at a barrier."""
    import torch.distributed as dist

    if options.generate is None:
        return
    group = dist.is_available() and dist.is_initialized()
    if (not group or dist.get_rank() == 0) and corpus_missing(options):
        g = options.generate
        train, held_out = Path(options.files[0]).expanduser(), None
        folder = train.parent
        write_corpus(folder, documents=g.documents, seed=g.seed)
        if train.name != "train.txt":
            os.replace(folder / "train.txt", train)
        if options.eval_files:
            held_out = Path(options.eval_files[0]).expanduser()
            if held_out != folder / "eval.txt":
                held_out.parent.mkdir(parents=True, exist_ok=True)
                os.replace(folder / "eval.txt", held_out)
        train_tokenizer([str(train)], Path(options.tokenizer).expanduser(), vocab_size=g.vocab_size)
        print(f"trainkit: wrote a synthetic corpus ({g.documents} documents) to {folder} and trained its "
              f"tokenizer {options.tokenizer}", flush=True)
    if group:
        dist.barrier()


def build_text(options: TextData, *, split: str, seed: int) -> Optional[Dataset]:
    files = options.files if split == "train" else options.eval_files
    if not files:
        return None
    prepare(options)
    tokens = encode(read_texts(files, fmt=options.format, text_field=options.text_field),
                    load_tokenizer(options.tokenizer))
    data = PackedTokens(tokens, options.seq_len)
    if len(data) == 0:
        raise ValueError(f"{', '.join(files)}: {len(tokens)} tokens do not fill one block of seq_len "
                         f"{options.seq_len} + 1")
    return data


def tokenizer_vocab_size(path: str) -> int:
    """Ids the tokenizer can produce (its vocabulary plus added tokens)."""
    return load_tokenizer(path).get_vocab_size(with_added_tokens=True)


def iter_jsonl_missing_field(files: list[str], field: str, limit: int = 1000) -> Iterator[tuple[str, int]]:
    """(file, line number) of the first records (up to `limit` per file) that lack `field`."""
    import json

    for f in files:
        with open(Path(f).expanduser(), encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if lineno > limit:
                    break
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # datasets reports malformed JSON itself
                if not isinstance(record, dict) or field not in record:
                    yield f, lineno
                    break


# --------------------------------------------------------------------------- preflight
def preflight_text(r) -> Iterator[tuple[tuple, str, str]]:
    """Text data's checks before a run (runtime.preflight calls `build_text.preflight`): the files
    exist, JSONL records have the text field, and the tokenizer fits the model's vocabulary."""
    d = r.data
    try:
        vocab = facts_for(r.model.name).vocab_and_positions(r.model.args)[0]
    except Exception:  # reported by preflight's model checks
        vocab = None
    generated = d.generate is not None
    for key in ("files", "eval_files"):
        for i, f in enumerate(getattr(d, key)):
            if not Path(f).expanduser().is_file() and not generated:
                yield ("data", key, i), f"text file not found: {f} (absolute: {Path(f).expanduser().resolve()}); " \
                    f"or set data.generate to write a synthetic corpus there", "error"
    present = [f for f in [*d.files, *d.eval_files] if Path(f).expanduser().is_file()]
    jsonl = [f for f in present if file_format(f, d.format) == "json"]
    for f, line in iter_jsonl_missing_field(jsonl, d.text_field):
        yield ("data", "text_field"), f"{f}:{line}: the record has no field '{d.text_field}'; set " \
            f"data.text_field to the field that holds the text", "error"
    tokenizer = Path(d.tokenizer).expanduser()
    ids = None
    if tokenizer.is_file():
        try:
            ids = tokenizer_vocab_size(str(tokenizer))
        except Exception as exc:
            yield ("data", "tokenizer"), f"{tokenizer} is not a tokenizers file: {type(exc).__name__}: {exc}", "error"
    elif generated:
        ids = d.generate.vocab_size
    else:
        yield ("data", "tokenizer"), f"tokenizer file not found: {d.tokenizer} (absolute: {tokenizer.resolve()}); " \
            f"train one with `trainkit data train-tokenizer {' '.join(d.files)} --out {d.tokenizer} " \
            f"--vocab-size {vocab or 32000}`", "error"
    if ids is not None and isinstance(vocab, int) and ids > vocab:
        where = "data.generate.vocab_size" if not tokenizer.is_file() else f"the tokenizer {d.tokenizer}"
        yield ("data", "tokenizer"), f"{where} has {ids} tokens but the model's vocabulary has {vocab}: " \
            f"token ids past {vocab - 1} have no embedding; use a model vocab_size >= {ids} or another " \
            f"tokenizer", "error"


build_text.preflight = preflight_text  # the dataset component's hook (runtime.preflight._data)
