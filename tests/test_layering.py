"""The package's import layering (README "Layout"): every import, module-level or inside a function,
goes to the same or a lower layer, and the three plugin families of layer 4 never import each other.

Guards against the cycles and upward imports this structure removed (doctor <-> launch, recipe.plan ->
launch, runtime <-> monitors, tracking -> runtime, strategies -> runtime.checkpoint): re-adding any of
them fails here with the offending line.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "trainkit"

LAYERS = [  # (module prefix, layer); the longest matching prefix wins
    ("trainkit", 1), ("trainkit.registry", 1), ("trainkit.models", 1),
    ("trainkit.recipe", 2), ("trainkit.cluster", 2),
    ("trainkit.runtime", 3),
    ("trainkit.strategies", 4), ("trainkit.monitors", 4), ("trainkit.tracking", 4), ("trainkit.tasks", 4),
    ("trainkit.runtime.worker", 5), ("trainkit.runtime.reports", 5), ("trainkit.doctor", 5),
    ("trainkit.launch", 6),
    ("trainkit.cli", 7),
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
