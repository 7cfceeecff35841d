"""Rounding modes shared by the vectorized codec and the scalar reference."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ROUNDING_MODES", "Rounding", "parse_rounding"]


class Rounding(StrEnum):
    """How a value between two representable neighbours is resolved.

    - ``nearest_even``: nearest; ties to the neighbour with an even last significand bit (IEEE).
    - ``nearest_away``: nearest; ties away from zero.
    - ``toward_zero``: the neighbour of smaller magnitude (truncation).
    - ``up``: the larger neighbour (toward +inf).
    - ``down``: the smaller neighbour (toward -inf).
    - ``to_odd``: truncate, then set the last bit if the result is inexact (avoids double
      rounding when a wider intermediate is rounded again).
    - ``stochastic``: the larger magnitude with probability equal to the fractional distance,
      so the expected result equals the input (needs a PRNG key).
    """

    NEAREST_EVEN = "nearest_even"
    NEAREST_AWAY = "nearest_away"
    TOWARD_ZERO = "toward_zero"
    UP = "up"
    DOWN = "down"
    TO_ODD = "to_odd"
    STOCHASTIC = "stochastic"


#: The rounding mode names the codecs accept (the values of :class:`Rounding`).
ROUNDING_MODES: tuple[str, ...] = tuple(mode.value for mode in Rounding)


def parse_rounding(mode: str | Rounding) -> Rounding:
    """Validate a rounding mode name; ``ValueError`` lists the allowed names."""
    if isinstance(mode, Rounding):
        return mode
    if isinstance(mode, str):
        try:
            return Rounding(mode.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"unknown rounding mode {mode!r}; allowed: {', '.join(ROUNDING_MODES)}")
