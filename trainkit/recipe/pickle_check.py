"""Pickled data files that stay data: which globals a pickle names, and an unpickler that admits
only the documented ones.

`pickle.load` runs whatever callable a file names, so a CIFAR-10 folder shipped in a pull request
(`data: {name: cifar10, root: ./evil}`) would run its code in `trainkit run`. The CIFAR-10 python
batches name only NumPy's array reconstruction; `globals_in` lists a file's globals without
executing anything (pickletools reads the opcodes), so `validate`/`plan`/`doctor` refuse a folder
that names anything else, and `SafeUnpickler` refuses it at load time too.
"""

from __future__ import annotations

import pickle
import pickletools
from pathlib import Path
from typing import BinaryIO, Iterator

# (module, name) a NumPy array pickle needs (NumPy 1 and 2 spell the module differently)
NUMPY_ARRAYS = frozenset({
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),  # protocol 5 arrays
    ("_codecs", "encode"),  # protocol-2 pickles written by Python 3 rebuild bytes with it (text -> bytes)
})


class UnsafePickle(Exception):
    """A pickle names a global outside the allowed set (it would run code on load)."""


def globals_in(fh: BinaryIO) -> Iterator[tuple[str, str]]:
    """The (module, name) pairs a pickle stream imports, read from its opcodes without running them.

    STACK_GLOBAL takes its two names from the stack, where they may come from the memo; so the
    values pushed are followed (strings, memo gets), everything else counts as "not a string"."""
    pushed: list = []
    memo: dict = {}
    for opcode, arg, _ in pickletools.genops(fh):
        name = opcode.name
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            yield module, attr
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            module, attr = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)
            yield (module if isinstance(module, str) else "?", attr if isinstance(attr, str) else "?")
            pushed.append(None)
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = pushed[-1] if pushed else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            pushed.append(memo.get(int(arg)))
        elif isinstance(arg, str) and ("UNICODE" in name or "STRING" in name):
            pushed.append(arg)
        elif opcode.stack_after:
            pushed.append(None)


def unsafe_globals(path: Path, allowed: frozenset = NUMPY_ARRAYS) -> list[str]:
    """'module.name' of every global in the file that is not allowed ([] for a data-only file).

    Raises:
        OSError: the file cannot be read.
    """
    with open(path, "rb") as fh:
        try:
            return sorted({f"{m}.{n}" for m, n in globals_in(fh) if (m, n) not in allowed})
        except Exception as exc:  # not a pickle at all: the loader will say so
            return [f"<unreadable pickle: {type(exc).__name__}>"] if not isinstance(exc, OSError) else []


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that imports only the allowed globals; anything else raises UnsafePickle."""

    allowed = NUMPY_ARRAYS

    def find_class(self, module: str, name: str):
        if (module, name) not in self.allowed:
            raise UnsafePickle(f"the file names {module}.{name}, which would run code on load; only NumPy "
                               f"arrays are accepted")
        return super().find_class(module, name)
