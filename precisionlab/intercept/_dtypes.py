"""Which dtype the matmuls and convolutions of a program multiply in, by FLOPs."""

from __future__ import annotations

import math
from collections.abc import Sequence

from precisionlab.intercept import _boundary as boundary
from precisionlab.intercept._sites import Site

__all__ = ["compute_line", "flops_by_dtype"]

#: The primitives whose compute dtype is audited.
PRODUCTS = boundary.PRODUCTS


def _runs(site: Site) -> int:
    """How many times a site runs per call: the product of its enclosing scans' lengths (a
    ``while_loop``'s count is unknown: once)."""
    return math.prod(n for n in site.lengths if n is not None)


def flops_by_dtype(sites: Sequence[Site]) -> dict[str, int]:
    """FLOPs per compute dtype (:attr:`Site.compute_dtype`) of the matmuls and convolutions
    among ``sites``, loop iterations counted, largest first."""
    out: dict[str, int] = {}
    for s in sites:
        if s.primitive in PRODUCTS:
            out[s.compute_dtype] = out.get(s.compute_dtype, 0) + s.flops * _runs(s)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def compute_line(sites: Sequence[Site]) -> str:
    """One line: the share of the matmul and convolution FLOPs in each dtype
    (``"compute dtypes: 12 matmuls/convolutions, float32 97.9% of FLOPs, bfloat16 2.1%"``)."""
    by = flops_by_dtype(sites)
    n = sum(s.primitive in PRODUCTS for s in sites)
    total = sum(by.values())
    if not n:
        return "compute dtypes: no matmul or convolution"
    shares = ", ".join(f"{d} {100 * f / total:.1f}%" for d, f in by.items()) if total else "-"
    return f"compute dtypes: {n} matmuls/convolutions, FLOPs in {shares}"
