"""Tasks: what a run learns (the `task:` block, entry-point group ``trainkit.tasks``).

A task implements `runtime.protocols.Task`: it moves a batch to the device, owns the loss the
strategy calls, the metrics at log and eval steps, and the FLOPs estimate behind MFU. Built-ins:
`classification` (the default) and `causal_lm`. A task is constructed as
``Task(options, *, device, **Task.run_inputs(recipe))`` (runtime.components.build_task): the
classmethod names what it takes from the recipe beyond its own block.
"""
