"""The package's import layering (README "Layout"): every import, module-level or inside a function,
goes to the same or a lower layer, and the three plugin families of layer 4 never import each other.
A module named in a string (`"trainkit.runtime.worker"`, `-m trainkit.cli`) is a dependency too: it
follows the same rule, except for the two declared late bindings (`STRING_BINDINGS`).

Guards against the cycles and upward imports this structure removed (doctor <-> launch, recipe.plan ->
launch, runtime <-> monitors, tracking -> runtime, strategies -> runtime.checkpoint): re-adding any of
them fails here with the offending line.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trainkit"

LAYERS = [  # (module prefix, layer); the longest matching prefix wins
    ("trainkit", 1), ("trainkit.registry", 1), ("trainkit.models", 1), ("trainkit.run_dir", 1),
    ("trainkit.processes", 1),
    ("trainkit.recipe", 2), ("trainkit.cluster", 2),
    ("trainkit.runtime", 3), ("trainkit.analysis", 3),
    ("trainkit.strategies", 4), ("trainkit.monitors", 4), ("trainkit.tracking", 4), ("trainkit.tasks", 4),
    ("trainkit.runtime.worker", 5), ("trainkit.runtime.cell_runner", 5), ("trainkit.doctor", 5),
    ("trainkit.launch", 6),
    ("trainkit.cli", 7), ("trainkit.scaffold", 7),  # scaffold writes plugin sources naming every layer
]
PLUGIN_FAMILIES = ("trainkit.strategies", "trainkit.monitors", "trainkit.tracking", "trainkit.tasks")


def layer_of(module: str) -> tuple[int, str]:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best], best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every trainkit import in the file, wherever it appears."""
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names if n.startswith("trainkit")]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trainkit")]
    return found


def test_no_import_climbs_a_layer_or_crosses_plugin_families():
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        my_layer, my_family = layer_of(me)
        for line, target in imports_of(path):
            if target == "trainkit":  # `from .. import __version__`
                continue
            their_layer, their_family = layer_of(target)
            if their_layer > my_layer:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} (layer {my_layer}) imports "
                                  f"{target} (layer {their_layer})")
            elif my_family == "trainkit.tracking" and target.startswith("trainkit.runtime"):
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: tracking imports {target} (the "
                                  f"training side hands tracking what it logs)")
            elif my_family in PLUGIN_FAMILIES and their_family in PLUGIN_FAMILIES and my_family != their_family:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} imports {target}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_function_local_and_relative_imports(tmp_path):
    """The walk above must see an import hidden inside a function, or the test guards nothing."""
    sample = PACKAGE / "runtime" / "preflight.py"
    assert any(t == "trainkit.runtime.model" for _, t in imports_of(sample))


# A string may name a higher layer's module in two declared ways, both resolved only when used:
# - `trainkit/processes.py`: the modules trainkit starts as processes (`python -m ...`);
# - a plugin's `component = "module:attr"` (the registry imports it when a run builds the component,
#   like an entry point in a plugin's pyproject.toml).
STRING_BINDINGS = "trainkit.processes"
MODULE_IN_STRING = re.compile(r"\btrainkit(?:\.\w+)+")


def known_modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose about modules, not a dependency on them)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _components(tree: ast.AST) -> set[int]:
    """ids of the strings assigned to `component` (a plugin's "module:attr", resolved by the registry)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "component":
            found.add(id(node.value))
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "component" for t in node.targets):
            found.add(id(node.value))
    return found


def string_modules_of(path: Path, modules: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every trainkit module named in a string literal (docstrings aside): the
    longest dotted prefix of `trainkit.x.y.z` that is a module of the package."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | _components(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            for match in MODULE_IN_STRING.finditer(node.value):
                parts = match.group(0).split(".")
                named = next((".".join(parts[:n]) for n in range(len(parts), 1, -1)
                              if ".".join(parts[:n]) in modules), None)
                if named is not None:
                    found.append((node.lineno, named))
    return found


def test_no_string_names_a_module_of_a_higher_layer():
    """A module named in a string is imported or run later (`-m`, `importlib`, a process match):
    an upward dependency the import check cannot see."""
    modules = known_modules()
    violations = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = module_name(path)
        if me == STRING_BINDINGS:
            continue
        my_layer, _ = layer_of(me)
        for line, target in string_modules_of(path, modules):
            their_layer, _ = layer_of(target)
            if their_layer > my_layer:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} (layer {my_layer}) names "
                                  f"{target} (layer {their_layer}) in a string; import it, or declare a process "
                                  f"in trainkit/processes.py")
    assert not violations, "\n".join(violations)


def test_each_declared_process_runs_as_main():
    import trainkit.processes as processes

    for name in (v for k, v in vars(processes).items() if k.isupper()):
        path = PACKAGE.parent / (name.replace(".", "/") + ".py")
        assert path.is_file() and 'if __name__ == "__main__":' in path.read_text(), name


def test_the_string_checker_sees_an_upward_name(tmp_path):
    """A layer-2 module holding "trainkit.launch.launcher" in a string is caught; a docstring is not."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Mentions trainkit.cli in prose."""\nWORKER = "trainkit.launch.launcher"\n'
                      'CMD = f"-m trainkit.cli {1}"\n')
    assert string_modules_of(sample, known_modules()) == [(2, "trainkit.launch.launcher"), (3, "trainkit.cli")]
