"""No module compares a strategy's, dataset's, model's or task's *name* outside that plugin's own files.

Knowledge keyed by a name string is lost by a plugin that subclasses a built-in (`my_ddp` is not
"ddp"): outside its own files, code asks the plugin's options (capabilities, rules, sizes, facts).
A plugin's own files are found from its entry points, not listed here: the module its entry point
names (options, model factory, model facts) and the module of its options' `component`."""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path

import trainkit

PACKAGE = Path(trainkit.__file__).parent
GROUPS = ("strategies", "datasets", "models", "tasks", "model_facts")


def module_file(value: str) -> Path:
    module = value.partition(":")[0]
    return (PACKAGE.parent / module.replace(".", "/")).with_suffix(".py")


def own_files() -> dict[str, set[Path]]:
    """Built-in plugin name -> the files that may name it."""
    owned: dict[str, set[Path]] = {}
    for group in GROUPS:
        for ep in entry_points(group=f"trainkit.{group}"):
            if not ep.value.startswith("trainkit."):
                continue  # third-party plugins installed beside trainkit are not trainkit's files
            files = owned.setdefault(ep.name, set())
            files.add(module_file(ep.value))
            if group != "models" and group != "model_facts":
                files.add(module_file(ep.load().component))
    return owned


def compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, string) for every `<something>.name` compared with a string (==, !=, in, not in),
    and every dict literal keyed by strings that is looked up with `<something>.name`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "name" for s in sides):
                for s in sides:
                    for const in ast.walk(s):
                        if isinstance(const, ast.Constant) and isinstance(const.value, str):
                            found.append((node.lineno, const.value))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Dict) and node.args \
                and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "name":
            found += [(node.lineno, k.value) for k in node.func.value.keys if isinstance(k, ast.Constant)]
    return found


def test_no_plugin_name_is_compared_outside_its_own_files():
    owned = own_files()
    assert {"ddp", "fsdp", "pipeline", "deepspeed", "imagefolder", "cifar10", "text", "transformer",
            "hf_causal_lm", "classification"} <= set(owned), sorted(owned)
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in compared_names(ast.parse(path.read_text(), str(path))):
            if text in owned and path.resolve() not in {f.resolve() for f in owned[text]}:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: compares a name with '{text}'")
    assert not offenders, "ask the plugin's options instead:\n" + "\n".join(offenders)


def test_the_check_sees_a_name_comparison():
    """The detector itself: both forms it looks for are found."""
    tree = ast.parse('if r.strategy.name != "ddp":\n    pass\nshape = {"cifar10": 1}.get(d.name)\n'
                     'ok = d.name in ("fsdp", "deepspeed")\n')
    assert sorted(t for _, t in compared_names(tree)) == ["cifar10", "ddp", "deepspeed", "fsdp"]
