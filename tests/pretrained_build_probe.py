"""Run under torchrun by tests/test_effects_transformer.py: build a recipe's model as the worker does
(`build_initial_model`, then the strategy's `setup`), and report rank 0's resident high-water mark
(VmHWM) at the point every parameter exists as the rank holds it, before the pretrained read; then
read the pretrained directory and report again. One JSON line on stdout."""

import json
import os
import sys

import torch
import torch.distributed as dist


def high_water_mark() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


def main(recipe_path: str) -> None:
    from trainkit.recipe import resolve
    from trainkit.runtime.components import build_strategy
    from trainkit.runtime.mesh import build_mesh
    from trainkit.runtime.model import build_initial_model
    from trainkit.runtime.optim import build_optimizer
    from trainkit.runtime.precision import Precision
    from trainkit.runtime.pretrained import WeightsFile, pretrained_source

    dist.init_process_group("gloo")
    recipe, device = resolve(recipe_path).recipe, torch.device("cpu")
    dims = recipe.parallel_dims(dist.get_world_size())
    strategy = build_strategy(recipe, device=device, precision=Precision(recipe.precision, device), dims=dims,
                              mesh=build_mesh(dims, device.type))
    started = high_water_mark()
    model, init = build_initial_model(recipe.model, strategy, recipe.seed)
    model, _ = strategy.setup(model, lambda params: build_optimizer(recipe.optimizer, params))
    built = high_water_mark()
    bare = strategy.unwrap(model)
    source = pretrained_source(bare)
    if source is not None:  # built without its weights (meta): each rank reads its own slices
        source.load_into(bare)
    read = high_water_mark()
    # LoRA's B matrices must start at zero (PEFT's init: the adapted model starts as the checkpoint)
    lora_b = max((float(p.detach().to_local().abs().max()) if hasattr(p, "to_local") else float(p.abs().max()))
                 for name, p in bare.named_parameters() if "lora_B" in name) if "lora" in recipe.model.args else None
    # a weights file's every entry must be in the model after the read, whichever way it was built
    weights_diff = None
    if recipe.model.weights:
        stored = WeightsFile(recipe.model.weights)
        weights_diff = max(float(((t.full_tensor() if hasattr(t, "full_tensor") else t).detach().double()
                                  - stored.read(name).double()).abs().max()) for name, t in bare.state_dict().items())
    if dist.get_rank() == 0:
        print(json.dumps({"init": init, "started": started, "built": built, "read": read,
                          "lora_b_max": lora_b, "weights_diff": weights_diff}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # as the worker leaves: gloo's threads can abort interpreter finalization (runtime/worker.py)
