"""The recipe contract the train step relies on, written down as Protocols.

A training recipe (``TrainRecipe``, diagnose's ``AutoSwitchRecipe``) says whether it keeps state
and applies itself to a loss function; what it returns (:class:`AppliedRecipe`: ``Applied`` for
the matmul recipes, autoswitch's switching wrapper) lists the matmuls it replaces, makes their
fresh state, computes value, gradients and observations in one call, and folds the
observations into the next step's state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from precisionlab.intercept import Site

__all__ = ["AppliedRecipe", "RecipeSpec"]


@runtime_checkable
class AppliedRecipe(Protocol):
    """A loss function with a recipe applied, as the train step uses it."""

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """The matched matmuls for these arguments (``selected``: replaced)."""
        ...

    def init_state(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fresh per-site state for these arguments (``{}`` when stateless)."""
        ...

    def value_and_grad(
        self, argnums: int | Sequence[int] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any, dict]]:
        """``f(state, *args, key=None, **kwargs) -> (value, grads, observed)``: as
        ``jax.value_and_grad`` plus what the step observed, for :meth:`update_state`."""
        ...

    def update_state(self, state: dict, observed: dict, *, skip: Any = False) -> dict:
        """The state after a step that observed ``observed`` (unchanged where ``skip``)."""
        ...


@runtime_checkable
class RecipeSpec(Protocol):
    """A training recipe: whether it keeps state, and itself applied to a loss function."""

    @property
    def stateful(self) -> bool:
        """Whether the recipe's state (a field of the train state) changes across steps."""
        ...

    def apply(self, fn: Any) -> AppliedRecipe:
        """``fn`` with the recipe applied."""
        ...
