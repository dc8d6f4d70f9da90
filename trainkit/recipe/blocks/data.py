"""Dataset options: the `data:` block of each built-in dataset plugin."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Iterator, Literal, Optional

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from ..paths import read_path_shown
from ..pickle_check import unsafe_globals
from .base import Block, Finding, PluginBlock, PreflightFinding

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def scan_imagefolder(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Classes (sorted sub-folders) and (file, class index) pairs, like torchvision's ImageFolder."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    samples = [(f, i) for i, c in enumerate(classes) for f in sorted((root / c).rglob("*"))
               if f.suffix.lower() in IMAGE_EXTENSIONS and f.is_file()]
    return classes, samples


class DataOptions(PluginBlock):
    """DataLoader settings shared by every dataset. `batch_size` is per device."""

    batch_size: PositiveInt = Field(description="samples per device per micro-step")
    num_workers: NonNegativeInt = Field(default=0, description="DataLoader worker processes per rank")
    pin_memory: bool = Field(default=False, description="page-locked host memory (faster host-to-GPU copies)")
    prefetch_factor: Optional[PositiveInt] = Field(default=None, description="batches prefetched per worker")
    persistent_workers: bool = Field(default=False, description="keep workers alive across epochs")
    drop_last: bool = Field(default=True, description="drop the last incomplete batch of each epoch")
    shuffle: bool = Field(default=True, description="shuffle each epoch (DistributedSampler, seeded)")

    # what one batch is: "labelled" (input, label) pairs or "tokens" (token sequences); tasks declare
    # which they accept (TaskOptions.accepts)
    batches: ClassVar[str] = "labelled"

    def train_size(self) -> Optional[int]:
        """Training samples, where knowable without decoding anything (plan, preflight); None if unknown."""
        return None

    def sample_shape(self) -> Optional[list[int]]:
        """The shape of one input sample, where the options say it (the pipeline tracer, doctor's memory)."""
        return None

    def loading_work(self) -> str:
        """What loading a sample costs the CPU, in words (the bottleneck report's reason for loader worker
        processes), or "" where the samples are already in memory and nothing is read or decoded."""
        return "reading, decoding and augmenting each sample"

    def device_loading(self, device: str) -> Optional[tuple[dict, dict, str]]:
        """Where the loader cannot keep up on the host's CPUs: a change of these options that moves the
        per-sample work onto the run's `device` ("cuda", "cpu"), as (changes, current values, what it
        does), or None. The bottleneck report offers it (analysis.advice.data_advice)."""
        return None

    def rules(self, recipe: Any) -> Iterator[Finding]:
        """Cross-field rules of this dataset against the whole recipe (validate; no torch)."""
        return iter(())

    def preflight(self) -> Iterator[PreflightFinding]:
        """Checks of the files this dataset reads (run, plan, validate --deep): (path, message, severity)."""
        return iter(())

    def written_paths(self) -> Iterator[Finding]:
        """(recipe path, value) of every file this dataset writes (confined by the rules: recipe/paths.py)."""
        return iter(())

    def fix_missing_folder(self, value: str, where: str) -> str:
        """What `trainkit doctor` suggests when a data folder does not exist."""
        return f"point {where} at the dataset folder"

    def fix_layout(self, root: Path, where: str) -> str:
        """What `trainkit doctor` suggests when a data folder's layout is wrong."""
        return f"arrange it as {root}/<class>/<image>.jpg, or fix {where}"

    layout_note: ClassVar[str] = ""  # doctor's note on a readable folder with the right layout


class SyntheticData(DataOptions):
    """Deterministic random tensors: for smoke tests and framework-overhead benchmarks."""

    component: ClassVar[str] = "trainkit.runtime.data:build_synthetic"
    name: Literal["synthetic"]
    num_samples: PositiveInt = Field(default=1024, description="dataset length")
    shape: list[PositiveInt] = Field(default_factory=lambda: [3, 32, 32], min_length=1,
                                     description="shape of one input sample")
    num_classes: PositiveInt = Field(default=10, description="labels are drawn from [0, num_classes)")
    sleep_ms: NonNegativeFloat = Field(default=0.0, description="artificial per-sample latency (planted-fault tests)")

    def train_size(self) -> Optional[int]:
        return self.num_samples

    def sample_shape(self) -> Optional[list[int]]:
        return list(self.shape)

    def loading_work(self) -> str:
        return "the planted per-sample delay, data.sleep_ms" if self.sleep_ms else ""  # generated in memory

    def rules(self, recipe: Any) -> Iterator[Finding]:
        if recipe.performance.channels_last and len(self.shape) != 3:
            yield ("performance", "channels_last"), (
                f"channels_last needs 4-D inputs (batch, channels, height, width); data.shape {list(self.shape)} "
                f"makes {len(self.shape) + 1}-D batches: set it to false, or use a [C, H, W] shape")


class ImageFolderData(DataOptions):
    """A folder of class sub-folders of JPEG/PNG images (the ImageNet layout)."""

    component: ClassVar[str] = "trainkit.runtime.data:build_imagefolder"
    name: Literal["imagefolder"]
    root: str = Field(description="training folder: ROOT/<class>/<image>")
    val_root: Optional[str] = Field(default=None, description="evaluation folder with the same layout")
    image_size: PositiveInt = Field(default=224, description="side of the square crop fed to the model")
    on_corrupt: Literal["error", "skip"] = Field(
        default="error", description="what to do with an unreadable image: fail, or skip it and count it"
    )
    decode: Literal["loader", "device"] = Field(
        default="loader", description="where JPEGs are decoded and augmented: in the loader's processes (PIL), "
        "or on the rank's device in one batched call (torchvision decode_jpeg: nvJPEG on CUDA), the loader "
        "then only reading files; for GPUs whose loader cannot keep up (docs/performance.md)")
    layout_note: ClassVar[str] = ", class folders with images"

    def loading_work(self) -> str:
        if self.decode == "device":
            return "reading the files (their decoding is on the device)"
        return "decoding and augmentation"

    def device_loading(self, device: str) -> Optional[tuple[dict, dict, str]]:
        if device != "cuda" or self.decode == "device":
            return None
        return ({"data.decode": "device"}, {"data.decode": self.decode},
                "decoding the JPEGs on the GPU in one batched call (nvJPEG) leaves the loader processes only "
                "reading files (20x less work per 320 px JPEG measured on a CPU core, docs/benchmarks.md)")

    def train_size(self) -> Optional[int]:
        root = Path(self.root).expanduser()
        try:
            return len(scan_imagefolder(root)[1]) if root.is_dir() else 0
        except OSError:
            return None

    def sample_shape(self) -> Optional[list[int]]:
        return [3, self.image_size, self.image_size]

    def rules(self, recipe: Any) -> Iterator[Finding]:
        if recipe.trainer.eval_every is not None and self.val_root is None:
            yield ("trainer", "eval_every"), "evaluation needs data.val_root (a folder of held-out images)"

    def preflight(self) -> Iterator[PreflightFinding]:
        for key in ("root", "val_root"):
            value = getattr(self, key)
            if value is None:
                continue
            root = Path(value).expanduser()
            if not root.is_dir():
                yield ("data", key), f"data folder not found: {read_path_shown(value)}; " \
                    f"make a small one with `trainkit data make-imagefolder {value}`", "error"
                continue
            classes, samples = scan_imagefolder(root)
            if not classes:
                yield ("data", key), f"{root} has no class sub-folders (expected {root}/<class>/<image>)", "error"
            elif not samples:
                yield ("data", key), f"{root} has {len(classes)} class folders but no images " \
                    f"({', '.join(IMAGE_EXTENSIONS)})", "error"

    def fix_missing_folder(self, value: str, where: str) -> str:
        return f"point {where} at the dataset folder, or make a small one: trainkit data make-imagefolder {value}"


class Cifar10Data(DataOptions):
    """CIFAR-10 from a local folder holding `cifar-10-batches-py` (never downloaded)."""

    component: ClassVar[str] = "trainkit.runtime.data:build_cifar10"
    name: Literal["cifar10"]
    root: str = Field(description="folder containing cifar-10-batches-py/")

    def train_size(self) -> Optional[int]:
        return 50_000

    def sample_shape(self) -> Optional[list[int]]:
        return [3, 32, 32]

    def loading_work(self) -> str:
        return "normalisation and random flips"  # the arrays are in memory: nothing is decoded

    def preflight(self) -> Iterator[PreflightFinding]:
        folder = Path(self.root).expanduser() / "cifar-10-batches-py"
        missing = [n for n in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"] if not (folder / n).is_file()]
        if missing:
            yield ("data", "root"), f"CIFAR-10 not found: {folder} lacks {', '.join(missing)} (trainkit never " \
                f"downloads; unpack cifar-10-python.tar.gz into {read_path_shown(self.root)})", "error"
            return
        for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
            unsafe = unsafe_globals(folder / name)
            if unsafe:
                yield ("data", "root"), f"{folder / name} is not plain CIFAR-10 data: it names " \
                    f"{', '.join(unsafe)}, which would run code when loaded (only NumPy arrays are accepted)", "error"

    def fix_layout(self, root: Path, where: str) -> str:
        return f"unpack cifar-10-python.tar.gz into {root}, or fix {where}"


class TextCorpusOptions(Block):
    """A deterministic synthetic-language corpus written on first use (tests, docs, the LM demo)."""

    documents: PositiveInt = Field(default=2000, description="training documents (eval gets a tenth more)")
    seed: int = Field(default=0, description="corpus generator seed")
    vocab_size: PositiveInt = Field(default=512, ge=260, description="byte-level BPE vocabulary trained on it")


class TextData(DataOptions):
    """Local text (one document per line) or JSONL files, tokenized and packed into seq_len blocks."""

    component: ClassVar[str] = "trainkit.runtime.text_data:build_text"
    name: Literal["text"]
    files: list[str] = Field(min_length=1, description="training files (.txt: a document per line; .jsonl)")
    eval_files: list[str] = Field(default_factory=list, description="held-out files for eval perplexity")
    format: Literal["auto", "text", "jsonl"] = Field(default="auto", description="auto: .jsonl/.json is JSONL")
    text_field: str = Field(default="text", description="the JSONL field holding the text")
    tokenizer: str = Field(description="tokenizer.json of HF `tokenizers` (e.g. from `trainkit data train-tokenizer`)")
    seq_len: PositiveInt = Field(description="tokens per training sequence (inputs; targets are shifted by one)")
    generate: Optional[TextCorpusOptions] = Field(
        default=None, description="write a synthetic corpus and train its tokenizer when the files are missing")

    batches: ClassVar[str] = "tokens"

    def loading_work(self) -> str:
        return ""  # tokenized and packed into memory when the dataset is built

    def written_paths(self) -> Iterator[Finding]:
        if self.generate is None:  # read only
            return
        for key in ("files", "eval_files"):
            for i, value in enumerate(getattr(self, key)):
                yield ("data", key, i), value
        yield ("data", "tokenizer"), self.tokenizer

    def rules(self, recipe: Any) -> Iterator[Finding]:
        if self.batches not in recipe.task.accepts:
            yield ("data", "name"), (f"text data yields token sequences, not (input, label) pairs, so it cannot "
                                     f"train task {recipe.task.name}"
                                     + (" (the default)" if "task" not in recipe.model_fields_set else "")
                                     + "; set task: {name: causal_lm}")
        if self.generate is not None:
            if len(self.files) != 1:
                yield ("data", "files"), "data.generate writes one training file: list exactly one in data.files"
            if len(self.eval_files) > 1:
                yield ("data", "eval_files"), ("data.generate writes one held-out file: list at most one in "
                                               "data.eval_files")


class ChatData(DataOptions):
    """Chat or instruction JSONL for supervised fine-tuning: a `messages` list ({role, content}) rendered
    with the tokenizer's own chat template, or `prompt`/`response` fields (one user turn, one assistant
    turn). The loss counts the assistant's tokens only. Each sample is its own sequence (truncated to, or
    padded up to, seq_len), or with `packing` several share one, kept apart by position ids that restart
    at each (runtime.packed_sequences): no sample ever attends to another."""

    component: ClassVar[str] = "trainkit.runtime.chat_data:build_chat"
    name: Literal["chat"]
    files: list[str] = Field(min_length=1, description="training JSONL files (one conversation per line)")
    eval_files: list[str] = Field(default_factory=list, description="held-out JSONL files (eval loss on responses)")
    tokenizer: str = Field(description="a Hugging Face tokenizer directory with a chat template (tokenizer.json + "
                                       "tokenizer_config.json, as save_pretrained writes; e.g. the pretrained "
                                       "model's own directory)")
    seq_len: PositiveInt = Field(description="tokens per sequence: longer conversations are truncated, shorter "
                                             "padded (padding never counts)")
    messages_field: str = Field(default="messages", description="the JSONL field holding the conversation")
    prompt_field: str = Field(default="prompt", description="without messages: the user's turn")
    response_field: str = Field(default="response", description="without messages: the assistant's turn")
    packing: bool = Field(default=False, description="put whole conversations into each seq_len sequence, position "
                                                     "ids restarting at each (no sample attends to another), "
                                                     "instead of one padded conversation per sequence: fewer "
                                                     "padding positions, more conversations per step")

    batches: ClassVar[str] = "tokens"

    def loading_work(self) -> str:
        return ""  # rendered and tokenized into memory when the dataset is built

    def rules(self, recipe: Any) -> Iterator[Finding]:
        if self.batches not in recipe.task.accepts:
            yield ("data", "name"), (f"chat data yields token sequences, so it cannot train task {recipe.task.name}; "
                                     "set task: {name: causal_lm}")
        if self.packing:
            yield from packing_refusals(recipe)


def packing_refusals(recipe: Any) -> Iterator[Finding]:
    """Where packed sequences (TokensWithPositions: token ids with restarting position ids) cannot be kept apart."""
    from ..model_facts import facts_for

    why = facts_for(recipe.model.name).packing_refusal
    if why:
        yield ("data", "packing"), f"data.packing with model {recipe.model.name} is refused: {why}"
    if recipe.strategy.capabilities().splits_model:
        yield ("data", "packing"), (f"data.packing with strategy {recipe.strategy.name} is refused: its stages pass "
                                    "one activation tensor on, so the position ids that keep packed samples apart "
                                    "do not reach the later stages; set data.packing: false")
    if recipe.parallel is not None and isinstance(recipe.parallel.tp, int) and recipe.parallel.tp > 1:
        yield ("data", "packing"), ("data.packing with tensor parallel is refused: not verified (the position ids "
                                    "would have to reach every tp rank's attention alike); set data.packing: false, "
                                    "or parallel.tp: 1")
