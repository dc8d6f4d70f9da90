"""The `performance:` block: each option is shown in effect (not only survived) and training still
follows the plain run; bad combinations are refused before launch with the recipe's line.

Runs are tiny (ResNet-18 on 32x32 synthetic images, a few steps) so they fit 2 shared CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from run_helpers import RESNET, losses, mlp_recipe, trainkit, write_recipe

def run(tmp: Path, path: Path, **env: str) -> Path:
    result = trainkit(tmp, "run", str(path), **env)
    assert result.returncode == 0, result.output[-6000:]
    return tmp / "runs" / path.stem


def probe_rows(folder: Path, ranks: int) -> list[dict]:
    return [json.loads(line) for r in range(ranks) for line in (folder / f"perf-rank{r}.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- in effect, through `trainkit run`
@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory) -> list[float]:
    tmp = tmp_path_factory.mktemp("plain")
    return losses(run(tmp, write_recipe(tmp, "plain", RESNET)))


@pytest.mark.distributed
def test_ddp_channels_last_and_selective_checkpointing_are_in_effect(tmp_path, plain_ddp):
    """channels_last: every 4-D weight and the first convolution's input are NHWC. Selective
    checkpointing every 2nd BasicBlock: blocks 0, 2, 4, 6 run their forward twice per step (the
    recomputation in backward), the others once.

    Bound: checkpointing alone is exact (the recomputation repeats the same operations; shown bit
    for bit in-process by test_activation_checkpointing_selects_blocks's sibling below, and BatchNorm
    in training mode normalises with the batch's statistics, so the second update of its running
    statistics does not reach the loss). channels_last convolutions add in another order: the first
    step's loss (same weights) agrees within 1e-5 relative (measured 2.5e-6). This ResNet on random
    labels with 8-sample BatchNorm amplifies such differences step by step (measured in one process:
    2e-4 at step 2, 3% at step 4), so later steps get a 10% bound -- a wrong layout (NHWC data read
    as NCHW) already moves the first loss by far more than 1e-5.
    """
    perf = {"channels_last": True,
            "activation_checkpointing": {"mode": "selective", "blocks": ["BasicBlock"], "every_n_blocks": 2}}
    path = write_recipe(tmp_path, "opts", RESNET, performance=perf)
    probe = tmp_path / "probe"
    probe.mkdir()
    ours = losses(run(tmp_path, path, TRAINKIT_FAULT_PROBE_PERF=str(probe), TRAINKIT_FAULT_PROBE_BLOCKS="BasicBlock"))
    for row in probe_rows(probe, 2):
        assert row["weights_channels_last"] and all(row["weights_channels_last"])
        assert row["input_channels_last"] is True
        assert list(row["forwards"].values()) == [2, 1, 2, 1, 2, 1, 2, 1], row["forwards"]
    assert ours[0] == pytest.approx(plain_ddp[0], rel=1e-5)
    assert ours == pytest.approx(plain_ddp, rel=0.1)


def test_activation_checkpointing_alone_is_bit_exact():
    import torchvision

    from trainkit.recipe.blocks import ActivationCheckpointingOptions as AC
    from trainkit.runtime.performance import apply_activation_checkpointing

    def trajectory(ac) -> list[float]:
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=4)
        apply_activation_checkpointing(model, ac)
        opt = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9)
        out = []
        for _ in range(3):
            x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 4, (4,))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    assert trajectory(AC(mode="full", blocks=["BasicBlock"])) == trajectory(AC(mode="none"))


def test_sync_batchnorm_replaces_every_batchnorm_before_wrapping():
    """What the worker does before DDP wraps the model. (torch's SyncBatchNorm runs only on GPUs,
    so on this CPU machine the conversion is what can be shown; preflight refuses it on the CPU.)"""
    import torchvision

    from trainkit.recipe.blocks import PerformanceOptions
    from trainkit.runtime.performance import prepare_model

    model = prepare_model(torchvision.models.resnet18(num_classes=4), PerformanceOptions(sync_batchnorm=True))
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules()) == 20
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules())


@pytest.mark.slow
def test_compile_compiles_the_model_and_keeps_the_loss(tmp_path):
    """torch.compile on one process (the in-process launch), together with activation checkpointing of
    every block (refused before issue 40: the composable checkpoint's hooks broke dynamo): dynamo
    captured whole graphs (fullgraph: a break would fail the run) and inductor compiled them, and the
    loss follows eager without checkpointing within 1e-4 relative over 4 steps -- inductor fuses and
    reorders fp32 reductions (~1e-6 relative per step measured), a wrong graph moves it >1e-2."""
    mlp = {"model": {"name": "mlp", "args": {"in_features": 48, "hidden": 64, "num_classes": 4}},
           "trainer": {"max_steps": 4, "log_every": 1, "checkpoint": {"every": 100}},
           "launch": {"nproc_per_node": 1, "run_dir": str(tmp_path / "runs"), "timeout_s": 120}}
    eager = losses(run(tmp_path, mlp_recipe(tmp_path, "eager", **mlp)))
    probe = tmp_path / "probe"
    probe.mkdir()
    path = mlp_recipe(tmp_path, "compiled", performance={"compile": {"fullgraph": True},
                                                         "activation_checkpointing": "full"}, **mlp)
    compiled = losses(run(tmp_path, path, TRAINKIT_FAULT_PROBE_PERF=str(probe)))
    last = probe_rows(probe, 1)[-1]["dynamo"]
    assert last["stats"].get("unique_graphs", 0) >= 1, last
    assert not last.get("graph_break"), last
    assert compiled == pytest.approx(eager, rel=1e-4)


# --------------------------------------------------------------------------- in-process: block selection
def test_activation_checkpointing_selects_blocks():
    from trainkit.recipe.blocks import ActivationCheckpointingOptions as AC
    from trainkit.runtime.performance import apply_activation_checkpointing, checkpointed_blocks

    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(6)])
    assert checkpointed_blocks(model, AC(mode="none")) == []
    assert len(checkpointed_blocks(model, AC(mode="full"))) == 6
    assert checkpointed_blocks(model, AC(mode="selective", every_n_blocks=3)) == [model[0], model[3]]
    assert len(checkpointed_blocks(model, AC(mode="full", blocks=["Linear"]))) == 6

    calls = []
    counted = type(model[1])

    class Counted(counted):
        def forward(self, x):
            calls.append(1)
            return super().forward(x)

    names = [n for n, _ in model.named_parameters()]
    apply_activation_checkpointing(model, AC(mode="full"))
    model[1].__class__ = Counted  # after the selection (a class of its own would not repeat)
    model(torch.randn(2, 4)).sum().backward()
    assert len(calls) == 2  # once in forward, once recomputed in backward
    assert [n for n, _ in model.named_parameters()] == names  # no wrapper module: checkpoints keep their keys
    import copy

    twin = copy.deepcopy(model)  # the checkpointed forward binds to the copy, not to the original
    twin(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in twin.parameters()) and len(calls) == 4


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],  # inductor runs g++
                         ids=["eager", "compiled"])
def test_checkpointing_a_block_with_batchnorm_updates_its_statistics_once(compiled):
    """The recomputation runs a checkpointed block's forward again; its BatchNorms in training mode
    must not update their running statistics a second time (they did: num_batches_tracked 2 after one
    step, and a different running mean). Statistics and gradients equal the un-checkpointed model's,
    eager and with each checkpointed block compiled (dynamo's checkpoint region, which runs without the
    eager restore: its recomputation must not replay the update either)."""
    import copy

    from trainkit.recipe.blocks import ActivationCheckpointingOptions as AC
    from trainkit.recipe.blocks import CompileOptions
    from trainkit.runtime.performance import apply_activation_checkpointing, compile_module

    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
                            for _ in range(3)])
    checkpointed = copy.deepcopy(plain)
    blocks = apply_activation_checkpointing(checkpointed, AC(mode="full"))
    assert len(blocks) == 3
    if compiled:
        torch._dynamo.reset()
        for block in blocks:
            compile_module(block, CompileOptions())
    x = torch.randn(4, 3, 8, 8)
    for _ in range(2):
        plain(x).sum().backward()
        checkpointed(x).sum().backward()
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), name  # compiled: reordered sums
    # inductor reorders fp32 sums (a conv bias before a BatchNorm has a gradient of ~0 +- 2e-5)
    rtol, atol = (1e-4, 1e-4) if compiled else (1e-5, 1e-5)
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=rtol, atol=atol), name


@pytest.mark.slow  # inductor runs g++
def test_compile_and_activation_checkpointing_combine_on_the_transformer():
    """torchtitan's order, in one process: every TransformerBlock checkpointed, then compiled. dynamo
    traces the checkpointed forward (no graph break), the block is recomputed in backward, and the loss
    and gradients equal the eager, un-checkpointed model's."""
    import copy

    from torch._dynamo.utils import counters

    from trainkit.models.transformer import TransformerBlock, transformer
    from trainkit.recipe.blocks import ActivationCheckpointingOptions as AC
    from trainkit.recipe.blocks import CompileOptions
    from trainkit.runtime.performance import apply_activation_checkpointing, compile_module

    torch.manual_seed(0)
    eager = transformer(vocab_size=64, dim=32, layers=2, heads=2, seq_len=16)
    model = copy.deepcopy(eager)
    blocks = apply_activation_checkpointing(model, AC(mode="full"))
    assert blocks and all(isinstance(b, TransformerBlock) for b in blocks)
    torch._dynamo.reset()
    counters.clear()
    for block in blocks:
        compile_module(block, CompileOptions())
    tokens = torch.randint(0, 64, (2, 16))
    expected = eager(tokens).float().pow(2).mean()
    expected.backward()
    got = model(tokens).float().pow(2).mean()
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), name
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"], dict(counters["graph_break"])


def test_performance_accepts_the_short_forms():
    from trainkit.recipe.blocks import PerformanceOptions

    p = PerformanceOptions(compile=True, activation_checkpointing="full")
    assert p.compile_options.mode == "default" and p.checkpointing.mode == "full"
    assert PerformanceOptions().compile_options is None
    assert PerformanceOptions(compile={"mode": "max-autotune"}).compile_options.mode == "max-autotune"


# --------------------------------------------------------------------------- bad input, before launch
@pytest.mark.parametrize("sections, field, words", [
    ({"strategy": {"name": "fsdp"}, "performance": {"sync_batchnorm": True}}, "sync_batchnorm", "strategy ddp"),
    ({"performance": {"sync_batchnorm": True}}, "sync_batchnorm", "only on GPUs"),
    ({"performance": {"channels_last": True}, "data": {"name": "synthetic", "batch_size": 8, "shape": [48]}},
     "channels_last", "4-D inputs"),
])
@pytest.mark.slow
def test_bad_performance_combinations_are_refused_with_the_line(tmp_path, sections, field, words):
    path = mlp_recipe(tmp_path, "bad", **sections)
    result = trainkit(tmp_path, "validate", "--deep", str(path))
    assert result.returncode == 2, result.output
    assert f"{path}:" in result.output and field in result.output and words in result.output, result.output
