"""The tuned recipe's text: the recipe as given with some keys changed, each changed key commented.

PyYAML writes no comments, so the comments are placed by position: the written text is composed
again (`yaml.compose`), which gives each key's line, and a comment is appended to the line of a key
whose value is a one-line scalar. No pattern matching over the text: a key is found by its path in
the document, whatever its spelling or quoting.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import yaml


def set_path(data: dict, path: str, value: Any) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        data = data.setdefault(part, {})
    data[parts[-1]] = value


def _key_lines(node: yaml.Node, prefix: str = "") -> Iterator[tuple[str, int, yaml.Node]]:
    """(dotted path, line of the key, value node) of every key of a mapping, nested ones too."""
    if not isinstance(node, yaml.MappingNode):
        return
    for key, value in node.value:
        path = f"{prefix}{key.value}"
        yield path, key.start_mark.line, value
        yield from _key_lines(value, path + ".")


def with_changes(raw: dict, changes: dict[str, Any], comments: dict[str, str], header: list[str]) -> str:
    """`raw` (a composed recipe) with `changes` applied, `# comment` beside each key in `comments`,
    and the `header` comment lines on top. A comment for a key whose value spans lines goes on top
    instead (an inline one would break the value)."""
    data = copy.deepcopy(raw)
    for path, value in changes.items():
        set_path(data, path, value)
    text = yaml.safe_dump(data, sort_keys=False)
    lines = text.splitlines()
    placed = set()
    for path, line, value in _key_lines(yaml.compose(text)):
        if path not in comments:
            continue
        if isinstance(value, yaml.ScalarNode) and value.end_mark.line == line:  # a one-line value
            lines[line] = f"{lines[line]}  # {comments[path]}"
            placed.add(path)
    extra = [f"# {path}: {comment}" for path, comment in comments.items() if path not in placed]
    return "\n".join([f"# {h}" for h in header] + extra + lines) + "\n"
