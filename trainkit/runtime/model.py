"""Build the model a recipe names: `torchvision.<name>`, `pkg.module:factory`, or a plugin.

Only model factories can be named. An import path must resolve to a `torch.nn.Module` subclass or a
function marked `@trainkit.model_factory` (entry-point models and torchvision's registered builders
count as registered); anything else (`subprocess:call`, a lambda, a plain class) is refused before it
is called. Importing the module still runs its import-time code: see docs/security.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .. import registry
from ..recipe import imports
from ..recipe.blocks import ModelSpec
from ..recipe.model_facts import builds_seeded
from .materialize import unseedable
from .pretrained import WeightsFile, filled_by_pretrained


class NotAModelFactory(TypeError):
    """An import-path model names something that is not a model factory (so it is never called)."""


def factory(name: str) -> Callable[..., Any]:
    """The callable behind a model name (raises ImportError/KeyError/PluginError/NotAModelFactory)."""
    if name.startswith("torchvision.") and ":" not in name:
        import torchvision

        short = name.split(".", 1)[1]
        if short not in torchvision.models.list_models(module=torchvision.models):
            raise KeyError(f"torchvision has no classification model '{short}'")
        return lambda **kw: torchvision.models.get_model(short, weights=None, **kw)
    if ":" in name:
        why = imports.refusal(name)
        if why:
            raise NotAModelFactory(why)
        obj = registry.import_path(name)
        check_model_factory(name, obj)
        return obj
    return registry.load("models", name)


def check_model_factory(name: str, obj: Any) -> None:
    """Raise NotAModelFactory unless `obj` is a Module subclass or a registered/marked factory."""
    if isinstance(obj, type):
        if issubclass(obj, nn.Module):
            return
        raise NotAModelFactory(f"'{name}' is the class {obj.__module__}.{obj.__qualname__}, which is not a "
                               f"torch.nn.Module subclass, so not a model factory")
    if registry.is_marked_factory(obj) or _torchvision_builder(obj):
        return
    what = "a lambda" if getattr(obj, "__name__", "") == "<lambda>" else f"a {type(obj).__name__}"
    raise NotAModelFactory(f"'{name}' is {what}, not a model factory: an import path must name a "
                           f"torch.nn.Module subclass or a function marked @trainkit.model_factory")


def _torchvision_builder(obj: Any) -> bool:
    """torchvision's model builders are registered in its own model registry."""
    if not str(getattr(obj, "__module__", "")).startswith("torchvision."):
        return False
    import torchvision

    models = torchvision.models
    return any(models.get_model_builder(n) is obj for n in models.list_models())


def construct(spec: ModelSpec) -> nn.Module:
    """The factory's model, with the factory's own initial values (no weights file read)."""
    model = factory(spec.name)(**spec.args)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {spec.name} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(spec: ModelSpec) -> nn.Module:
    """Instantiate the model; load `spec.weights` (a local state_dict file) if given, never download."""
    model = construct(spec)
    if spec.weights:
        source = WeightsFile(str(Path(spec.weights).expanduser()))
        model.load_state_dict({name: source.read(name) for name in source.names()})
    return model


def check_weights_fit(model: nn.Module, source: WeightsFile) -> None:
    """A weights file read into shards after set-up must name exactly the model's entries, as the whole
    model's strict `load_state_dict` requires (raises ValueError naming the first differences)."""
    expected, stored = set(model.state_dict()), source.names()
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if missing or unexpected:
        raise ValueError(f"model.weights {source.where} does not fit the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")


def build_initial_model(spec: ModelSpec, strategy, seed: int, announce: bool = False) -> tuple[nn.Module, str]:
    """The model with its initial values, and how they were made ("constructor" or "seeded").

    `model.init` resolves here, with the strategy that will hold the model: seeded models are built
    in `strategy.empty_init()` (meta parameters; DeepSpeed ZeRO-3: partitioned as they are built)
    and given their values by `strategy.materialize` (runtime.materialize says why and how)."""
    if not builds_seeded(spec, strategy.capabilities.shards_parameters):
        return build_model(spec), "constructor"
    with strategy.empty_init():
        model = construct(spec)
    if spec.weights:  # read later, into each rank's shards (runtime.pretrained.WeightsFile)
        model.weights_file = str(Path(spec.weights).expanduser())
        check_weights_fit(model, WeightsFile(model.weights_file))
    # a pretrained directory's parameters are read after set-up, or by `materialize` itself: they need no
    # seeded value (runtime.pretrained)
    capabilities = strategy.capabilities
    reads_later = capabilities.pretrained_read_at_materialize or not capabilities.pretrained_before_setup
    filled = filled_by_pretrained(model) if reads_later else frozenset()
    missing = unseedable(model, filled)
    if missing and spec.init == "auto":
        if announce:
            print(f"trainkit: note: model.init auto: {missing[0]} has no reset_parameters(), so the factory's own "
                  f"init is used (every rank builds the whole model before it is sharded)", flush=True)
        model = build_model(spec)
        return model, "constructor"
    return strategy.materialize(model, seed, filled), "seeded"  # refuses (CannotSeed) what cannot be seeded
