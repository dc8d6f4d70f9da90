"""Models built without memory and given their values from (seed, parameter name).

Why: a sharding strategy (FSDP, ZeRO-3) keeps 1/N of the parameters on each rank, but building the
model with its factory's own init first puts the whole fp32 model in every rank's memory before it
is sharded -- the peak that decides whether a model fits. Instead (`model.init: seeded`, torchtitan's
way) parameters are created on the meta device, the strategy shards them, and each rank fills only
what it keeps.

For a sharded init to equal an unsharded one, a parameter's value must not depend on who computes
it or in which order: it is its owning module's `reset_parameters()` (torch's default init of that
layer type), run on a full-size CPU copy of that module alone under a generator seeded from
`(seed, module name)`. The copy is one module at a time, so the peak is the largest single module,
not the model. Every strategy uses the same values when the init is seeded (the one-process run
included), so trajectories stay comparable across strategies and world sizes.

Limits: buffers keep their constructor values (they are built for real, on the CPU: small, and
often computed -- rotary tables, masks); a module that owns parameters but has no
`reset_parameters()` (a bare `nn.Parameter` such as a ViT's position embedding) cannot be seeded,
and the factory's own init is used instead (`model.init: auto`) or the run is refused (`seeded`).
A factory that re-initialises its layers in its constructor (torchvision's ResNet: kaiming-normal
convolutions) gets torch's default layer init under `seeded`.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Callable, Iterator

import torch
from torch import nn


class CannotSeed(ValueError):
    """`model.init: seeded` was asked for a model with parameters no reset_parameters() sets."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside is created on the meta device; buffers stay real.

    Hand-written (the same patch as Accelerate's `init_empty_weights(include_buffers=False)`; not a
    dependency here): `torch.device("meta")` would make buffers meta as well, and a buffer computed
    in a constructor cannot be recomputed afterwards."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def has_meta_parameters(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def owners(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of every module that owns parameters itself, in a fixed order."""
    for name, module in model.named_modules():
        if any(p is not None for p in module._parameters.values()):
            yield name, module


def parameter_name(module_name: str, pname: str) -> str:
    return f"{module_name + '.' if module_name else ''}{pname}"


def unseedable(model: nn.Module, filled: frozenset = frozenset()) -> list[str]:
    """Parameters no reset_parameters() gives a value, except those `filled` (by name) from a pretrained
    directory after set-up: `module.param (ModuleClass)`."""
    return [f"{parameter_name(name, p)} ({type(module).__name__})" for name, module in owners(model)
            if not callable(getattr(module, "reset_parameters", None))
            for p, value in module._parameters.items() if value is not None and parameter_name(name, p) not in filled]


def after_seeded_init(model: nn.Module) -> None:
    """The model's own correction of the seeded values, if it has one: e.g. LoRA's B matrices start at
    zero, where their Linear's reset_parameters() draws (models.hf `after_seeded_init`)."""
    hook = getattr(model, "after_seeded_init", None)
    if callable(hook):
        hook()


def seed_for(seed: int, module_name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seeded_values(module: nn.Module, module_name: str, seed: int,
                  full_shape: Callable[[torch.Tensor], torch.Size] = lambda p: p.shape) -> dict[str, torch.Tensor]:
    """The full CPU values of `module`'s own parameters: its reset_parameters() on a copy whose own
    parameters are real, under a generator seeded from (seed, module_name). `full_shape` reads a
    parameter's unsharded shape (a ZeRO-3 partition is stored flat)."""
    # A shallow copy sharing children and buffers; only its own parameters are replaced. Not
    # copy.copy: FSDP2's wrapper classes re-run __init__ from __new__.
    shadow = object.__new__(type(module))
    shadow.__dict__.update(module.__dict__)
    shadow._parameters = {name: None if p is None else
                          nn.Parameter(torch.empty(full_shape(p), dtype=_init_dtype(p.dtype)), requires_grad=False)
                          for name, p in module._parameters.items()}
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed_for(seed, module_name))
        shadow.reset_parameters()
    return {name: p.detach() for name, p in shadow._parameters.items() if p is not None}


def _init_dtype(dtype: torch.dtype) -> torch.dtype:
    """Values are drawn in fp32 and cast where they are stored: a bf16/fp16 parameter (DeepSpeed casts
    under ZeRO-3's Init) gets the same values as the fp32 one of another strategy, rounded."""
    return torch.float32 if dtype.is_floating_point else dtype


def check_seedable(model: nn.Module, filled: frozenset = frozenset()) -> None:
    missing = unseedable(model, filled)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise CannotSeed(f"model.init: seeded gives each parameter its layer's reset_parameters() value, and "
                         f"{shown} has none: set model.init: constructor (the factory's own init; every rank "
                         f"builds the whole model before sharding)")


def materialize(model: nn.Module, seed: int, device: torch.device | str = "cpu",
                filled: frozenset = frozenset()) -> nn.Module:
    """The whole model on `device`, each parameter from (seed, its module's name): for strategies
    that keep every parameter on every rank (DDP, pipeline stages before the split, ZeRO-1/2). The
    parameters `filled` from a pretrained directory later are only allocated."""
    check_seedable(model, filled)
    for name, module in owners(model):
        skip = {p for p in module._parameters if parameter_name(name, p) in filled}
        values = {} if skip >= {p for p, v in module._parameters.items() if v is not None} else \
            seeded_values(module, name, seed)
        for pname, old in list(module._parameters.items()):
            if old is None:
                continue
            value = torch.empty(old.shape, dtype=old.dtype) if pname in skip else values[pname].to(old.dtype)
            module._parameters[pname] = nn.Parameter(value.to(device), requires_grad=old.requires_grad)
    after_seeded_init(model)
    return model
