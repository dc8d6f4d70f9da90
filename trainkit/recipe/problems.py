"""Where a value came from, what is wrong with it, and how the report is printed.

Errors are the interface of the recipe language: every problem names its source (file:line:col, or
the command-line override that set it), the dotted field path, the bad value and what is accepted.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from typing import Iterable, Optional, Sequence


COMMAND_LINE = "<command line>"


@dataclass(frozen=True)
class Location:
    """A position in a recipe file (1-based line and column) or a command-line override (with `file`
    the recipe it was applied to, when one command validated several)."""

    file: str
    line: int = 1
    col: int = 1
    override: Optional[str] = None

    def __str__(self) -> str:
        if self.override is not None:
            on = f"{self.file}: " if self.file != COMMAND_LINE else ""
            return f"{on}override '{self.override}'"
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Problem:
    location: Location
    path: str
    message: str
    severity: str = "error"

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        tag = "" if self.severity == "error" else f"{self.severity}: "
        return f"{self.location}: {tag}{where}{self.message}"

    def as_dict(self) -> dict:
        d = asdict(self.location)
        d.update(path=self.path, message=self.message, severity=self.severity)
        return d


class RecipeError(Exception):
    """One or more problems in a recipe; the CLI prints them all and exits 2."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' did you mean 'x'?' for a near miss, else ''."""
    match = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{match[0]}'?" if match else ""


def short(value: object, limit: int = 60) -> str:
    """A value as a user wrote it, cut to one readable line."""
    text = json.dumps(value) if isinstance(value, (str, list, dict)) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _workflow_data(text: str) -> str:
    """A GitHub workflow command's message, escaped as GitHub documents (`%25`, `%0D`, `%0A`), so a
    recipe key or file name holding a newline cannot start a command of its own (`::add-mask::`,
    a forged `::warning`); `::` inside is shown as `:%3A` so it cannot read as a command separator."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A").replace("::", ":%3A")


def _workflow_property(text: str) -> str:
    """A workflow command's property value (file=...): data escaping plus `:` and `,`."""
    return _workflow_data(text).replace(":", "%3A").replace(",", "%2C")


def format_problems(problems: Sequence[Problem], fmt: str = "text") -> str:
    if fmt == "json":
        return json.dumps([p.as_dict() for p in problems], indent=2)
    if fmt == "github":
        lines = []
        for p in problems:
            loc = p.location
            kind = "error" if p.severity == "error" else "warning"
            msg = _workflow_data(f"{p.path}: {p.message}" if p.path else p.message)
            file = _workflow_property(str(loc.file))
            if loc.override is None:
                lines.append(f"::{kind} file={file},line={loc.line},col={loc.col}::{msg}")
            elif loc.file != COMMAND_LINE:
                lines.append(f"::{kind} file={file}::" + _workflow_data(f"override '{loc.override}': ") + msg)
            else:
                lines.append(f"::{kind}::" + _workflow_data(f"override '{loc.override}': ") + msg)
        return "\n".join(lines)
    return "\n".join(str(p) for p in problems)
