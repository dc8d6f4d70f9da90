"""The one place that learns when a process group appears in this process.

Groups appear after start-up too: the device mesh flattens dimensions on first use (FSDP's "dp" for a
gradient norm, DTensor's "dp_shard_tp"), the background checkpoint writer makes its own gloo group.
Whoever watches groups -- the Flight Recorder hooks every group's collectives, the breakdown
monitor's mesh timer times each mesh dimension's -- asks here instead of keeping a registry of its own.

Why a wrapper: torch has no public callback on group creation, so this wraps the one function every
group passes through, `distributed_c10d._register_pg_in_world`, once per process.
"""

from __future__ import annotations

from typing import Any, Callable

_subscribers: list[Callable[[Any], None]] = []
_generation = 0  # how many groups appeared since the wrapper was installed
_installed = False


def _install() -> bool:
    global _installed
    if _installed:
        return True
    from torch.distributed import distributed_c10d

    register = getattr(distributed_c10d, "_register_pg_in_world", None)
    if register is None:  # another torch: nothing learns of later groups
        return False

    def register_and_tell(pg, *args, **kwargs):
        global _generation
        result = register(pg, *args, **kwargs)
        _generation += 1
        for callback in list(_subscribers):
            callback(pg)
        return result

    distributed_c10d._register_pg_in_world = register_and_tell
    _installed = True
    return True


def each_group(callback: Callable[[Any], None]) -> bool:
    """Call `callback(group)` for every process group this process has now and for each one made
    later. False (nothing is called for later groups) where this torch lacks the registration function."""
    from torch.distributed import distributed_c10d

    installed = _install()
    if installed:
        _subscribers.append(callback)
    for group in list(distributed_c10d._world.pg_map):
        callback(group)
    return installed


def generation() -> int:
    """A number that changes whenever a process group appears (after `watch()`): a cheap "anything
    new?" for a watcher that re-reads its groups at its own pace."""
    return _generation


def watch() -> bool:
    """Start counting new groups (`generation`); False where this torch cannot tell."""
    return _install()
