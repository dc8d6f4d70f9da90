"""The one grammar of recipe arguments on every command: recipe paths, then `key.path=value`,
`+key.path=value` and `~key.path` overrides, each one argument. Two near misses are common enough to
answer with the right spelling instead of "no such file" or argparse's "unrecognized arguments":
`trainer.max_steps 50` (key and value apart) and `--trainer.max_steps=50` (written as an option)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from .discovery import SUFFIXES, path_exists

OVERRIDE_FORMS = ("overrides are written key.path=value, +key.path=value (a new key under a free-form mapping) "
                  "or ~key.path (delete), e.g. trainer.max_steps=20")
_DOTTED_KEY = re.compile(r"[~+]?[A-Za-z_][\w\-]*(\.[\w\-]+)+")  # trainer.max_steps: never a recipe file name
_AS_OPTION = re.compile(r"--?([~+]?[A-Za-z_][\w\-]*(?:\.[\w\-]+)+)(=.*)?")


def misspelled_overrides(args: Sequence[str]) -> list[str]:
    """For each override written apart or as an option: what was written -> how to write it."""
    found = []
    for i, arg in enumerate(args):
        following = args[i + 1] if i + 1 < len(args) else None
        option = _AS_OPTION.fullmatch(arg)
        if option:
            key, value = option.group(1), option.group(2)
            if value is None and following is not None and not following.startswith("-"):
                found.append(f"{arg} {following} -> {key}={following}")
            else:
                found.append(f"{arg} -> {key}{value or '=VALUE'}")
        elif (_DOTTED_KEY.fullmatch(arg) and not arg.startswith("~") and following is not None
              and "=" not in following and Path(arg).suffix not in SUFFIXES and not path_exists(Path(arg))):
            found.append(f"{arg} {following} -> {arg}={following}")
    return found


def grammar_error(positionals: Sequence[str], unknown_options: Sequence[str]) -> str:
    """'' when the recipe arguments follow the grammar, else the message to print (exit 2). Each list
    keeps the command line's order (argparse's positionals, and the options it did not know)."""
    found = misspelled_overrides(unknown_options) + misspelled_overrides(positionals)
    if not found:
        return ""
    return (f"{OVERRIDE_FORMS}, as one argument without dashes: " + "; ".join(found))
