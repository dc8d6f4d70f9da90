"""Task options: the `task:` block (what a run learns)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .base import PluginBlock


class TaskOptions(PluginBlock):
    """What a run learns: batch to device, the loss, logged/eval metrics and FLOPs (`runtime.protocols.Task`)."""

    # the kinds of batch it trains on (DataOptions.batches): "labelled" (input, label) pairs, "tokens"
    accepts: ClassVar[frozenset] = frozenset({"labelled"})


class ClassificationTaskOptions(TaskOptions):
    """Cross-entropy on (input, label) batches; eval loss and accuracy (the default task)."""

    component: ClassVar[str] = "trainkit.tasks.classification:ClassificationTask"
    name: Literal["classification"]


class CausalLMTaskOptions(TaskOptions):
    """Next-token prediction on (tokens, shifted tokens); loss, perplexity, tokens/s; eval perplexity."""

    component: ClassVar[str] = "trainkit.tasks.causal_lm:CausalLMTask"
    name: Literal["causal_lm"]
    accepts: ClassVar[frozenset] = frozenset({"tokens"})
    ignore_index: int = Field(default=-100, description="target id that does not count (padding)")
