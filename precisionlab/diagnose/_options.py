"""Checks the options of the diagnose modes share (:class:`~precisionlab.diagnose.BisectOptions`,
:class:`~precisionlab.diagnose.CompareOptions`, :class:`~precisionlab.diagnose.SwitchOptions`)."""

from __future__ import annotations

__all__ = ["check_counts"]


def check_counts(
    options: object, counts: tuple[str, ...] = (), optional: tuple[str, ...] = ()
) -> None:
    """ValueError naming the first bad one unless each attribute of ``options`` named in
    ``counts`` is an int >= 1 and each named in ``optional`` is one or None."""
    for name in (*counts, *optional):
        v = getattr(options, name)
        if v is None and name in optional:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
