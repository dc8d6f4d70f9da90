"""JSON Schema of recipes, for editors (VS Code YAML extension) and other tools."""

from __future__ import annotations

from typing import Any

from .. import registry
from .schema import full_recipe_model


def recipe_json_schema() -> dict[str, Any]:
    schema = full_recipe_model().model_json_schema()
    props = schema.setdefault("properties", {})
    props["defaults"] = {
        "description": "recipe files merged under this one, in order (paths relative to this file)",
        "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
    }
    # monitors may be written by name alone: `monitors: [system, throughput]`
    monitors = props.get("monitors", {})
    items = monitors.get("items")
    if items is not None:
        monitors["items"] = {"anyOf": [{"enum": registry.names("monitors")}, items]}
    props["model"] = {
        "$ref": props.get("model", {}).get("$ref", "#/$defs/ModelSpec"),
        "description": "torchvision.<name>, 'pkg.module:factory', or a registered model: "
                       + ", ".join(registry.names("models")),
    }
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "trainkit recipe"
    return schema
