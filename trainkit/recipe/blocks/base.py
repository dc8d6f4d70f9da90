"""The two bases of every recipe block: unknown keys are errors, values are immutable; plugin blocks
are selected by `name` and carry the `component` their runtime piece is imported from."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

Finding = tuple[tuple, str]  # (recipe path, message): a rule's error, located at the path's line
PreflightFinding = tuple[tuple, str, str]  # (recipe path, message, "error" | "warning")


class Block(BaseModel):
    """Base of every recipe block: unknown keys are errors, values are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginBlock(Block):
    """A block selected by its ``name`` from a plugin registry."""

    component: ClassVar[str] = ""

    @classmethod
    def plugin_name(cls) -> str:
        """The `name:` this options class accepts (its Literal tag)."""
        annotation = cls.model_fields["name"].annotation
        return str(getattr(annotation, "__args__", ("?",))[0])
