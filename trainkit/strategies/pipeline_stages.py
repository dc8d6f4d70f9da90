"""Stage planning for the pipeline strategy: where a model is cut, how stages map to ranks, and the
stage modules themselves -- pure functions over an `nn.Module`, apart from the strategy's
process groups and schedules (trainkit.strategies.pipeline), so they can be read and tested alone.

Two ways to cut a model: an `nn.Sequential` (nested Sequentials are flattened) is cut between its
blocks, at named blocks or balanced by parameters; any other model is traced with
`torch.distributed.pipelining.pipeline` and cut before each named split point.
"""

from __future__ import annotations


import torch
from torch import nn

from ..recipe.blocks import PipelineOptions
from ..recipe.problems import did_you_mean
from ..runtime.performance import checkpointed_blocks


class SplitError(ValueError):
    pass


# --------------------------------------------------------------------------- splitting (pure functions)
def is_sequential(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential)


def module_names(model: nn.Module) -> list[str]:
    """Qualified names of the submodules of a traced model, in registration order (the order a
    split point list must follow)."""
    return [n for n, _ in model.named_modules() if n]


def traced_split_problems(model: nn.Module, split_points: list[str]) -> list[tuple[int, str]]:
    """(index or -1, message) for split points of a non-Sequential model that do not exist or are
    out of order."""
    names = module_names(model)
    out = []
    if not split_points:
        return [(-1, f"the pipeline strategy cuts a non-Sequential model ({type(model).__name__}) only at named "
                     f"split points: set strategy.split_points, e.g. [{_middle_child(model)}]")]
    order = []
    for i, point in enumerate(split_points):
        if point not in names:
            top = [n for n, _ in model.named_children()]
            out.append((i, f"split point '{point}' is not a module of the model{did_you_mean(point, names)} "
                           f"(top-level modules in order: {', '.join(top)})"))
        else:
            order.append(names.index(point))
    if not out and (order != sorted(set(order)) or order[0] == 0):
        out.append((-1, f"split points {split_points} must name different modules in forward order, after the "
                        f"first one"))
    return out


def _middle_child(model: nn.Module) -> str:
    children = [n for n, _ in model.named_children()]
    return children[len(children) // 2] if children else "layer3"


def flatten_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the leaves of nested Sequentials, in forward order."""
    if not isinstance(model, nn.Sequential):
        raise SplitError(f"the pipeline strategy needs an nn.Sequential model (its forward is then the chain of "
                         f"its blocks); got {type(model).__name__}")
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, seq: nn.Sequential) -> None:
        for name, child in seq.named_children():
            if isinstance(child, nn.Sequential):
                visit(f"{prefix}{name}.", child)
            else:
                out.append((f"{prefix}{name}", child))

    visit("", model)
    return out


def stage_count(options: PipelineOptions, world_size: int) -> int:
    if options.split_points:
        return len(options.split_points) + 1
    return world_size * (2 if options.schedule == "interleaved_1f1b" else 1)


def boundaries_from_names(names: list[str], split_points: list[str]) -> list[int]:
    """Block index where each stage after the first begins."""
    starts = []
    for point in split_points:
        hits = [i for i, n in enumerate(names) if n == point or n.startswith(point + ".")]
        if not hits:
            raise SplitError(f"split point '{point}' is not a module of the model")
        if hits[0] == 0:
            raise SplitError(f"split point '{point}' is the first block: stage 0 would be empty")
        starts.append(hits[0])
    if starts != sorted(set(starts)):
        raise SplitError(f"split points {split_points} must name different modules in forward order")
    return starts


def balanced_boundaries(sizes: list[int], stages: int) -> list[int]:
    """Cut `sizes` (parameters per block) into `stages` non-empty runs minimising the largest run."""
    n = len(sizes)
    if n < stages:
        raise SplitError(f"{stages} stages need at least {stages} blocks, the model has {n}")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest max-stage-size splitting blocks[:i] into k stages; cut[k][i]: start of the last
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return sorted(starts)[1:]


def plan_stages(model: nn.Module, options: PipelineOptions, world_size: int) -> list[list[tuple[str, nn.Module]]]:
    blocks = flatten_blocks(model)
    names = [n for n, _ in blocks]
    if options.split_points:
        starts = boundaries_from_names(names, options.split_points)
    else:
        starts = balanced_boundaries([sum(p.numel() for p in m.parameters()) for _, m in blocks],
                                     stage_count(options, world_size))
    edges = [0] + starts + [len(blocks)]
    return [blocks[a:b] for a, b in zip(edges, edges[1:])]


def stages_of_rank(rank: int, num_stages: int, world_size: int) -> list[int]:
    """Round-robin ("loop") placement: rank r holds stages r, r + world_size, ..."""
    return list(range(rank, num_stages, world_size))


def stage_flops(stages: list[nn.Module], x: torch.Tensor) -> list[float]:
    """FLOPs of one forward + backward of each stage on `x` (the whole batch: micro-batching does
    not change the sum), counted as the pipeline runs them: every stage after the first also computes
    the gradient of its input, to send it back. Works on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    out = []
    for i, stage in enumerate(stages):
        x = x.detach().requires_grad_(i > 0)
        counter = FlopCounterMode(display=False)
        with counter:
            y = stage(x)
            y.float().sum().backward()
        out.append(float(counter.get_total_flops()))
        x = y
    return out


class StageModule(nn.Module):
    """A run of consecutive blocks; state_dict keys are the original model's."""

    def __init__(self, blocks: list[tuple[str, nn.Module]]):
        super().__init__()
        self.names = [n for n, _ in blocks]
        self.blocks = nn.ModuleList([m for _, m in blocks])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def model_state_dict(self) -> dict:
        return {f"{n}.{k}": v for n, m in zip(self.names, self.blocks) for k, v in m.state_dict().items()}

    def load_model_state_dict(self, state: dict) -> None:
        for n, m in zip(self.names, self.blocks):
            m.load_state_dict({k[len(n) + 1:]: v for k, v in state.items() if k.startswith(n + ".")})


def nested_stage(blocks: list[tuple[str, nn.Module]]) -> nn.Sequential:
    """The model with only `blocks` left (qualified names of nested Sequentials, `flatten_blocks`'):
    Sequentials nested as in the model, each block under its own name, so the forward is still the
    composition of the blocks kept and every parameter keeps its original name (torchtitan's split
    deletes the layers a stage does not own from a copy of the model; here the kept blocks are moved
    into fresh containers, which leaves the model's own forward, e.g. a token check, out of it).
    What tensor parallel plans and DCP checkpoints address by name then needs no renaming."""
    root = nn.Sequential()
    for name, block in blocks:
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if part not in parent._modules:
                parent.add_module(part, nn.Sequential())
            parent = parent._modules[part]
        parent.add_module(leaf, block)
    return root


class TracedStage(nn.Module):
    """A stage cut by the tracer (a GraphModule whose submodules keep the original qualified
    names): the same checkpoint interface as `StageModule`.

    Its outputs leave in the dtype they had when traced (fp32): the next stage's receive buffers are
    sized and typed from the trace, so a bf16 activation sent under autocast would be read as half
    as many fp32 values -- garbage that diverges within steps (torch checks the dtype only under
    TORCH_DISTRIBUTED_DEBUG=DETAIL). The receiving stage's autocast casts it down again."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.names = sorted({k.split(".")[0] for k in module.state_dict()})
        # a hook on the stage module itself: the schedule runs it, not this wrapper
        module.register_forward_hook(_outputs_as_traced)

    def forward(self, *args):
        return self.module(*args)

    def model_state_dict(self) -> dict:
        return dict(self.module.state_dict())

    def load_model_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


def _outputs_as_traced(module, args, out):
    return tuple(_as_traced(o) for o in out) if isinstance(out, tuple) else _as_traced(out)


def _as_traced(value):
    """A floating activation in fp32, the dtype the tracer recorded (it traces without autocast)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def example_inputs(d, microbatches: int) -> torch.Tensor:
    """A zero micro-batch of the data block's input shape: what the tracer runs the model on."""
    shape = d.sample_shape()
    if shape is None:
        raise SplitError(f"the pipeline tracer needs the input shape of data '{d.name}'")
    return torch.zeros([max(1, d.batch_size // microbatches)] + list(shape))


def checkpointed_names(model: nn.Module, ac) -> list[str]:
    """Qualified names of the blocks performance.activation_checkpointing selects in the whole model."""
    chosen = {id(m) for m in checkpointed_blocks(model, ac)}
    return [n for n, m in model.named_modules() if id(m) in chosen]
