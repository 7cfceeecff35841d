"""Training with a low-precision matmul recipe (FP8, MX, NVFP4): the typed option and its
parsing from a config value.

``TrainConfig.recipe`` is a recipe name (``"mxfp8"``) or a table with ``name``, the recipe's
fields (``scale_rule = "floor"``), ``include`` / ``exclude`` (positions, names, parameter
paths, glob patterns or ``"re:..."`` regular expressions of the matmuls and convolutions,
see :func:`precisionlab.recipes.apply`; excluded ones stay in the policy's compute dtype) and
``attention`` (true: the products of two activations too; default false, as Transformer
Engine). It is parsed once, into a :class:`TrainRecipe`, when the config is
made. The train step applies it to the loss function with :func:`precisionlab.recipes.apply`,
so every ``dot_general`` of a built-in (or any) model goes through the recipe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from precisionlab.recipes import RECIPE_NAMES, AppliedRecipe, Recipe, apply, get_recipe

__all__ = ["RECIPE_TABLE_KEYS", "TrainRecipe", "parse_recipe"]

#: Keys of a recipe table besides the recipe's own fields.
RECIPE_TABLE_KEYS: tuple[str, ...] = ("name", "include", "exclude", "attention")


def _sites(value: Any, where: str) -> tuple[int | str, ...]:
    items = [value] if isinstance(value, str | int) and not isinstance(value, bool) else value
    if not isinstance(items, list | tuple) or not all(
        isinstance(x, str | int) and not isinstance(x, bool) for x in items
    ):
        raise ValueError(
            f"{where} must be a list of matmul positions (int) or names/patterns (str), "
            f"got {value!r}"
        )
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class TrainRecipe:
    """A recipe and which matmuls it replaces (hashable: a static part of the step).

    recipe: the :class:`~precisionlab.recipes.Recipe`. include: positions / names / patterns
    of the matmuls replaced (None: all but the products of two activations). exclude: those
    kept in high precision. attention: replace the products of two activations (attention's
    ``QK^T`` and ``PV``) too.
    """

    recipe: Recipe
    include: tuple[int | str, ...] | None = None
    exclude: tuple[int | str, ...] = ()
    attention: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            raise TypeError(f"recipe must be a Recipe, got {type(self.recipe).__name__}")
        if not isinstance(self.attention, bool):
            raise ValueError(f"recipe attention must be true or false, got {self.attention!r}")

    def selects(self, site: Any) -> bool:
        """Whether a site is replaced when ``include`` is not given: all but the products of
        two activations, unless ``attention``."""
        return self.attention or not site.activations_only

    @property
    def stateful(self) -> bool:
        """Whether the recipe keeps state across steps (delayed scaling's amax history)."""
        return self.recipe.stateful

    def numbers(self) -> dict[str, Any]:
        """The recipe's value fields as float32 arrays (:meth:`Recipe.numbers
        <precisionlab.recipes.Recipe.numbers>`): the train step takes them as arguments
        (``TrainState.values["recipe"]``), so runs differing only in them share a program."""
        return self.recipe.numbers()

    def structure(self) -> TrainRecipe:
        """This recipe with its value fields fixed (see :meth:`numbers`): what a program's
        key names."""
        return dataclasses.replace(self, recipe=self.recipe.structure())

    def for_values(self, values: Mapping[str, Any] | None) -> TrainRecipe:
        """This recipe computing with ``values["recipe"]`` (a step's traced values) when
        given, else with the constants of its fields."""
        if not values or "recipe" not in values:
            return self
        return dataclasses.replace(self, recipe=self.recipe.with_numbers(values["recipe"]))

    def apply(self, fn: Any) -> AppliedRecipe:
        """``fn`` with the recipe applied (see :func:`precisionlab.recipes.apply`): an
        :class:`~precisionlab.recipes.AppliedRecipe` (the :class:`~precisionlab.recipes.RecipeSpec`
        contract)."""
        return apply(
            fn, self.recipe, include=self.include, exclude=self.exclude, attention=self.attention
        )


def _padded(recipe: Recipe, given: Mapping[str, Any]) -> Recipe:
    # A model's sizes are rarely all multiples of the blocks (10 classes, a 32-token vocabulary):
    # zero padding changes neither a block's amax nor the products, so a named recipe pads in
    # training unless the table says pad = false.
    names = {f.name for f in dataclasses.fields(recipe)}
    if "pad" in names and "pad" not in given:
        return dataclasses.replace(recipe, pad=True)  # type: ignore[call-arg]  # a recipe with a pad field
    return recipe


def parse_recipe(value: str | Mapping[str, Any] | Recipe | TrainRecipe) -> TrainRecipe:
    """A :class:`TrainRecipe` from a config value: a name, a table (``name`` plus the
    recipe's fields and ``include`` / ``exclude``), a Recipe or a TrainRecipe. Raises
    ValueError (one line) naming an unknown recipe or key and what is allowed. Block recipes
    named here pad a contraction that is not a multiple of the block with zeros (``pad=True``)
    unless the table gives ``pad``."""
    if isinstance(value, TrainRecipe):
        return value
    if isinstance(value, Recipe):
        return TrainRecipe(value)
    if isinstance(value, str):
        return TrainRecipe(_padded(get_recipe(value), {}))
    if not isinstance(value, Mapping):
        raise ValueError(
            f"expected a recipe name or a table, got {type(value).__name__} {value!r}; "
            f"names: {', '.join(RECIPE_NAMES)}"
        )
    if "name" not in value:
        raise ValueError(
            f"a recipe table needs a 'name' (one of {', '.join(RECIPE_NAMES)}), got keys "
            f"{sorted(value)}"
        )
    fields = {k: v for k, v in value.items() if k not in RECIPE_TABLE_KEYS}
    include = value.get("include")
    return TrainRecipe(
        _padded(get_recipe(value["name"], **fields), fields),
        include=None if include is None else _sites(include, "include"),
        exclude=_sites(value.get("exclude", ()), "exclude"),
        attention=value.get("attention", False),
    )
