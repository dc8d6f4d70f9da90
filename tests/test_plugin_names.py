"""No module switches on a strategy's, dataset's, model's, task's or monitor's *name* outside that
plugin's own files, in trainkit/ or bench/.

Knowledge keyed by a name string is lost by a plugin that subclasses a built-in (`my_ddp` is not
"ddp"): outside its own files, code asks the plugin's options (capabilities, rules, sizes, facts,
ClassVars such as `init_order` or `writes_evidence`). A plugin's own files are found from its entry
points, not listed here: the module its entry point names (options, model factory, model facts) and
the module of its options' `component`.

The forms a switch takes, each found by an AST walk (`switches`):
- a comparison (==, !=, in, not in) of a built-in name with something that holds a name: `<x>.name`,
  a variable or attribute named like a plugin (`strategy`, `model`, `monitors`, `*_name`, ...),
  `<x>.get("name")` or `<x>["name"]`;
- a dict literal keyed by two or more built-in names of one kind (`{"ddp": ..., "fsdp": ...}`), and
  any dict literal looked up with something that holds a name (`{...}.get(s.name)`, `{...}[name]`);
- a tuple, list or set literal of two or more built-in names of one kind (a list of choices by name,
  `... in ("ddp", "fsdp")`).
The documented exceptions are `ALLOWED`, each with its reason.
"""

from __future__ import annotations

import ast
from importlib.metadata import entry_points
from pathlib import Path

import trainkit

PACKAGE = Path(trainkit.__file__).parent
REPO = PACKAGE.parent
SCANNED = (PACKAGE, REPO / "bench")
GROUPS = ("strategies", "datasets", "models", "tasks", "model_facts", "monitors")

# identifiers that hold a plugin's name (or a recipe block that carries one)
PLUGIN_WORDS = {"name", "names", "strategy", "strategies", "data", "dataset", "datasets", "model", "models",
                "task", "tasks", "monitor", "monitors", "plugin"}

# file relative to the repository -> (the built-in names it may spell as it does, why)
_BENCH_CASES = ("the benchmark's cases: labels of the recipe blocks it runs, keyed by the label its output prints "
                "(a table of inputs, not a lookup of a recipe's strategy)")
ALLOWED = {
    "trainkit/recipe/compatibility/grid.py": (
        ("ddp", "fsdp", "pipeline", "mlp", "transformer"),
        "the compatibility matrix's data tables: each axis value (a grid strategy, a model family) is a recipe "
        "fragment keyed by the matrix's own axis name, which the cell ids, docs/compatibility.md and the recorded "
        "results use; a recipe is matched to them by its options' type (verified.grid_strategy), never by name"),
    "trainkit/runtime/mesh.py": (
        ("fsdp",),
        "the run mesh's view names: 'fsdp' is the view FSDP-style sharding uses (torchtitan's name for it), asked "
        "for by whichever strategy shards, not the strategy plugin's name"),
    "trainkit/recipe/init.py": (
        ("synthetic",),
        "'synthetic' is an answer to init's data question (the word a user types instead of a folder), which init "
        "turns into a data block; no recipe's dataset name is read back"),
    "bench/memory_plan.py": (("ddp", "fsdp"), _BENCH_CASES),
    "bench/gpu_speed.py": (("memory", "throughput"), "the two monitors whose metrics the benchmark reads "
                                                    "(throughput's MFU, memory's peak), named in the recipes it writes"),
    "bench/strategies_memory.py": (("ddp", "fsdp"), _BENCH_CASES),
    "bench/overhead.py": (
        ("system", "gpu", "throughput", "breakdown", "memory", "stragglers"),
        "the monitors whose overhead the benchmark measures, listed by name as its recipes enable them"),
}


def module_file(value: str) -> Path:
    """The source file of the module an entry point or `component` names (a package's __init__.py)."""
    path = REPO / value.partition(":")[0].replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def own_files() -> dict[str, set[Path]]:
    """Built-in plugin name -> the files that may name it."""
    owned: dict[str, set[Path]] = {}
    for group in GROUPS:
        for ep in entry_points(group=f"trainkit.{group}"):
            if not ep.value.startswith("trainkit."):
                continue  # third-party plugins installed beside trainkit are not trainkit's files
            files = owned.setdefault(ep.name, set())
            files.add(module_file(ep.value).resolve())
            if group not in ("models", "model_facts"):
                files.add(module_file(ep.load().component).resolve())
    return owned


def kinds() -> list[set[str]]:
    """The built-in names of each plugin kind (a dict or tuple of two names of one kind is a switch)."""
    return [{ep.name for ep in entry_points(group=f"trainkit.{group}") if ep.value.startswith("trainkit.")}
            for group in GROUPS]


def _identifier(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def holds_a_name(node: ast.AST) -> bool:
    """`x.name`, `strategy`, `args.model`, `monitor_name`, `x.get("name")`, `x["name"]`, or a conditional
    expression one of whose values is one (`(m if isinstance(m, str) else m.get("name"))`)."""
    if isinstance(node, ast.IfExp):
        return holds_a_name(node.body) or holds_a_name(node.orelse)
    word = _identifier(node)
    if word and (word in PLUGIN_WORDS or word.endswith("_name") or word.endswith("_names")):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "name":
        return True
    return isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "name"


def _strings(node: ast.AST) -> list[str]:
    return [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]


def switches(tree: ast.AST, names_by_kind: list[set[str]]) -> list[tuple[int, str]]:
    """(line, string) for every string the forms in the module docstring switch on; the caller keeps
    those that are built-in names."""
    found: set[tuple[int, str]] = set()

    def several_of_one_kind(strings: list[str]) -> list[str]:
        return [s for s in strings if any(s in kind and len(kind & set(strings)) >= 2 for kind in names_by_kind)]

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(holds_a_name(s) for s in sides):
                found.update((node.lineno, text) for s in sides for text in _strings(s))
        elif isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            found.update((node.lineno, k) for k in several_of_one_kind(keys))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            found.update((node.lineno, e) for e in several_of_one_kind(items))
        looked_up = None  # a dict literal indexed by a name: {...}.get(s.name) or {...}[name]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Dict) and node.args and holds_a_name(node.args[0]):
            looked_up = node.func.value
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict) and holds_a_name(node.slice):
            looked_up = node.value
        if looked_up is not None:
            found.update((node.lineno, k.value) for k in looked_up.keys if isinstance(k, ast.Constant))
    return sorted(found)


def compared_names(tree: ast.AST) -> list[tuple[int, str]]:
    """`switches` with every built-in kind's names."""
    return switches(tree, kinds())


def offenders() -> list[str]:
    owned, names_by_kind = own_files(), kinds()
    out = []
    for folder in SCANNED:
        for path in sorted(folder.rglob("*.py")):
            where = path.relative_to(REPO).as_posix()
            for line, text in switches(ast.parse(path.read_text(), str(path)), names_by_kind):
                if text in owned and path.resolve() not in owned[text] and text not in ALLOWED.get(where, ((),))[0]:
                    out.append(f"{where}:{line}: switches on the name '{text}'")
    return out


def test_no_plugin_name_is_switched_on_outside_its_own_files():
    owned = own_files()
    assert {"ddp", "fsdp", "pipeline", "deepspeed", "imagefolder", "cifar10", "text", "transformer",
            "hf_causal_lm", "classification", "breakdown", "system"} <= set(owned), sorted(owned)
    found = offenders()
    assert not found, "ask the plugin's options (its type, capabilities or ClassVars) instead:\n" + "\n".join(found)


def test_every_allowed_exception_is_still_needed_and_says_why():
    """An exception that no longer matches anything is removed, so the list stays the real one."""
    owned, names_by_kind = own_files(), kinds()
    for where, (names, why) in ALLOWED.items():
        seen = {text for _, text in switches(ast.parse((REPO / where).read_text()), names_by_kind)}
        assert set(names) <= seen and set(names) <= set(owned), (where, sorted(set(names) - seen))
        assert len(why) > 40, where


def test_the_check_sees_a_name_comparison():
    """The detector itself: the `<x>.name` forms it always looked for are found."""
    tree = ast.parse('if r.strategy.name != "ddp":\n    pass\nshape = {"cifar10": 1}.get(d.name)\n'
                     'ok = d.name in ("fsdp", "deepspeed")\n')
    assert sorted(t for _, t in compared_names(tree)) == ["cifar10", "ddp", "deepspeed", "fsdp"]


def test_the_check_sees_every_form_of_a_name_switch():
    """Each form the issue found in the tree (issue 36), as it was written there, is caught."""
    forms = {
        'if strategy == "deepspeed":\n    pass\n': ["deepspeed"],  # a variable named like a plugin
        'x = any(m.get("name") == "breakdown" for m in monitors)\n': ["breakdown"],  # .get("name")
        'pipeline = strategy["name"] == "pipeline"\n': ["pipeline"],  # a subscript
        'ok = kind in ("ddp", "fsdp", "cpu")\n': ["ddp", "fsdp"],  # membership in a literal tuple
        'STRATEGIES = ("ddp", "fsdp", "deepspeed", "pipeline")\n': ["ddp", "deepspeed", "fsdp", "pipeline"],
        'NOTE = {"ddp": "a", "fsdp": "b"}\n': ["ddp", "fsdp"],  # a dict keyed by names of one kind
        'note = {"ddp": "a"}[strategy]\n': ["ddp"],  # a dict literal looked up by a name
        'if args.model_name != "mlp":\n    pass\n': ["mlp"],  # *_name
        'if "breakdown" in monitors:\n    pass\n': ["breakdown"],
    }
    builtin = set().union(*kinds())
    for source, expected in forms.items():
        assert sorted({t for _, t in compared_names(ast.parse(source)) if t in builtin}) == expected, source


def test_the_check_leaves_ordinary_strings_alone():
    """Words that happen to be plugin names, where nothing switches on a plugin: not reported."""
    source = ('if fmt == "text":\n    pass\nsizes = {"text": 1, "bytes": 2}\nfor kind in ("cpu", "gpu"):\n    pass\n'
              'block = {"name": "ddp"}\nok = policy == "system"\n')
    assert compared_names(ast.parse(source)) == []


# --------------------------------------------------------------------------- what replaced the switches
def test_init_offers_the_strategies_whose_options_put_themselves_forward():
    """`trainkit init`'s choices, their order, blocks and comments come from each strategy's options."""
    from trainkit.recipe.blocks import DeepSpeedOptions, PipelineOptions
    from trainkit.recipe.init import offered_strategies

    offered = offered_strategies()
    assert list(offered) == ["ddp", "fsdp", "deepspeed", "pipeline"]
    assert [cls.init_block(2, "mlp") for cls in offered.values()] == [
        "{name: ddp}", "{name: fsdp}", "{name: deepspeed, zero_stage: 3}",
        "{name: pipeline, microbatches: 4, schedule: 1f1b}"]
    assert PipelineOptions.init_block(2, "torchvision.resnet50").endswith(", split_points: [layer3]}")
    assert DeepSpeedOptions.init_note(2).startswith("DeepSpeed ZeRO-3:")


def test_a_plugin_subclassing_fsdp_is_fsdps_cell_in_the_matrix(tmp_path):
    """The matrix matches a recipe's strategy by its options' type: `my_fsdp` (a subclass) gets FSDP's
    verified cell, which a match on `name: fsdp` never gave it."""
    from typing import Literal

    import yaml

    from trainkit.recipe import resolve
    from trainkit.recipe.blocks import FSDPOptions
    from trainkit.recipe.compatibility import verified
    from trainkit.recipe.compatibility.grid import Cell

    class MyFSDPOptions(FSDPOptions):
        name: Literal["my_fsdp"]

    path = tmp_path / "cell.yaml"
    path.write_text(yaml.safe_dump(Cell("fsdp", "mlp", "fp32").recipe(), sort_keys=False))
    recipe = resolve(path).recipe
    mine = recipe.model_copy(update={"strategy": MyFSDPOptions(name="my_fsdp", cpu_offload=True)})
    assert verified.axes_of(recipe)["strategy"] == "fsdp"
    assert verified.axes_of(mine)["strategy"] == "fsdp+cpu_offload"  # the most specific fragment it holds
    assert verified.verdict_for(mine, {"dp_shard": 2}).cell == "fsdp+cpu_offload__mlp__fp32__none__seeded"


def test_tune_adds_the_evidence_monitor_unless_a_listed_one_writes_the_evidence():
    """Each trial runs a monitor that writes the bottleneck evidence: found by `writes_evidence`, so a
    plugin subclassing the breakdown monitor counts, and the breakdown monitor is never listed twice."""
    import json
    from types import SimpleNamespace
    from typing import Literal

    from trainkit.launch.tune_trials import TrialRunner
    from trainkit.recipe.blocks import BreakdownMonitorOptions, SystemMonitorOptions

    class MyBreakdownOptions(BreakdownMonitorOptions):
        name: Literal["my_breakdown"]

    def monitors(listed: list) -> list:
        raw = [{"name": m.name} for m in listed]
        resolved = SimpleNamespace(raw={"monitors": raw}, recipe=SimpleNamespace(monitors=listed))
        runner = TrialRunner(resolved, "r.yaml", [], 5, Path("/nowhere"), None)
        command = runner.command("t", [])
        return json.loads(next(a for a in command if a.startswith("monitors=")).partition("=")[2])

    assert monitors([]) == ["breakdown"]
    assert monitors([SystemMonitorOptions(name="system")]) == [{"name": "system"}, "breakdown"]
    assert monitors([BreakdownMonitorOptions(name="breakdown")]) == [{"name": "breakdown"}]
    assert monitors([MyBreakdownOptions(name="my_breakdown")]) == [{"name": "my_breakdown"}]
