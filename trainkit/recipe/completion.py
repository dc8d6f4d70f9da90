"""Shell completion: `trainkit completion bash|zsh|fish` prints a script; the script asks
`trainkit __complete` for candidates, so keys and values always match the installed schema and
plugins. Light on purpose: no torch, no MLflow (only the recipe schema).

The scripts pass the command line up to the cursor in TRAINKIT_COMP_LINE and the characters the
shell splits words at in TRAINKIT_COMP_WORDBREAKS (bash splits `key=value` at '='); candidates are
printed one per line, relative to the shell's idea of the current word.
"""

from __future__ import annotations

import argparse
import os
import shlex
import typing
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel

RECIPE_COMMANDS = ("validate", "plan", "run", "doctor")
SUFFIXES = (".yaml", ".yml")

BASH = r"""# trainkit completion for bash. Add to ~/.bashrc:  eval "$(trainkit completion bash)"
_trainkit_complete() {
    local IFS=$'\n'
    COMPREPLY=($(TRAINKIT_COMP_LINE="${COMP_LINE:0:COMP_POINT}" TRAINKIT_COMP_WORDBREAKS="$COMP_WORDBREAKS" \
        "$1" __complete 2>/dev/null))
    if [[ ${#COMPREPLY[@]} -eq 1 && ${COMPREPLY[0]} == *[=/.] ]]; then
        compopt -o nospace 2>/dev/null
    fi
}
complete -F _trainkit_complete trainkit
"""

ZSH = r"""#compdef trainkit
# trainkit completion for zsh: trainkit completion zsh > "${fpath[1]}/_trainkit"  (or eval it after compinit)
_trainkit() {
    local -a found open closed
    local line="${(j: :)words[1,CURRENT]}"
    found=("${(@f)$(TRAINKIT_COMP_LINE="$line" TRAINKIT_COMP_WORDBREAKS='' ${words[1]} __complete 2>/dev/null)}")
    open=(${(M)found:#*[=/.]})
    closed=(${found:#*[=/.]})
    (( ${#open} )) && compadd -Q -S '' -- "${open[@]}"
    (( ${#closed} )) && compadd -Q -- "${closed[@]}"
    return 0
}
if (( $+functions[compdef] )); then
    compdef _trainkit trainkit
fi
"""

FISH = r"""# trainkit completion for fish: trainkit completion fish > ~/.config/fish/completions/trainkit.fish
function __trainkit_complete
    set -lx TRAINKIT_COMP_LINE (commandline -cp | string collect)
    set -lx TRAINKIT_COMP_WORDBREAKS ''
    trainkit __complete 2>/dev/null
end
complete -c trainkit -f -a '(__trainkit_complete)'
"""

SCRIPTS = {"bash": BASH, "zsh": ZSH, "fish": FISH}


def script(shell: str) -> str:
    return SCRIPTS[shell]


def complete_from_env(parser: argparse.ArgumentParser) -> int:
    line = os.environ.get("TRAINKIT_COMP_LINE", "")
    breaks = os.environ.get("TRAINKIT_COMP_WORDBREAKS", "")
    words = _split(line)
    current = words[-1]
    cut = max((current.rfind(c) for c in "=:" if c in breaks), default=-1) + 1
    for candidate in candidates(parser, words):
        print(candidate[cut:])
    return 0


def _split(line: str) -> list[str]:
    try:
        words = shlex.split(line)
    except ValueError:  # an open quote
        words = line.split()
    if not line or line[-1].isspace():
        words.append("")
    return words or [""]


def candidates(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """Completions of words[-1], given the words before it (words[0] is the program)."""
    current, before = words[-1], words[1:-1]
    commands = _subcommands(parser)
    if not before:
        return [c for c in [*commands, "--help", "--version"] if c.startswith(current)]
    command = before[0]
    sub = commands.get(command)
    if sub is None:
        return []
    if command == "data" and len(before) == 1:
        return [c for c in _subcommands(sub) if c.startswith(current)]
    if before[-1].startswith("-"):
        choices = _option_choices(sub, before[-1])
        if choices is not None:
            return [c for c in choices if c.startswith(current)]
    if current.startswith("-"):
        return [o for a in sub._actions for o in a.option_strings if o.startswith(current)]
    if command == "completion":
        return [s for s in SCRIPTS if s.startswith(current)]
    if command in RECIPE_COMMANDS:
        recipe_given = any(w.endswith(SUFFIXES) or Path(w).is_dir() for w in before[1:])
        if _looks_like_override(current) or (recipe_given and current and not _looks_like_path(current)):
            return override_candidates(current)
        return _paths(current, recipes=True) + (override_candidates(current) if recipe_given and not current else [])
    return _paths(current, recipes=False)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_choices(parser: argparse.ArgumentParser, option: str):
    for action in parser._actions:
        if option in action.option_strings and action.nargs != 0:
            return [str(c) for c in action.choices] if action.choices else []
    return None


def _looks_like_override(word: str) -> bool:
    return "=" in word or word[:1] in ("~", "+")


def _looks_like_path(word: str) -> bool:
    return "/" in word or word.startswith(".") or any(Path(".").glob(word + "*.y*ml")) or Path(word).exists()


def _paths(prefix: str, recipes: bool) -> list[str]:
    folder, _, start = prefix.rpartition("/")
    base = Path(folder or ".") if folder or not prefix.startswith("/") else Path("/")
    if prefix.startswith("/") and not folder:
        base = Path("/")
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return []
    out = []
    for entry in entries:
        if not entry.name.startswith(start) or (entry.name.startswith(".") and not start.startswith(".")):
            continue
        shown = (folder + "/" if folder or prefix.startswith("/") else "") + entry.name
        if entry.is_dir():
            out.append(shown + "/")
        elif not recipes or entry.suffix in SUFFIXES:
            out.append(shown)
    return out


# ----------------------------------------------------------------------------- override keys and values
def override_candidates(word: str) -> list[str]:
    """`tr` -> `trainer.`; `trainer.` -> `trainer.max_steps=`, `trainer.checkpoint.`; `precision=` ->
    `precision=bf16`...; `~`/`+` prefixes kept."""
    op = word[0] if word[:1] in ("~", "+") else ""
    word = word[len(op):]
    fields = schema_fields()
    if "=" in word and not op == "~":
        key, _, value = word.partition("=")
        return [f"{op}{key}={v}" for v in fields.get(key, []) if v.startswith(value)]
    out: set[str] = set()
    for key in fields:
        if not key.startswith(word):
            continue
        rest = key[len(word):]
        dot = rest.find(".")
        if dot >= 0:
            out.add(op + word + rest[: dot + 1])
        else:
            out.add(op + key + ("" if op == "~" else "="))
    return sorted(out)


def schema_fields() -> dict[str, list[str]]:
    """Every settable dotted key of the schema (every installed plugin's options) -> its known values."""
    from .schema import full_recipe_model

    return dict(_walk(full_recipe_model(), ""))


def _walk(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, list[str]]]:
    seen: dict[str, list[str]] = {}
    for name, info in model.model_fields.items():
        key = prefix + name
        models = _models(info.annotation)
        if models and typing.get_origin(_strip(info.annotation)) is not list:
            names = [v for m in models for v in _values(m.model_fields["name"].annotation)] \
                if all("name" in m.model_fields for m in models) else []
            if names:
                seen[key + ".name"] = sorted(set(names))
            for m in models:
                for sub_key, values in _walk(m, key + "."):
                    if sub_key not in seen or not seen[sub_key]:
                        seen[sub_key] = values
        elif typing.get_origin(_strip(info.annotation)) is not list:
            seen[key] = _values(info.annotation)
    yield from seen.items()


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _models(tp: Any) -> list[type[BaseModel]]:
    tp = _strip(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return [m for a in typing.get_args(tp) for m in _models(a)]
    return []


def _values(tp: Any) -> list[str]:
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return [str(v) for v in typing.get_args(tp)]
    if tp is bool:
        return ["true", "false"]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        out = [v for a in typing.get_args(tp) for v in _values(a)]
        if type(None) in typing.get_args(tp):
            out.append("null")
        return out
    return []
