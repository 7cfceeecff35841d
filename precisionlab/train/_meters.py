"""Meters of lost precision: underflow fraction, log2 histograms, fp32 shadow comparison.

All functions are jittable and return float32/int32 arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "HIST_HI",
    "HIST_LO",
    "hist_edges",
    "log2_histogram",
    "nonfinite_fraction",
    "shadow_stats",
    "underflow_fraction",
]

# Integer binades of log2|x| covered by histograms: [HIST_LO, HIST_HI); values outside are
# counted in the first/last bin. Wide enough for float16 (2**-24 .. 2**16) and most of bfloat16.
HIST_LO, HIST_HI = -64, 32


def hist_edges() -> np.ndarray:
    """The log2 bin edges of :func:`log2_histogram` (``HIST_HI - HIST_LO + 1`` values)."""
    return np.arange(HIST_LO, HIST_HI + 1, dtype=np.int32)


def _floats(tree: Any) -> list[jax.Array]:
    """The floating array leaves (a model's functions and other static leaves are skipped)."""
    return [
        x
        for x in jax.tree_util.tree_leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
    ]


def underflow_fraction(tree: Any, dtype: Any = None, *, nonfinite: bool = True) -> jax.Array:
    """Fraction (float32 scalar) of elements that are zero or subnormal in ``dtype`` (default:
    each leaf's own dtype), and also those that are inf/NaN unless ``nonfinite=False`` (the
    train step's meter separates them: :func:`nonfinite_fraction`). Elements are compared as
    float32 magnitudes against the format's smallest normal, so the check is the same on every
    backend."""
    bad = jnp.zeros((), jnp.float32)
    total = 0
    for x in _floats(tree):
        tiny = float(jnp.finfo(x.dtype if dtype is None else dtype).tiny)
        a = jnp.abs(x.astype(jnp.float32))
        hit = (a < jnp.float32(tiny)) | ~jnp.isfinite(a) if nonfinite else a < jnp.float32(tiny)
        bad = bad + jnp.sum(hit, dtype=jnp.float32)
        total += x.size
    return bad / jnp.float32(max(total, 1))


def nonfinite_fraction(tree: Any) -> jax.Array:
    """Fraction (float32 scalar) of the floating elements of ``tree`` that are inf or NaN."""
    bad = jnp.zeros((), jnp.float32)
    total = 0
    for x in _floats(tree):
        bad = bad + jnp.sum(~jnp.isfinite(x), dtype=jnp.float32)
        total += x.size
    return bad / jnp.float32(max(total, 1))


def log2_histogram(tree: Any) -> dict[str, jax.Array]:
    """Histogram of floor(log2|x|) over every floating element of ``tree``.

    Returns ``counts`` (int32[HIST_HI - HIST_LO]: bin i holds 2**(HIST_LO + i) <= |x| <
    2**(HIST_LO + i + 1), clipped at both ends), ``zeros`` and ``nonfinite`` (int32 scalars).
    """
    nbins = HIST_HI - HIST_LO
    counts = jnp.zeros((nbins,), jnp.int32)
    zeros = jnp.zeros((), jnp.int32)
    nonfinite = jnp.zeros((), jnp.int32)
    for x in _floats(tree):
        a = jnp.abs(x.astype(jnp.float32)).reshape(-1)
        finite = jnp.isfinite(a)
        nz = finite & (a > 0)
        # frexp is exact on the bits (no log rounding at binade edges); mantissa in [0.5, 1).
        _, e = jnp.frexp(jnp.where(nz, a, 1.0))
        idx = jnp.clip(e - 1 - HIST_LO, 0, nbins - 1)
        counts = counts + jnp.bincount(
            jnp.where(nz, idx, 0), weights=nz.astype(jnp.int32), length=nbins
        ).astype(jnp.int32)
        zeros = zeros + jnp.sum(finite & (a == 0), dtype=jnp.int32)
        nonfinite = nonfinite + jnp.sum(~finite, dtype=jnp.int32)
    return {"counts": counts, "zeros": zeros, "nonfinite": nonfinite}


def shadow_stats(
    grads: Any, grads_fp32: Any, grads_compute: Any | None = None
) -> dict[str, jax.Array]:
    """Compare unscaled float32 ``grads`` of the mixed-precision step with an fp32 pass.

    Returns ``cosine`` (cosine similarity over all elements, float32) and ``underflow_lost``:
    among elements nonzero in the fp32 gradient, the fraction that are zero in
    ``grads_compute`` (the compute-dtype gradient before unscaling; default ``grads``).
    """
    g = [x.astype(jnp.float32).reshape(-1) for x in _floats(grads)]
    r = [x.astype(jnp.float32).reshape(-1) for x in _floats(grads_fp32)]
    c = g if grads_compute is None else [x.reshape(-1) for x in _floats(grads_compute)]
    dot = sum(jnp.sum(a * b) for a, b in zip(g, r, strict=True))
    na = jnp.sqrt(sum(jnp.sum(a * a) for a in g))
    nb = jnp.sqrt(sum(jnp.sum(b * b) for b in r))
    cosine = dot / jnp.maximum(na * nb, jnp.float32(1e-30))
    ref_nz = sum(jnp.sum(b != 0, dtype=jnp.float32) for b in r)
    lost = sum(jnp.sum((b != 0) & (x == 0), dtype=jnp.float32) for b, x in zip(r, c, strict=True))
    return {"cosine": cosine, "underflow_lost": lost / jnp.maximum(ref_nz, 1.0)}
