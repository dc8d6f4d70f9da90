"""The model sizes the memory plan traced, kept on disk and keyed by everything they depend on.

Why: tracing a model on the meta device costs ~1.4 s even for a tiny one -- torch's Python meta
kernels import `torch._dynamo` on first call -- and every `trainkit run`, `plan`, `validate` and
`doctor` of a recipe, and every `tune` trial, traced it again before anything else could happen.
The sizes depend only on the model's code and arguments, the batch's shape and the blocks: when
none of those changed, the figure is read back instead.

The key holds: the model block as resolved (its arguments; for every path in it, the file's or
folder's size and modification time), the example batch's shape and dtype, the recipe's block
names, the versions of torch and of the model libraries (torchvision, transformers, peft), and a
stamp of the code that builds and traces the model: trainkit's own source files, and the source
files of the package that defines the model factory unless it is an installed distribution (then
its version). Limits: a model whose code lives in a *third* package, edited in place without a
version change, can be read back stale until that package's version or the model block changes;
`TRAINKIT_CACHE_DIR=` (empty) turns the cache off. Files are written whole (a rename), so a
concurrent launch reads an old entry or none, never a torn one; any unreadable entry is traced
again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Optional

from ..recipe.memory_plan import ModelSizes

FORMAT = 2  # 2: ModelSizes.largest_parameter
LIBRARIES = ("torch", "torchvision", "transformers", "peft")


def cache_dir() -> Optional[Path]:
    """`TRAINKIT_CACHE_DIR` (empty: no cache), else `$XDG_CACHE_HOME/trainkit`, else ~/.cache/trainkit."""
    chosen = os.environ.get("TRAINKIT_CACHE_DIR")
    if chosen is not None:
        return Path(chosen) / "model-sizes" if chosen else None
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainkit" / "model-sizes"


def sizes(key_parts: Optional[dict], measure: Callable[[], ModelSizes]) -> ModelSizes:
    """The cached sizes for `key_parts`, else `measure()` (stored for the next launch). None parts:
    the model's code could not be identified, so nothing is read or written."""
    folder = cache_dir()
    if key_parts is None or folder is None:
        return measure()
    key = hashlib.sha256(json.dumps({"format": FORMAT, **key_parts}, sort_keys=True, default=str)
                         .encode()).hexdigest()
    path = folder / f"{key[:40]}.json"
    try:
        return _checked(ModelSizes(**json.loads(path.read_text())))
    except (OSError, ValueError, TypeError):
        pass
    found = measure()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f".{path.name}.{os.getpid()}")
        part.write_text(json.dumps(dataclasses.asdict(found)))
        os.replace(part, path)
    except OSError:  # a read-only home, a full disk: the plan is still right, only slower next time
        pass
    return found


def _checked(found: ModelSizes) -> ModelSizes:
    """An entry whose fields are not the types the plan computes with (another tool's file, an edit) is
    refused here (ValueError: traced again), never met as a traceback in the plan's arithmetic."""
    for f in dataclasses.fields(found):
        value = getattr(found, f.name)
        kind = str if f.name == "largest_unit_name" else int
        if not (isinstance(value, kind) and not isinstance(value, bool) or value is None and "Optional" in str(f.type)):
            raise ValueError(f"model sizes cache: {f.name} = {value!r}")
    return found


def key_parts(model_block: dict, factory: Any, batch: Optional[tuple], blocks: list[str]) -> Optional[dict]:
    """What the traced sizes depend on; None where the factory's source cannot be told."""
    code = factory_stamp(factory)
    if code is None:
        return None
    return {"model": model_block, "paths": _path_stamps(model_block), "batch": batch, "blocks": blocks,
            "libraries": {name: _version(name) for name in LIBRARIES}, "python": sys.version_info[:2],
            "trainkit": _package_stamp("trainkit"), "factory": code}


def factory_stamp(factory: Any) -> Optional[Any]:
    module = getattr(factory, "__module__", None)
    if not module:
        return None
    top = module.split(".")[0]
    if top in ("trainkit", *LIBRARIES):  # covered by the trainkit stamp and the library versions
        return top
    return _package_stamp(top)


def _package_stamp(top: str) -> Optional[tuple]:
    """(version, or newest mtime and count of its .py files when it is not an installed release; ~2 ms
    for trainkit's 200 files, so it is read each time: a long-lived process sees an edit too)."""
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None)
    if where is None:
        import importlib.util

        spec = importlib.util.find_spec(top)
        where = spec.origin if spec else None
    if where is None:
        return None
    folder = Path(where).parent if Path(where).name == "__init__.py" else Path(where)
    if "site-packages" in folder.parts or "dist-packages" in folder.parts:
        distributions = metadata.packages_distributions().get(top, [])
        if distributions:
            return ("release", _version(distributions[0]))
    files = [folder] if folder.is_file() else list(folder.rglob("*.py"))
    stats = [f.stat() for f in files]
    return ("source", str(folder), len(stats), max((s.st_mtime_ns for s in stats), default=0),
            sum(s.st_size for s in stats))


def _version(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _path_stamps(value: Any) -> list:
    """(path, size, mtime) of every existing file named in the model block; a folder's own files
    (a pretrained directory: its config and weights) one level down."""
    stamps = []
    for text in _strings(value):
        if len(text) > 4096 or "\0" in text:
            continue
        path = Path(text)
        try:
            if path.is_file():
                stamps.append((text, path.stat().st_size, path.stat().st_mtime_ns))
            elif path.is_dir():
                stamps += [(str(f), f.stat().st_size, f.stat().st_mtime_ns)
                           for f in sorted(path.iterdir()) if f.is_file()]
        except OSError:
            continue
    return stamps


def _strings(value: Any):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)
