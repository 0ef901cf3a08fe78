"""Recipes: YAML files validated into pydantic models."""

from moetool.recipe.load import load_recipe, recipe_json_schema, recipe_models
from moetool.recipe.mofe import ExpertSpec, MoFERecipe, SharedExpertSpec

__all__ = [
    "ExpertSpec",
    "MoFERecipe",
    "SharedExpertSpec",
    "load_recipe",
    "recipe_json_schema",
    "recipe_models",
]
