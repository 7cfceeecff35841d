"""Building a dataclass by name from a registry (the built-in models and datasets): one place for
the two checks every registry makes, an unknown name and an unknown option, both a ValueError
that lists what is allowed."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["build", "lookup"]

T = TypeVar("T")


def lookup(builders: Mapping[str, type[T]], name: str, what: str) -> type[T]:
    """The class registered as ``name`` in ``builders``; ValueError naming ``what`` (``"model"``,
    ``"dataset"``) and the registered names otherwise."""
    if name not in builders:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(builders)}")
    return builders[name]


def build(builders: Mapping[str, type[T]], name: str, what: str, kwargs: Mapping[str, Any]) -> T:
    """``lookup(builders, name, what)(**kwargs)``; an option that is not a field of the class is a
    ValueError listing its fields."""
    cls = lookup(builders, name, what)
    allowed = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # registered dataclasses
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for {what} {name!r}; allowed: "
            f"{', '.join(allowed)}"
        )
    return cls(**kwargs)
