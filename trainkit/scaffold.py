"""`trainkit plugins`: list installed plugins (package, entry point, options) and scaffold new ones.

Listing reads entry points and imports only the light options models (never a plugin's `component`);
a module that imports torch at its top level is flagged, since `trainkit validate` would pay for it.
`trainkit plugins new KIND NAME` writes an installable package with a passing test (docs/plugins.md).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import textwrap
from pathlib import Path
from typing import Optional

from . import registry

KIND_NAMES = {"model": "models", "dataset": "datasets", "strategy": "strategies", "monitor": "monitors"}


class ScaffoldError(ValueError):
    """A kind or name `plugins new` cannot make: a message for the user."""


def kind_of(text: str) -> str:
    """'monitor' or 'monitors' -> 'monitors'; anything else is a clear error."""
    kind = KIND_NAMES.get(text) or (text if text in registry.KINDS else None)
    if kind is None:
        raise ScaffoldError(f"no plugin kind '{text}' (kinds: {', '.join(KIND_NAMES)})")
    return kind


def imports_torch_at_top(module_name: str) -> bool:
    """Does the module's source import torch outside any function (so importing it imports torch)?"""
    try:
        spec = importlib.util.find_spec(module_name)
        source = Path(spec.origin).read_text() if spec and spec.origin and spec.origin.endswith(".py") else None
    except (ImportError, ValueError, OSError):
        return False
    if source is None:
        return False
    for node in ast.parse(source).body:  # top-level statements only
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def _options(obj) -> list[str]:
    fields = getattr(obj, "model_fields", None)
    if fields is None:  # a model factory: its keyword arguments
        import inspect

        try:
            return [str(p) for p in inspect.signature(obj).parameters.values()]
        except (TypeError, ValueError):
            return []
    out = []
    for key, f in fields.items():
        if key == "name":
            continue
        default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
        out.append(f"{key}={default}")
    return out


def listing(kinds: Optional[list[str]] = None) -> tuple[str, list[str]]:
    """The installed plugins as text, and warnings (torch at module level, import failures)."""
    lines, warnings = [], []
    for kind in kinds or list(registry.KINDS):
        lines.append(f"{kind}:")
        for name in registry.names(kind):
            ep = registry._entry_points(kind)[name]
            dist = getattr(ep, "dist", None)
            source = f"{dist.metadata['Name']} {dist.version}" if dist is not None else "?"
            module = ep.value.split(":")[0]
            if kind != "models" and imports_torch_at_top(module):
                warnings.append(f"{kind[:-1]} plugin '{name}' ({source}): {module} imports torch at module level; "
                                f"`trainkit validate` imports it for every recipe naming '{name}' and slows down "
                                f"(move `import torch` into the component)")
            try:
                options = ", ".join(_options(registry.load(kind, name))) or "-"
            except registry.PluginError as exc:
                options = "(failed to import)"
                warnings.append(str(exc))
            lines.append(f"  {name:<14} {source:<28} {ep.value}")
            lines.append(f"  {'':<14} options: {options}")
    return "\n".join(lines), warnings


# --------------------------------------------------------------------------- scaffolding
def _monitor_files(name: str, pkg: str, cls: str) -> dict[str, str]:
    """A monitor: light options, the monitor class, a test."""
    files = {}
    files[f"{pkg}/options.py"] = f'''\
        """Options of the `{name}` monitor: light (pydantic only), imported by `trainkit validate`."""

        from typing import ClassVar, Literal

        from pydantic import Field, PositiveFloat

        from trainkit.recipe.blocks import MonitorOptions


        class {cls}Options(MonitorOptions):
            """Reports the slowest step of each log interval and warns about steps over a limit."""

            component: ClassVar[str] = "{pkg}.monitor:{cls}Monitor"
            name: Literal["{name}"]
            limit_s: PositiveFloat = Field(default=10.0, description="a step slower than this is reported")
        '''
    files[f"{pkg}/monitor.py"] = f'''\
        """The `{name}` monitor (imported only when a run builds it)."""

        from trainkit.monitors.base import Monitor


        class {cls}Monitor(Monitor):
            def __init__(self, options, ctx):
                super().__init__(options, ctx)
                self.slowest, self.over, self.steps = 0.0, 0, 0

            def on_step_end(self, step, times):
                self.steps += 1
                self.slowest = max(self.slowest, times.total)
                self.over += times.total > self.options.limit_s

            def collect(self, step):
                out = {{"slowest_s": self.slowest, "over": self.over, "steps": self.steps}}
                self.slowest = 0.0
                return out

            def report(self, step, per_rank):
                return {{"{name}/slowest_step_s": max(r["slowest_s"] for r in per_rank)}}

            def finish(self, per_rank):
                over = sum(r["over"] for r in per_rank)
                return f"## {name}\\n\\n- steps over {{self.options.limit_s}} s: {{over}}\\n"
        '''
    files[f"tests/test_{name}.py"] = f'''\
        from types import SimpleNamespace

        from trainkit import registry
        from {pkg}.monitor import {cls}Monitor
        from {pkg}.options import {cls}Options


        def test_registered_under_its_name():
            assert registry.load("monitors", "{name}") is {cls}Options


        def test_reports_the_slowest_step_of_the_interval():
            monitor = {cls}Monitor({cls}Options(name="{name}", limit_s=0.3), ctx=None)
            for step, total in enumerate((0.5, 0.2), 1):
                monitor.on_step_end(step, SimpleNamespace(total=total))
            collected = monitor.collect(2)
            assert monitor.report(2, [collected]) == {{"{name}/slowest_step_s": 0.5}}
            assert "steps over 0.3 s: 1" in monitor.finish([collected])
        '''
    return files


def _dataset_files(name: str, pkg: str, cls: str) -> dict[str, str]:
    """A dataset: light options, the dataset builder, a test."""
    files = {}
    files[f"{pkg}/options.py"] = f'''\
        """Options of the `{name}` dataset: light (pydantic only), imported by `trainkit validate`."""

        from typing import ClassVar, Literal

        from pydantic import Field, PositiveInt

        from trainkit.recipe.blocks import DataOptions


        class {cls}Options(DataOptions):
            """Gaussian clusters, one per class (replace with your data)."""

            component: ClassVar[str] = "{pkg}.data:build"
            name: Literal["{name}"]
            num_samples: PositiveInt = Field(default=512, description="training samples")
            dim: PositiveInt = Field(default=48, description="features per sample")
            num_classes: PositiveInt = Field(default=4, description="classes")
        '''
    files[f"{pkg}/data.py"] = f'''\
        """Builds the `{name}` dataset (torch is imported here, only when a run builds it)."""


        def build(options, *, split: str, seed: int):
            """split: "train" or "eval" -> a map-style Dataset of (input, label) (or None: no eval split)."""
            import torch
            from torch.utils.data import TensorDataset

            n = options.num_samples if split == "train" else max(options.batch_size, options.num_samples // 10)
            g = torch.Generator().manual_seed(seed + (0 if split == "train" else 1))
            centers = torch.randn(options.num_classes, options.dim, generator=torch.Generator().manual_seed(seed)) * 3
            labels = torch.randint(0, options.num_classes, (n,), generator=g)
            return TensorDataset(centers[labels] + torch.randn(n, options.dim, generator=g), labels)
        '''
    files[f"tests/test_{name}.py"] = f'''\
        from trainkit import registry
        from {pkg}.data import build
        from {pkg}.options import {cls}Options


        def test_builds_train_and_eval_splits():
            assert registry.load("datasets", "{name}") is {cls}Options
            options = {cls}Options(name="{name}", batch_size=8, num_samples=64, dim=6)
            x, y = build(options, split="train", seed=0)[0]
            assert len(build(options, split="train", seed=0)) == 64 and x.shape == (6,)
            assert len(build(options, split="eval", seed=0)) == 8
        '''
    return files


def _model_files(name: str, pkg: str, cls: str) -> dict[str, str]:
    """A model: the factory, a test."""
    files = {}
    files[f"{pkg}/model.py"] = f'''\
        """The `{name}` model factory: called with the recipe's model.args."""

        import trainkit


        @trainkit.model_factory  # also lets a recipe name it by import path: {pkg}.model:{name}
        def {name}(in_features: int = 48, hidden: int = 64, num_classes: int = 4):
            from torch import nn

            return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        '''
    files[f"tests/test_{name}.py"] = f'''\
        import torch

        from trainkit import registry


        def test_factory_builds_a_module_with_the_recipe_args():
            model = registry.load("models", "{name}")(in_features=12, num_classes=3)
            assert model(torch.zeros(2, 12)).shape == (2, 3)
        '''
    return files


def _strategy_files(name: str, pkg: str, cls: str) -> dict[str, str]:
    """A strategy: light options, the strategy class (a DDP subclass to start from), a test."""
    files = {}
    files[f"{pkg}/options.py"] = f'''\
        """Options of the `{name}` strategy: light (pydantic only), imported by `trainkit validate`."""

        from typing import ClassVar, Literal

        from trainkit.recipe.blocks import DDPOptions


        class {cls}Options(DDPOptions):
            """DDP with this plugin's changes (every DDP option applies)."""

            component: ClassVar[str] = "{pkg}.strategy:{cls}Strategy"
            name: Literal["{name}"]
        '''
    files[f"{pkg}/strategy.py"] = f'''\
        """The `{name}` strategy: override what differs from DDP (see trainkit.strategies.base.Strategy)."""

        from trainkit.strategies.ddp import DDPStrategy


        class {cls}Strategy(DDPStrategy):
            pass
        '''
    files[f"tests/test_{name}.py"] = f'''\
        from trainkit import registry
        from trainkit.strategies.base import Strategy
        from {pkg}.options import {cls}Options


        def test_registered_and_a_strategy():
            assert registry.load("strategies", "{name}") is {cls}Options
            assert issubclass(registry.component({cls}Options(name="{name}")), Strategy)
        '''
    return files


# the entry point each kind registers (relative to the package) and the files only it has
KIND_FILES = {"monitors": ("options:{cls}Options", _monitor_files), "datasets": ("options:{cls}Options", _dataset_files),
              "models": ("model:{name}", _model_files), "strategies": ("options:{cls}Options", _strategy_files)}

def _files(kind: str, name: str) -> dict[str, str]:
    """The plugin package's files: what every kind has (pyproject.toml with its entry point, the package's
    __init__, a README) and its kind's own (`KIND_FILES`)."""
    pkg, cls = f"trainkit_{name}", "".join(p.capitalize() for p in name.split("_"))
    group = kind
    entry_in_package, files_of_kind = KIND_FILES[kind]
    entry = f"{pkg}." + entry_in_package.format(name=name, cls=cls)
    files = {"pyproject.toml": f'''\
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "trainkit-{name.replace('_', '-')}"
        version = "0.1.0"
        description = "A trainkit {kind[:-1]} plugin: {name}"
        requires-python = ">=3.10"
        dependencies = ["{registry.DISTRIBUTION}"]

        [project.entry-points."trainkit.{group}"]
        {name} = "{entry}"

        [tool.setuptools]
        packages = ["{pkg}"]
        ''', f"{pkg}/__init__.py": f'"""trainkit {kind[:-1]} plugin `{name}`."""\n',
        "README.md": f"# trainkit-{name}\n\nA trainkit {kind[:-1]} plugin. Install it into the environment that runs "
                     f"trainkit with that environment's pip (`python -m pip install .`, e.g. `.venv/bin/python -m pip "
                     f"install .`), test with `python -m pytest tests`, use it in a recipe by its name `{name}` "
                     f"(docs/plugins.md in trainkit).\n"}
    files.update(files_of_kind(name, pkg, cls))
    return {path: textwrap.dedent(text) for path, text in files.items()}


def scaffold(kind_text: str, name: str, where: Path) -> Path:
    """Write the package `trainkit-NAME` under `where`; returns its folder."""
    kind = kind_of(kind_text)
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ScaffoldError(f"plugin name '{name}': use lower-case letters, digits and _ (it is a Python name)")
    if name in registry.names(kind):
        raise ScaffoldError(f"a {kind[:-1]} plugin named '{name}' is installed already")
    root = where / f"trainkit-{name.replace('_', '-')}"
    if root.exists():
        raise ScaffoldError(f"{root} exists already")
    for path, text in _files(kind, name).items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root
