"""Every recipe by name: the vendor recipes of :mod:`precisionlab.recipes._recipes` and the
published 4-bit recipes of :mod:`precisionlab.recipes._fp4` (:data:`RECIPE_NAMES`,
:func:`get_recipe`)."""

from __future__ import annotations

from typing import Any

from precisionlab.recipes import _recipes
from precisionlab.recipes._fp4 import FP4_RECIPES
from precisionlab.recipes._recipes import Recipe

__all__ = ["RECIPE_NAMES", "get_recipe"]

#: The names :func:`get_recipe` accepts: the vendor recipes, then the published FP4 recipes.
RECIPE_NAMES: tuple[str, ...] = _recipes.RECIPE_NAMES + tuple(FP4_RECIPES)


def get_recipe(name: str | Recipe, **overrides: Any) -> Recipe:
    """The recipe called ``name`` (one of :data:`RECIPE_NAMES`) with its defaults, fields
    overridden by keyword (``get_recipe("mxfp8", scale_rule="floor")``,
    ``get_recipe("tetrajet", fmt="nvfp4")``); a Recipe passes through."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in FP4_RECIPES:
        try:
            return _recipes.get_recipe(name, **overrides)
        except ValueError as err:
            if not str(err).startswith("unknown recipe"):
                raise
            allowed = ", ".join(RECIPE_NAMES)
            raise ValueError(f"unknown recipe {name!r}; allowed: {allowed}") from None
    cls, kw = FP4_RECIPES[key]
    return _recipes.build_preset(name, cls, kw, overrides)
