"""Seeded initialisation (`model.init: seeded`, runtime/materialize.py), in one process: what the
sharded strategies rely on to fill their shards without ever building the whole model.

The distributed half -- FSDP and ZeRO-3 shards filled with exactly these values -- is guarded by the
per-strategy trajectory tests (tests/strategy_runs.py builds every strategy's model seeded) and by
`test_sharded_init_equals_the_one_process_init` in tests/test_strategies_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from trainkit.models import mlp, small_cnn
from trainkit.runtime.materialize import (CannotSeed, materialize, parameters_on_meta, seeded_values,
                                          unseedable)


def _seeded(factory, seed=0):
    with parameters_on_meta():
        model = factory()
    assert all(p.is_meta for p in model.parameters())
    return materialize(model, seed)


def test_a_parameter_s_value_depends_only_on_seed_and_name():
    """Guards shard-independence: two builds give identical values, another seed different ones,
    and one module's value computed alone equals its value in the whole model."""
    first, again = _seeded(lambda: mlp(48, 64, 4, 3)), _seeded(lambda: mlp(48, 64, 4, 3))
    for (name, a), (_, b) in zip(first.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name
    other = _seeded(lambda: mlp(48, 64, 4, 3), seed=1)
    assert not torch.equal(first[1].weight, other[1].weight)
    with parameters_on_meta():
        lone = mlp(48, 64, 4, 3)
    alone = seeded_values(lone[3], "3", 0)  # the second Linear, computed by itself
    assert torch.equal(alone["weight"], first[3].weight) and torch.equal(alone["bias"], first[3].bias)
    assert not torch.equal(first[1].weight, first[3].weight[:, :48])  # names give distinct streams


def test_seeded_values_follow_torch_s_layer_init_not_the_global_rng():
    """Guards that the values are each layer's reset_parameters() distribution (a Linear's bound is
    1/sqrt(fan_in)), drawn without touching the caller's RNG stream."""
    torch.manual_seed(123)
    before = torch.get_rng_state()
    model = _seeded(lambda: mlp(48, 64, 4, 3))
    assert torch.equal(torch.get_rng_state(), before)
    bound = 1 / 48 ** 0.5
    weight = model[1].weight
    assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    constructed = mlp(48, 64, 4, 3)
    assert not torch.equal(constructed[1].weight, weight)  # seeded is not the factory's own draw


def test_buffers_stay_real_and_keep_their_constructor_values():
    """Guards the meta build: only parameters go to meta (a BatchNorm's running statistics, a
    computed buffer, stay real), and a model with buffers trains after materialising."""
    with parameters_on_meta():
        model = small_cnn(num_classes=4, width=8)
        resnet = torchvision.models.resnet18(num_classes=4)
    assert not any(b.is_meta for b in resnet.buffers()) and torch.equal(resnet.bn1.running_var, torch.ones(64))
    materialize(model, 0)
    materialize(resnet, 0)
    out = resnet(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert all(p.grad is not None for p in resnet.parameters())
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 4)


def test_a_parameter_without_reset_parameters_is_named_not_left_uninitialised():
    """Guards the refusal: a bare nn.Parameter (a ViT's class token) cannot be seeded, so the run is
    refused naming it and the way out, instead of training from uninitialised memory."""
    class WithToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.token = nn.Parameter(torch.zeros(1, 8))
            self.proj = nn.Linear(8, 8)

    with parameters_on_meta():
        model = WithToken()
    assert unseedable(model) == ["token (WithToken)"]
    with pytest.raises(CannotSeed, match=r"token \(WithToken\).*model.init: constructor"):
        materialize(model, 0)
