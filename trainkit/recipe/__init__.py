"""The recipe language: safe YAML + composition + overrides -> a validated, frozen Recipe."""

from .problems import Location, Problem, RecipeError
from .resolver import Resolved, resolve
from .schema import Recipe

__all__ = ["Location", "Problem", "RecipeError", "Recipe", "Resolved", "resolve"]
