"""Tensor statistics inside ``jit``: exact counts on the bit patterns, combinable sums.

:func:`tensor_stats` returns a :class:`TensorStats` pytree of raw accumulators (counts,
extremes and normalised sums) rather than finished numbers, so that statistics of shards,
micro-batches or steps combine exactly (:func:`combine`, :func:`reduce_over`) before
:func:`derive` turns them into amax, dynamic range, mean, std and fractions.

Conventions:

- Magnitudes are compared on the float32 bit patterns (XLA on CPU flushes float32
  subnormals in float arithmetic and comparisons): ``amax``, the smallest nonzero magnitude,
  zeros and every per-target count are exact, subnormals included.
- NaN and inf are counted (``n_nan``, ``n_inf``) and left out of every other statistic.
- Sums are taken of ``x * 2**-k`` with ``k = floor(log2 amax)`` (exact power-of-two
  scaling), so neither huge values nor subnormal ones overflow or flush in the squares.
  Mean and variance are kept as (count, mean, sum of squared deviations) and combined with
  Chan et al.'s pairwise formula (stable where sum/sum-of-squares cancels).
- Per target (:mod:`precisionlab.telemetry._targets`), over the finite nonzero elements:
  ``overflow`` (the scaled magnitude rounds past the format's max: a non-saturating cast
  gives inf/NaN; the quantized copy, like every recipe, clips it to +-max), ``saturate``
  (the quantized element is +-max: the overflows plus the values rounding to max),
  ``underflow`` (quantized to +-0), ``subnormal`` (a nonzero subnormal of the format),
  ``poisoned`` (the copy is NaN: a NaN/inf in the element's scaling group), and the squared
  error of the dequantized copy for the SQNR.
- Cost (:func:`stacked_stats`): the counts of plain and tensorwise targets compare the scaled
  magnitudes' bits with each format's exact thresholds (no cast), all counts and extremes
  are one integer reduction over the elements, and the quantized copies come from
  :func:`~precisionlab.telemetry._targets.round_to_format` (a few float or bit operations,
  bit for bit the recipes' encode and decode); ``tests/test_telemetry_fast.py`` checks them
  against the exact-cast path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from precisionlab.quant import _pow2 as pow2
from precisionlab.recipes import _scaling as S
from precisionlab.telemetry._targets import (
    EPS,
    Target,
    count_thresholds,
    magnitude_bits,
    parse_targets,
    quantize_target,
    round_to_format,
)

__all__ = [
    "TensorStats",
    "combine",
    "derive",
    "reduce_over",
    "stacked_stats",
    "stats_of_many",
    "tensor_stats",
    "to_dict",
]

_INF_BITS = np.uint32(0x7F800000)
_EMPTY_K = pow2.ZERO_LOG2  # normaliser exponent of a tensor without nonzero finite values


class TensorStats(NamedTuple):
    """Raw accumulators of one tensor (a pytree; T = number of targets).

    Counts are int32 scalars (``per_target`` ones (T,)); ``amax`` / ``amin`` float32 (max
    and smallest nonzero finite magnitude; amin is +inf when there is none); ``k`` int32
    normaliser exponent; ``mean_n``, ``m2_n``, ``power_n`` float32: mean, sum of squared
    deviations and sum of squares of ``x * 2**-k`` over the finite elements; ``noise_n``
    (T,) float32 sum of squared quantization errors, same units.
    """

    n: jax.Array
    n_nan: jax.Array
    n_inf: jax.Array
    n_zero: jax.Array
    n_nonzero: jax.Array  # finite and nonzero: the denominator of the per-target fractions
    amax: jax.Array
    amin: jax.Array
    k: jax.Array
    mean_n: jax.Array
    m2_n: jax.Array
    power_n: jax.Array
    overflow: jax.Array
    saturate: jax.Array
    underflow: jax.Array
    subnormal: jax.Array
    poisoned: jax.Array
    noise_n: jax.Array


def _as_rows(x: jax.Array) -> jax.Array:
    """float32 (R, K): the last axis kept (the axis row/block targets scale along)."""
    x = x.astype(jnp.float32)
    if x.ndim == 0:
        return x.reshape(1, 1)
    return x.reshape(-1, x.shape[-1]) if x.shape[-1] else x.reshape(0, 1)


def _count(mask: jax.Array) -> jax.Array:
    return jnp.sum(mask, dtype=jnp.int32)


def _target_counts(
    x2: jax.Array, finite: jax.Array, nonzero: jax.Array, xn: jax.Array, k: jax.Array, t: Target
) -> list[jax.Array]:
    q = quantize_target(x2, t)
    bits = magnitude_bits(q.elems)
    thr, tie = t.overflow_threshold
    thr_bits = np.float32(thr).view(np.uint32)
    sb = magnitude_bits(q.scaled)
    past = (sb > thr_bits) | ((sb == thr_bits) if tie else False)
    over = nonzero & past & (sb < _INF_BITS)
    max_bits = np.float32(t.fmt.max).view(np.uint32)
    small_bits = np.float32(t.fmt.smallest_normal).view(np.uint32)
    sat = nonzero & (bits == max_bits)
    under = nonzero & (bits == 0)
    sub = nonzero & (bits > 0) & (bits < small_bits)
    poisoned = nonzero & (bits > _INF_BITS)
    qn = pow2.ldexp(jnp.where(finite, q.values, 0.0), jnp.broadcast_to(-k, x2.shape))
    noise = jnp.sum(jnp.where(finite, jnp.square(xn - qn), 0.0))
    return [_count(over), _count(sat), _count(under), _count(sub), _count(poisoned), noise]


def tensor_stats(x: ArrayLike, targets: Any = ()) -> TensorStats:
    """Statistics of ``x`` (any float dtype and shape; computed in float32), and for each
    target (a static tuple of names, see :mod:`precisionlab.telemetry._targets`) the
    counts of its quantized copy. Row and block targets scale along the last axis. Jittable;
    ``targets`` must be static."""
    ts = parse_targets(targets)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"tensor_stats takes a float array, got {x.dtype}")
    return _stats(x, ts)


@partial(jax.jit, static_argnums=1)  # compiled once per shape and targets when called eagerly
def _stats(x: jax.Array, ts: tuple[Target, ...]) -> TensorStats:
    x2 = _as_rows(x)
    b = magnitude_bits(x2)
    finite = b < _INF_BITS
    nan = b > _INF_BITS
    zero = b == 0
    nonzero = finite & ~zero
    amax_b = jnp.max(jnp.where(finite, b, 0), initial=np.uint32(0))
    amin_b = jnp.min(jnp.where(nonzero, b, _INF_BITS), initial=_INF_BITS)
    amax = lax.bitcast_convert_type(amax_b, jnp.float32)
    k = pow2.floor_log2(amax)
    xn = pow2.ldexp(jnp.where(finite, x2, 0.0), jnp.broadcast_to(-k, x2.shape))
    n_f = _count(finite)
    mean_n = jnp.sum(xn) / jnp.maximum(n_f, 1).astype(jnp.float32)
    m2_n = jnp.sum(jnp.where(finite, jnp.square(xn - mean_n), 0.0))
    per = [_target_counts(x2, finite, nonzero, xn, k, t) for t in ts]
    cols = list(zip(*per, strict=True)) if per else [()] * 6
    stack_i = [jnp.asarray(c, jnp.int32).reshape(len(ts)) for c in cols[:5]]
    noise = jnp.asarray(cols[5], jnp.float32).reshape(len(ts))
    return TensorStats(
        n=jnp.int32(x2.size), n_nan=_count(nan), n_inf=_count(~finite & ~nan),
        n_zero=_count(zero), n_nonzero=_count(nonzero), amax=amax,
        amin=lax.bitcast_convert_type(amin_b, jnp.float32), k=k, mean_n=mean_n, m2_n=m2_n,
        power_n=jnp.sum(jnp.square(xn)), overflow=stack_i[0], saturate=stack_i[1],
        underflow=stack_i[2], subnormal=stack_i[3], poisoned=stack_i[4], noise_n=noise,
    )  # fmt: skip


_CHUNK = 512  # elements per row of the concatenated buffer of stats_of_many


def stats_of_many(tensors: dict, targets: Any = ()) -> dict:
    """``{key: tensor_stats(x, targets)}`` for a dict of float arrays: :func:`stacked_stats`
    split per key (inside ``jit`` prefer :func:`stacked_stats` itself: a program with
    hundreds of small outputs compiles several times slower)."""
    keys = list(tensors)
    st = stacked_stats([tensors[k] for k in keys], targets)
    return {k: jax.tree.map(lambda v, j=j: v[j], st) for j, k in enumerate(keys)}


def stacked_stats(xs: Sequence[ArrayLike], targets: Any = ()) -> TensorStats:
    """The statistics of every tensor of ``xs`` (a sequence of float arrays of any shapes),
    stacked: each field gets a leading axis of ``len(xs)`` (``TensorStats(*fields)[i]`` is
    ``tensor_stats(xs[i], targets)``), in one program whose size does not grow with the
    number of tensors.

    The tensors are concatenated (each padded to whole rows of 512 elements) and every
    element-wise step (bit tests, normalisation, the per-element and per-tensor targets' casts)
    runs once over the buffer; per-tensor results are segment reductions of per-row partial
    sums. Row, block and MX targets, which depend on each tensor's last axis, are computed per
    layout (tensors of the same ``(rows, K)`` share one vmapped copy). Counts, extremes and
    ``k`` equal :func:`tensor_stats`'s exactly; the float sums are added in another order
    (float32 rounding: in order over runs of 64 elements, then pairwise over a tensor's runs),
    one that depends on the tensor alone, not on the others stacked with it. Use :func:`combine` /
    :func:`reduce_over` under ``jax.vmap``."""
    ts = parse_targets(targets)
    arrays = [jnp.asarray(x) for x in xs]
    for i, x in enumerate(arrays):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"stacked_stats takes float arrays, got {x.dtype} at position {i}")
    if not arrays:
        raise ValueError("stacked_stats needs at least one tensor")
    flat = tuple(t for t in ts if t.scaling in ("none", "tensor"))
    base = _segmented(arrays, flat)
    per = tuple(t for t in ts if t.scaling not in ("none", "tensor"))
    if not per:
        return base
    laid = _by_layout(arrays, base.k, per)
    ia, ib = iter(range(len(flat))), iter(range(len(per)))
    order = [("a", next(ia)) if t.scaling in ("none", "tensor") else ("b", next(ib)) for t in ts]
    cols = {}
    for name in ("overflow", "saturate", "underflow", "subnormal", "poisoned", "noise_n"):
        a, b = getattr(base, name), getattr(laid, name)
        cols[name] = jnp.stack([(a if w == "a" else b)[:, j] for w, j in order], axis=1)
    return base._replace(**cols)


def _segmented(xs: list[jax.Array], ts: tuple[Target, ...]) -> TensorStats:
    """Stacked (leading axis: tensor) TensorStats of ``xs`` for element/tensor targets."""
    sizes = [int(np.prod(x.shape)) for x in xs]
    rows = [max(1, -(-n // _CHUNK)) for n in sizes]
    pieces = [
        jnp.pad(x.astype(jnp.float32).reshape(-1), (0, r * _CHUNK - n))
        for x, n, r in zip(xs, sizes, rows, strict=True)
    ]
    xc = jnp.concatenate(pieces).reshape(-1, _CHUNK)
    seg = np.repeat(np.arange(len(xs), dtype=np.int32), rows)
    fill = np.concatenate(
        [
            np.minimum(np.maximum(n - _CHUNK * np.arange(r), 0), _CHUNK)
            for n, r in zip(sizes, rows, strict=True)
        ]
    ).astype(np.int32)
    nseg = len(xs)
    valid = jnp.arange(_CHUNK, dtype=np.int32)[None, :] < jnp.asarray(fill)[:, None]
    # Segment reductions of the per-row partials as dense (tensors x rows) masks: XLA compiles
    # them far faster than scatters (and the rows are few: 512 elements each).
    onehot = jnp.asarray(seg)[None, :] == jnp.arange(nseg, dtype=np.int32)[:, None]

    def seg_reduce(
        vs: list, op: Callable[..., jax.Array]
    ) -> list:  # (R,) row partials -> (nseg,) per tensor
        if not vs:
            return []
        v = jnp.stack(vs)[:, None, :]
        init = int(_INF_BITS) if op is jnp.min else 0
        return list(op(jnp.where(onehot[None], v, jnp.asarray(init, v.dtype)), axis=2))

    # One integer pass over the elements for extremes and counts (an integer reduction
    # fuses with its element-wise producer on CPU; a float one reads a materialized array).
    # Signed int32 magnitude bits: |x| < 2**31, and x86 has no unsigned vector compare.
    b = lax.bitcast_convert_type(magnitude_bits(xc), jnp.int32)
    inf_b = int(_INF_BITS)
    finite = b < inf_b
    nonzero = finite & (b != 0)
    amax_r, amin_r, amax_nan_r, nan_r, inf_r, zero_r, tiny_r = _int_rows(
        [
            (jnp.where(finite, b, 0), _MAX),
            (jnp.where(nonzero, b, inf_b), _MIN),
            (b, _MAX),  # the amax a tensorwise scale sees: NaN wins over inf
            (b > inf_b, _SUM),
            (b == inf_b, _SUM),
            (b == 0, _SUM),  # the padding included (subtracted below)
            (nonzero & (b < 0x00800000), _SUM),  # float32 subnormals
        ]
    )
    amax_b, amax_nan = seg_reduce([amax_r, amax_nan_r], jnp.max)
    (amin_b,) = seg_reduce([amin_r], jnp.min)
    n_nan, n_inf, n_zero = seg_reduce([nan_r, inf_r, zero_r], jnp.sum)
    n = jnp.asarray(np.asarray(sizes, np.int32))
    pad = np.bincount(seg, weights=_CHUNK - fill, minlength=nseg).astype(np.int32)
    n_zero = n_zero - jnp.asarray(pad)
    n_f = n - n_nan - n_inf
    n_nz = n_f - n_zero
    amax = lax.bitcast_convert_type(amax_b, jnp.float32)
    k = pow2.floor_log2(amax)
    k_rows = k[seg][:, None]
    scales = {}
    for t in ts:
        if t.scaling == "tensor":
            scales[t] = S.scale_from_amax(
                lax.bitcast_convert_type(amax_nan, jnp.float32), t.fmt.max, eps=EPS,
                pow2_scales=False,
            )[0]  # fmt: skip

    def scaled_of(t: Target) -> jax.Array:
        if t.scaling == "none":
            return xc
        s_rows = scales[t][seg][:, None]
        return jnp.where(jnp.isnan(s_rows), jnp.float32(jnp.nan), xc * s_rows)

    def copy_of(t: Target) -> jax.Array:  # the dequantized copy the recipe's GEMM would multiply
        q = round_to_format(scaled_of(t), t.fmt)
        return q if t.scaling == "none" else q * (jnp.float32(1.0) / scales[t][seg][:, None])

    # Per target: overflow, saturate, underflow, subnormal, poisoned counts, one integer pass.
    items = []
    for t in ts:
        thr = count_thresholds(t.fmt)
        if thr is None:
            items += _count_items_cast(scaled_of(t), copy_of(t), nonzero, t)
        else:
            items += _count_items(scaled_of(t), nonzero, t, thr)
    tcounts = seg_reduce(_int_rows(items), jnp.sum) if items else []

    # Moments and squared errors in units of 2**k. Where every 2**-k is a normal float32
    # and no input is a float32 subnormal, a float multiply by 2**-k gives what the exact
    # ldexp gives (results below float32's normal range flush on CPU, and flush again in
    # the sums anyway); otherwise the integer ldexp, computed once (one cond per buffer).
    k_ok = (k == pow2.ZERO_LOG2) | ((k >= -126) & (k <= 126))
    inv_rows = _pow2_const(jnp.clip(-k, -126, 126))[seg][:, None]
    ok = valid & finite

    def sums(fast: bool, xc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, list[jax.Array]]:
        x0 = jnp.where(ok, xc, 0.0)
        copies = [jnp.where(ok, copy_of(t), 0.0) for t in ts]
        if fast:  # each copy scaled inside its own reduction
            xn, qns = x0 * inv_rows, [c * inv_rows for c in copies]
        else:  # one ldexp over all of them, stacked (a smaller program)
            vn = pow2.ldexp(jnp.stack([x0, *copies]), jnp.broadcast_to(-k_rows, xc.shape))
            xn, qns = vn[0], list(vn[1:])
        (mean_n,) = _tree_sums(_part_sums([xn]), sub_rows)
        mean_n = mean_n / jnp.maximum(n_f, 1).astype(jnp.float32)
        dev = jnp.where(ok, jnp.square(xn - mean_n[seg][:, None]), 0.0)
        terms = [dev, jnp.square(xn), *(jnp.square(xn - qn) for qn in qns)]
        m2_n, power_n, *noise = _tree_sums(_part_sums(terms), sub_rows)
        return mean_n, m2_n, power_n, noise

    sub_rows = [r * (_CHUNK // _SUB) for r in rows]
    fast = (jnp.sum(tiny_r) == 0) & jnp.all(k_ok)
    mean_n, m2_n, power_n, noise = lax.cond(fast, partial(sums, True), partial(sums, False), xc)
    per = []
    for j, t in enumerate(ts):
        c = tcounts[5 * j : 5 * j + 5]
        if t.scaling == "tensor":
            # a NaN scale poisons every nonzero element and nothing else (set per tensor:
            # XLA on CPU flushes subnormal lanes in some fusions of the element-wise path)
            bad_seg = jnp.isnan(scales[t])
            c = [*(jnp.where(bad_seg, 0, v) for v in c[:4]), jnp.where(bad_seg, n_nz, c[4])]
        per.append([*c, noise[j]])
    cols = list(zip(*per, strict=True)) if per else [()] * 6
    stack_i = [jnp.stack(c, axis=1) if c else jnp.zeros((nseg, 0), jnp.int32) for c in cols[:5]]
    noise = jnp.stack(cols[5], axis=1) if cols[5] else jnp.zeros((nseg, 0), jnp.float32)
    return TensorStats(
        n=n, n_nan=n_nan, n_inf=n_inf, n_zero=n_zero, n_nonzero=n_nz, amax=amax,
        amin=lax.bitcast_convert_type(amin_b, jnp.float32), k=k, mean_n=mean_n, m2_n=m2_n,
        power_n=power_n, overflow=stack_i[0], saturate=stack_i[1], underflow=stack_i[2],
        subnormal=stack_i[3], poisoned=stack_i[4], noise_n=noise,
    )  # fmt: skip


_SUB = 64  # elements per float partial sum (in order: float32 error ~ 64 ulp at worst)


def _part_sums(terms: list[jax.Array]) -> list[jax.Array]:
    """Sums of each (R, 512) float32 term over runs of :data:`_SUB` elements, (R * 8,) each,
    all in one variadic reduction: one pass over the elements, fused with the element-wise
    work that makes the terms (XLA:CPU materializes the input of a plain float reduction)."""
    r = terms[0].shape[0]
    flat = [t.reshape(r * (_CHUNK // _SUB), _SUB) for t in terms]

    def body(a: list[jax.Array], b: list[jax.Array]) -> list[jax.Array]:
        return [u + v for u, v in zip(a, b, strict=True)]

    return list(lax.reduce(flat, [jnp.float32(0)] * len(flat), body, (1,)))


def _tree_sums(vs: list[jax.Array], rows: list[int]) -> list[jax.Array]:
    """Per-tensor sums of row partials (each (R,), the tensors' rows consecutive, ``rows``
    per tensor) added pairwise in a tree that starts at each tensor's first row: the order
    of a tensor's additions depends on its own rows only, so its statistics do not change
    with the other tensors of the stack (a reduction over the whole buffer would associate
    them by their offset). One step per tree level, on the row partials."""
    v = jnp.stack(vs)
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
    seg_len = np.repeat(np.asarray(rows, np.int64), rows)
    pos = np.arange(v.shape[1], dtype=np.int64) - np.repeat(starts, rows)
    step = 1
    while step < max(rows):
        take = (pos % (2 * step) == 0) & (pos + step < seg_len)
        if take.any():
            after = jnp.pad(v[:, step:], ((0, 0), (0, step)))
            v = jnp.where(jnp.asarray(take), v + after, v)
        step *= 2
    return list(v[:, jnp.asarray(starts)])


# The row reductions of :func:`_int_rows`: (combiner, initial value).
_SUM = (lax.add, 0)
_MAX = (lax.max, 0)  # of non-negative values
_MIN = (lax.min, int(_INF_BITS))  # of values <= the inf bits


def _int_rows(items: list) -> list:
    """Row reductions (axis 1) of (R, 512) int32 or bool arrays, each with its reduction
    (``_SUM``, ``_MAX`` of non-negative values, ``_MIN`` of values <= the inf bits), in one
    variadic reduce: one pass over the elements (integer reductions fuse with their producers
    on CPU)."""
    arrs = [jnp.asarray(a).astype(jnp.int32) for a, _ in items]
    ops = [o for _, o in items]

    def body(a: list[jax.Array], b: list[jax.Array]) -> list[jax.Array]:
        return [f(u, v) for (f, _), u, v in zip(ops, a, b, strict=True)]

    inits = [jnp.int32(init) for _, init in ops]
    return list(lax.reduce(arrs, inits, body, (1,)))


def _count_items(scaled: jax.Array, nonzero: jax.Array, t: Target, thr: tuple) -> list:
    """Overflow, saturate, underflow, subnormal and poisoned masks of one target (for
    :func:`_int_rows`) from the scaled magnitudes against the format's exact thresholds
    (:func:`count_thresholds`): no cast needed."""
    under, normal, sat = thr
    sb = lax.bitcast_convert_type(magnitude_bits(scaled), jnp.int32)
    o_thr, tie = t.overflow_threshold
    o_bits = int(np.float32(o_thr).view(np.uint32))
    past = (sb >= o_bits) if tie else (sb > o_bits)
    masks = [
        nonzero & past & (sb < int(_INF_BITS)),
        nonzero & (sb >= sat) & (sb <= int(_INF_BITS)),  # inf saturates
        nonzero & (sb <= under),
        nonzero & (sb > under) & (sb < normal),
        nonzero & (sb > int(_INF_BITS)),  # NaN: x * scale is 0 * inf (a flushed subnormal)
    ]
    return [(m, _SUM) for m in masks]


def _count_items_cast(scaled: jax.Array, elems: jax.Array, nonzero: jax.Array, t: Target) -> list:
    """As :func:`_count_items`, from the cast values (formats without thresholds)."""
    i32 = partial(lax.bitcast_convert_type, new_dtype=jnp.int32)
    bits = i32(magnitude_bits(elems))
    thr, tie = t.overflow_threshold
    thr_bits = int(np.float32(thr).view(np.uint32))
    sb = i32(magnitude_bits(scaled))
    past = (sb >= thr_bits) if tie else (sb > thr_bits)
    max_bits = int(np.float32(t.fmt.max).view(np.uint32))
    small_bits = int(np.float32(t.fmt.smallest_normal).view(np.uint32))
    masks = [
        nonzero & past & (sb < int(_INF_BITS)),
        nonzero & (bits == max_bits),
        nonzero & (bits == 0),
        nonzero & (bits > 0) & (bits < small_bits),
        nonzero & (bits > int(_INF_BITS)),
    ]
    return [(m, _SUM) for m in masks]


def _pow2_const(e: jax.Array) -> jax.Array:
    """float32 2**e for int32 e in [-126, 127], built from the exponent field."""
    return lax.bitcast_convert_type((e + 127).astype(jnp.uint32) << 23, jnp.float32)


def _by_layout(xs: list[jax.Array], k: jax.Array, ts: tuple[Target, ...]) -> TensorStats:
    """Per-target counts of layout-dependent targets, stacked like :func:`_segmented`'s (only
    the per-target fields are meaningful); tensors of one layout share a vmapped copy."""
    groups: dict[tuple[int, ...], list[int]] = {}
    rows2 = [_as_rows(x) for x in xs]
    for i, x2 in enumerate(rows2):
        groups.setdefault(x2.shape, []).append(i)
    results: dict[int, list] = {}

    def one(x2: jax.Array, kk: jax.Array) -> list[list[jax.Array]]:
        b = magnitude_bits(x2)
        finite = b < _INF_BITS
        nonzero = finite & (b != 0)
        xn = pow2.ldexp(jnp.where(finite, x2, 0.0), jnp.broadcast_to(-kk, x2.shape))
        return [_target_counts(x2, finite, nonzero, xn, kk, t) for t in ts]

    for idx in groups.values():
        stacked = jnp.stack([rows2[i] for i in idx])
        res = jax.vmap(one)(stacked, k[np.asarray(idx)])
        for j, i in enumerate(idx):
            results[i] = jax.tree.map(lambda v, j=j: v[j], res)
    cols = [
        jnp.stack([jnp.stack([results[i][t][c] for t in range(len(ts))]) for i in range(len(xs))])
        for c in range(6)
    ]
    zeros = jnp.zeros((len(xs),), jnp.int32)
    return TensorStats(
        n=zeros, n_nan=zeros, n_inf=zeros, n_zero=zeros, n_nonzero=zeros, amax=k * 0.0,
        amin=k * 0.0, k=k, mean_n=k * 0.0, m2_n=k * 0.0, power_n=k * 0.0, overflow=cols[0],
        saturate=cols[1], underflow=cols[2], subnormal=cols[3], poisoned=cols[4],
        noise_n=cols[5].astype(jnp.float32),
    )  # fmt: skip


# --- combining ---------------------------------------------------------------------------
def _max_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.maximum(magnitude_bits(a), magnitude_bits(b)), jnp.float32)


def _min_bits(a: jax.Array, b: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(jnp.minimum(magnitude_bits(a), magnitude_bits(b)), jnp.float32)


def _rescale(s: TensorStats, kk: jax.Array) -> tuple:
    """(mean, m2, power, noise) of ``s`` in units of 2**kk (kk >= s.k)."""
    d = s.k - kk
    return (
        pow2.ldexp(s.mean_n, d),
        pow2.ldexp(s.m2_n, 2 * d),
        pow2.ldexp(s.power_n, 2 * d),
        pow2.ldexp(s.noise_n, jnp.broadcast_to(2 * d, s.noise_n.shape)),
    )


@jax.jit
def combine(a: TensorStats, b: TensorStats) -> TensorStats:
    """Statistics of the concatenation of two tensors (shards, micro-batches) from theirs:
    exact for counts, extremes and ``k``; mean and variance by Chan et al.'s pairwise
    update. Associative and commutative up to float32 rounding of the sums."""
    kk = jnp.maximum(a.k, b.k)
    ma, m2a, pa, na_ = _rescale(a, kk)
    mb, m2b, pb, nb_ = _rescale(b, kk)
    fa = (a.n - a.n_nan - a.n_inf).astype(jnp.float32)
    fb = (b.n - b.n_nan - b.n_inf).astype(jnp.float32)
    f = jnp.maximum(fa + fb, 1.0)
    delta = mb - ma
    return TensorStats(
        n=a.n + b.n, n_nan=a.n_nan + b.n_nan, n_inf=a.n_inf + b.n_inf,
        n_zero=a.n_zero + b.n_zero, n_nonzero=a.n_nonzero + b.n_nonzero,
        amax=_max_bits(a.amax, b.amax), amin=_min_bits(a.amin, b.amin), k=kk,
        mean_n=ma + delta * (fb / f), m2_n=m2a + m2b + jnp.square(delta) * (fa * fb / f),
        power_n=pa + pb, overflow=a.overflow + b.overflow, saturate=a.saturate + b.saturate,
        underflow=a.underflow + b.underflow, subnormal=a.subnormal + b.subnormal,
        poisoned=a.poisoned + b.poisoned, noise_n=na_ + nb_,
    )  # fmt: skip


def reduce_over(s: TensorStats, axis_name: Any) -> TensorStats:
    """:func:`combine` across a mapped axis (``shard_map`` / ``pmap`` data parallelism):
    the statistics of the whole (global) tensor on every device."""
    kk = lax.pmax(s.k, axis_name)
    m, m2, p, noise = _rescale(s, kk)
    nf = (s.n - s.n_nan - s.n_inf).astype(jnp.float32)
    total = jnp.maximum(lax.psum(nf, axis_name), 1.0)
    mean = lax.psum(nf * m, axis_name) / total
    m2 = lax.psum(m2 + nf * jnp.square(m - mean), axis_name)
    psum = lambda v: lax.psum(v, axis_name)  # noqa: E731
    return TensorStats(
        n=psum(s.n), n_nan=psum(s.n_nan), n_inf=psum(s.n_inf), n_zero=psum(s.n_zero),
        n_nonzero=psum(s.n_nonzero),
        amax=lax.bitcast_convert_type(lax.pmax(magnitude_bits(s.amax), axis_name), jnp.float32),
        amin=lax.bitcast_convert_type(lax.pmin(magnitude_bits(s.amin), axis_name), jnp.float32),
        k=kk, mean_n=mean, m2_n=m2, power_n=psum(p), overflow=psum(s.overflow),
        saturate=psum(s.saturate), underflow=psum(s.underflow), subnormal=psum(s.subnormal),
        poisoned=psum(s.poisoned), noise_n=psum(noise),
    )  # fmt: skip


# --- derived numbers ---------------------------------------------------------------------
def _log2(a: jax.Array) -> jax.Array:
    """float32 log2 of a positive float32, exact in its integer part for subnormals."""
    e = pow2.floor_log2(a)
    return e.astype(jnp.float32) + jnp.log2(pow2.ldexp(a, -e))


@jax.jit
def derive(s: TensorStats) -> dict[str, jax.Array]:
    """The finished statistics (float32 arrays; per-target ones shape (T,)): ``amax``,
    ``amin_nonzero`` (NaN if none), ``dynamic_range`` (binades, ``log2 amax - log2 amin``),
    ``mean``, ``std`` (population), ``frac_zero``, ``frac_nonfinite`` (of all elements),
    and per target ``overflow``, ``saturate``, ``underflow``, ``subnormal``, ``poisoned``
    (fractions of the finite nonzero elements) and ``sqnr_db`` (10 log10 of signal power
    over error power; +inf for an exact copy)."""
    n = jnp.maximum(s.n, 1).astype(jnp.float32)
    nf = jnp.maximum(s.n - s.n_nan - s.n_inf, 1).astype(jnp.float32)
    nz = jnp.maximum(s.n_nonzero, 1).astype(jnp.float32)
    has = s.n_nonzero > 0
    amin = jnp.where(has, s.amin, jnp.float32(jnp.nan))
    dr = jnp.where(has, _log2(s.amax) - _log2(jnp.where(has, s.amin, 1.0)), jnp.nan)
    k = jnp.where(has, s.k, 0)
    std_n = jnp.sqrt(s.m2_n / nf)
    return {
        "amax": s.amax,
        "amin_nonzero": amin,
        "dynamic_range": dr,
        "mean": pow2.ldexp(s.mean_n, k),
        "std": pow2.ldexp(std_n, k),
        "frac_zero": s.n_zero / n,
        "frac_nonfinite": (s.n_nan + s.n_inf) / n,
        "overflow": s.overflow / nz,
        "saturate": s.saturate / nz,
        "underflow": s.underflow / nz,
        "subnormal": s.subnormal / nz,
        "poisoned": s.poisoned / nz,
        "sqnr_db": 10.0 * (jnp.log10(s.power_n) - jnp.log10(s.noise_n)),
    }


_COUNTS = ("n", "n_nan", "n_inf", "n_zero", "n_nonzero")
_PER_TARGET = ("overflow", "saturate", "underflow", "subnormal", "poisoned", "sqnr_db")


def to_dict(s: TensorStats, targets: Any = ()) -> dict:
    """Host-side summary (Python floats and ints; ``None`` where undefined) with the targets
    by name: ``{"n": ..., "amax": ..., ..., "targets": {"e4m3:tensor": {"underflow": ...}}}``.
    """
    ts = parse_targets(targets)
    d = {k: np.asarray(v) for k, v in derive(jax.device_get(s)).items()}
    if len(ts) != np.asarray(s.overflow).shape[-1]:
        raise ValueError(
            f"{len(ts)} target names for statistics of {np.asarray(s.overflow).shape[-1]}"
        )

    def num(v: Any) -> float | None:
        f = float(v)
        return None if math.isnan(f) else f

    out: dict = {k: int(np.asarray(getattr(s, k))) for k in _COUNTS}
    out.update({k: num(v) for k, v in d.items() if k not in _PER_TARGET})
    n, nz = max(out["n"], 1), max(out["n_nonzero"], 1)
    out["frac_zero"] = out["n_zero"] / n  # exact quotients of the integer counts
    out["frac_nonfinite"] = (out["n_nan"] + out["n_inf"]) / n
    out["targets"] = {
        t.name: {
            **{k: int(np.asarray(getattr(s, k))[i]) / nz for k in _PER_TARGET[:-1]},
            "sqnr_db": num(d["sqnr_db"][i]),
        }
        for i, t in enumerate(ts)
    }
    return out
