"""Safe, bounded YAML loading that remembers where every value was written.

OmegaConf keeps no line numbers, so we compose the YAML node graph ourselves (PyYAML's safe
composer: no Python-object tags, no code execution) and build plain data plus a map from each
dotted path to its Location. Hostile input is bounded: file size, binary content, nesting depth
and the total number of nodes after alias expansion ("billion laughs").
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .problems import Location, Problem, RecipeError

MAX_BYTES = 1 << 20  # a recipe is a page of YAML, not a megabyte
MAX_DEPTH = 32
MAX_NODES = 20_000  # after alias expansion

Path_ = tuple  # a path into the data: ("trainer", "checkpoint", "every") or ("monitors", 0)
KEY = "\0key"  # positions[path + (KEY,)] is where the key of `path` was written; positions[path] its value
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: same nodes and marks, 10x faster


class _LOADER(_BASE_LOADER):
    """The safe loader without YAML 1.1's base-60 numbers: `nnodes: 2:4` is the string '2:4' (as in
    YAML 1.2), not the integer 124, since `launch.nnodes` takes 'MIN:MAX'."""


_LOADER.yaml_implicit_resolvers = {
    first: [(tag, re.compile(rx.pattern.replace("|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+", "")
                             .replace("|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\\.[0-9_]*", ""), re.X))
            if tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float") else (tag, rx)
            for tag, rx in resolvers]
    for first, resolvers in _BASE_LOADER.yaml_implicit_resolvers.items()
}
_ALLOWED_TAGS = {
    "tag:yaml.org,2002:" + t for t in ("str", "int", "float", "bool", "null", "map", "seq")
}


def _fail(file: str, message: str, line: int = 1, col: int = 1, path: str = "") -> RecipeError:
    return RecipeError([Problem(Location(file, line, col), path, message)])


def dotted(path: Path_) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Builder:
    def __init__(self, file: str):
        self.file = file
        self.nodes = 0
        self.positions: dict[Path_, Location] = {}
        self.scalars = SafeConstructor()

    def loc(self, node: Node) -> Location:
        return Location(self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def build(self, node: Node, path: Path_, depth: int) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _fail(self.file, f"too many values (over {MAX_NODES} after expanding aliases); "
                        "a recipe this large is almost certainly an alias bomb", *self._lc(node))
        if depth > MAX_DEPTH:
            raise _fail(self.file, f"nested deeper than {MAX_DEPTH} levels", *self._lc(node))
        if node.tag not in _ALLOWED_TAGS:
            raise _fail(self.file, f"YAML tag '{node.tag}' is not allowed in recipes "
                        "(only plain strings, numbers, booleans, null, lists and mappings)", *self._lc(node),
                        path=dotted(path))
        self.positions.setdefault(path, self.loc(node))
        if isinstance(node, MappingNode):
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, ScalarNode) or key_node.tag not in _ALLOWED_TAGS:
                    raise _fail(self.file, "mapping keys must be plain strings", *self._lc(key_node),
                                path=dotted(path))
                key = str(self.scalars.construct_object(key_node))
                if key == "<<":
                    raise _fail(self.file, "YAML merge keys ('<<') are not supported; use 'defaults:' "
                                "composition instead", *self._lc(key_node), path=dotted(path))
                if key in out:
                    raise _fail(self.file, f"key '{key}' appears twice in the same mapping",
                                *self._lc(key_node), path=dotted(path + (key,)))
                self.positions[path + (key, KEY)] = self.loc(key_node)
                out[key] = self.build(value_node, path + (key,), depth + 1)
            return out
        if isinstance(node, SequenceNode):
            return [self.build(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        return self.scalars.construct_object(node)

    @staticmethod
    def _lc(node: Node) -> tuple[int, int]:
        return node.start_mark.line + 1, node.start_mark.column + 1


def load_yaml(path: Path) -> tuple[dict[str, Any], dict[Path_, Location]]:
    """Read one recipe file: (data, positions). Raises RecipeError with a located message."""
    file = str(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise _fail(file, f"cannot read recipe: {exc.strerror or exc}") from None
    if not path.is_file():
        raise _fail(file, "not a file")
    if size > MAX_BYTES:
        raise _fail(file, f"file is {size} bytes; recipes are limited to {MAX_BYTES} bytes")
    raw = path.read_bytes()
    if b"\x00" in raw:
        raise _fail(file, "file is binary, not YAML text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(file, f"file is not UTF-8 text (byte {exc.start})") from None
    return load_yaml_text(text, file)


def load_yaml_text(text: str, file: str) -> tuple[dict[str, Any], dict[Path_, Location]]:
    try:
        node = yaml.compose(text, Loader=_LOADER)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        problem = str(exc.problem or exc.context)
        if "nesting depth" in problem:  # libyaml >= 0.2.5 stops at 1000 levels before we get to count
            raise _fail(file, f"nested deeper than {MAX_DEPTH} levels", line, col) from None
        raise _fail(file, f"YAML syntax error: {problem}", line, col) from None
    except yaml.YAMLError as exc:
        raise _fail(file, f"YAML error: {exc}") from None
    except RecursionError:
        raise _fail(file, f"nested deeper than {MAX_DEPTH} levels") from None
    if node is None:
        raise _fail(file, "recipe is empty")
    builder = _Builder(file)
    data = builder.build(node, (), 0)
    if not isinstance(data, dict):
        raise _fail(file, f"a recipe must be a mapping of keys to values, not a {type(data).__name__}",
                    *builder._lc(node))
    return data, builder.positions
