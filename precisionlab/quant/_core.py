"""The arithmetic shared by quantize, dequantize and fake_quant, on grouped views.

Shared with the benchmarks; not part of the public API (docs/reference/public_api.txt):
users import from ``precisionlab.quant``.

A grouped view of ``x`` is ``x`` itself (tensor and channel granularity; statistics reduce
over the other axes with keepdims) or, for blocks, ``x`` with ``axis`` moved last, padded to
whole blocks and reshaped to ``(..., n_blocks, block_size)``. Scales live in keepdims shape
on that view, so every step is elementwise broadcasting, and nothing loops over elements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, TypeAlias, overload

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.bits import encode, round_to_format
from precisionlab.formats import FORMATS, FloatFormat, IntFormat
from precisionlab.quant import _pow2 as pow2
from precisionlab.quant._spec import MSE_GRID, MSE_MIN_RATIO, QuantSpec, given

SCALE16 = {"float16": FORMATS["float16"], "bfloat16": FORMATS["bfloat16"]}


# --- layout --------------------------------------------------------------------------------
def to_groups(
    x: jax.Array, spec: QuantSpec, fill: float = 0.0
) -> tuple[jax.Array, tuple[int, ...]]:
    """Grouped view of ``x`` and the axes that statistics reduce over."""
    if spec.granularity == "block":
        xm = jnp.moveaxis(x, spec.group_axis, -1)
        n, b = xm.shape[-1], spec.block
        nb = max(-(-n // b), 1)
        pad = nb * b - n
        if pad:
            xm = jnp.pad(xm, [(0, 0)] * (xm.ndim - 1) + [(0, pad)], constant_values=fill)
        xg = xm.reshape(*xm.shape[:-1], nb, b)
        return xg, (xg.ndim - 1,)
    if spec.granularity == "channel":
        return x, tuple(i for i in range(x.ndim) if i != spec.group_axis)
    return x, tuple(range(x.ndim))


def from_groups(vg: jax.Array, spec: QuantSpec, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`to_groups` (drops the padding)."""
    if spec.granularity != "block":
        return vg
    n = shape[spec.group_axis]
    vm = vg.reshape(*vg.shape[:-2], -1)[..., :n]
    return jnp.moveaxis(vm, -1, spec.group_axis)


def store_groups(s: jax.Array, spec: QuantSpec) -> jax.Array:
    """keepdims per-group array -> stored shape: (), (C,), or x.shape with nb along axis."""
    if spec.granularity == "block":
        return jnp.moveaxis(s[..., 0], -1, spec.group_axis)
    if spec.granularity == "channel":
        return s.reshape(s.shape[spec.group_axis])
    return s.reshape(())


def load_groups(s: jax.Array, spec: QuantSpec) -> jax.Array:
    """Stored per-group array -> keepdims shape on the grouped view."""
    if spec.granularity == "block":
        return jnp.moveaxis(s, spec.group_axis, -1)[..., None]
    if spec.granularity == "channel":
        shape = [1] * spec.ndim
        shape[spec.group_axis] = s.shape[0]
        return s.reshape(shape)
    return s.reshape((1,) * spec.ndim)


# --- scales --------------------------------------------------------------------------------
class Scale(NamedTuple):
    """One group's scale on the grouped view (keepdims shapes).

    ``s`` (float32) for float scales; ``e`` (int32 exponent, scale = 2**e) for power-of-two
    scales; ``bad`` marks groups whose scale is NaN (a non-finite input in an MX block);
    ``zp`` the float32 integral zero point (asymmetric) or None; ``s_codes`` the stored codes
    of float16/bfloat16 scales.
    """

    s: jax.Array | None
    e: jax.Array | None
    bad: jax.Array | None
    zp: jax.Array | None
    s_codes: jax.Array | None

    @property
    def float_s(self) -> jax.Array:
        """``s``, the float scale (a power-of-two scale has ``e`` instead)."""
        return given(self.s, "a power-of-two scale has no float s (read e)")

    @property
    def zero_point(self) -> jax.Array:
        """``zp``, the zero point of an asymmetric scale."""
        return given(self.zp, "a symmetric scale has no zero point")


def _mbits(spec: QuantSpec) -> int:
    """Mantissa bits of the element (for the "even" rule): a float's fraction bits; for an
    integer of b bits, b - 2 (the bits below the leading one of its largest magnitude)."""
    fmt = spec.fmt
    return fmt.mantissa_bits if isinstance(fmt, FloatFormat) else max(fmt.bits - 2, 0)


def _div_const(a: jax.Array, c: float) -> jax.Array:
    """``a * float32(1 / c)``: the scale rule is stated with reciprocals because XLA itself
    rewrites ``x / broadcast(c)`` as ``x * (1 / c)`` (not correctly rounded); spelling it
    out makes the result the same on every backend and easy to reproduce in numpy."""
    return a * jnp.float32(np.float32(1.0) / np.float32(c))


# Float32 scales are kept normal: a scale below 2**-126 is a float32 subnormal, which XLA on
# CPU flushes to zero (the whole group would quantize to 0, and dequantize to 0 * inf). Groups
# with 0 < amax < qmax * 2**-126 (about 1.5e-36 for int8) get this scale instead: fewer
# levels are used, never none, and the result is the same on every backend.
SMALLEST_FLOAT_SCALE = float(np.ldexp(1.0, -126))


def _float_scale(
    s: jax.Array, spec: QuantSpec, zero: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    # An all-zero group (``zero``: its clip value is 0) gets scale 1; a group holding inf or
    # NaN keeps its NaN/inf scale, so its values come back NaN instead of silently wrong.
    zero = s == 0 if zero is None else zero
    tiny = jnp.float32(SMALLEST_FLOAT_SCALE)
    s = jnp.where(zero, jnp.float32(1.0), jnp.maximum(s, tiny)).astype(jnp.float32)
    if spec.scale_format in SCALE16:
        # Rounded up, so the clip value still maps inside the element range.
        codes = encode(s, SCALE16[spec.scale_format], rounding="up", saturate=True)
        s = round_to_format(s, SCALE16[spec.scale_format], rounding="up", saturate=True)
        return s, codes
    return s, None


def scale_from_clip(
    spec: QuantSpec,
    c: jax.Array | None = None,
    lo: jax.Array | None = None,
    hi: jax.Array | None = None,
) -> Scale:
    """Scale (and zero point) that maps clip value ``c`` (symmetric) or the range
    ``[lo, hi]`` with ``lo <= 0 <= hi`` (asymmetric) onto the element range (none of them for
    ``scale="none"``)."""
    s: jax.Array | None  # float scales
    e: jax.Array | None  # power-of-two scales
    if spec.scale == "none":
        ones = jnp.ones((1,) * spec.ndim, jnp.float32)
        if spec.pow2:
            return Scale(None, jnp.zeros(ones.shape, jnp.int32), None, None, None)
        s, codes = _float_scale(ones, spec)
        return Scale(s, None, None, None, codes)
    if spec.scheme == "symmetric":
        if c is None:
            raise ValueError("a symmetric scale needs the clip value c")
        bad = ~jnp.isfinite(c) if spec.mx is not None else None
        if spec.pow2:
            e = pow2.scale_exponent(
                c, spec.clip_target, spec.emax_target, spec.pow2_rule, _mbits(spec)
            )
            return Scale(None, e, bad, None, None)
        s, codes = _float_scale(_div_const(c, spec.clip_target), spec, zero=c == 0)
        return Scale(s, None, None, None, codes)
    if lo is None or hi is None:
        raise ValueError("an asymmetric scale needs the range lo, hi")
    qrange = spec.qmax - spec.qmin
    span = (hi - lo).astype(jnp.float32)
    if spec.pow2:
        e = pow2.scale_exponent(
            span, qrange, int(np.floor(np.log2(qrange))), spec.pow2_rule, _mbits(spec)
        )
        shifted = pow2.ldexp(lo, -e)
        s, codes = None, None
    else:
        s, codes = _float_scale(_div_const(span, qrange), spec, zero=span == 0)
        e, shifted = None, lo * (jnp.float32(1.0) / s)
    zp = jnp.clip(jnp.round(jnp.float32(spec.qmin) - shifted), spec.qmin, spec.qmax)
    return Scale(s, e, None, zp.astype(jnp.float32), codes)


# Power-of-two scaling by float multiplication is exact while the factor is a normal float32
# and nothing that matters is subnormal: with every exponent in this range, a subnormal input
# scales to below 2**-26 and rounds to zero in every element format (XLA on CPU flushes it to
# zero: the same result), and every nonzero element value (>= 2**-17) times the scale is a
# normal float32. Otherwise the exact integer ldexp runs (once per call, via lax.cond).
_FAST_E_MIN, _FAST_E_MAX = -100, 126


def _pow2_scale(v: jax.Array, k: jax.Array, e: jax.Array) -> jax.Array:
    """``v * 2**k`` exactly, where ``k`` is ``+-e`` plus a small shift."""
    safe = jnp.all((e >= _FAST_E_MIN) & (e <= _FAST_E_MAX))
    return jax.lax.cond(
        safe,
        lambda v, k: v * pow2.pow2(k),
        pow2.ldexp,
        v,
        k,
    )


def apply_scale(xg: jax.Array, sc: Scale, spec: QuantSpec) -> jax.Array:
    """x * (1 / scale) in element units (times 2**frac_bits for MXINT8), float32."""
    if sc.e is not None:
        return _pow2_scale(xg, spec.frac_bits - sc.e, sc.e)
    return xg * (jnp.float32(1.0) / sc.float_s)  # see _div_const


@overload
def fake_values(
    xg: jax.Array, sc: Scale, spec: QuantSpec, key: Any, *, with_mask: Literal[False] = False
) -> jax.Array: ...
@overload
def fake_values(
    xg: jax.Array, sc: Scale, spec: QuantSpec, key: Any, *, with_mask: Literal[True]
) -> tuple[jax.Array, jax.Array]: ...
def fake_values(
    xg: jax.Array, sc: Scale, spec: QuantSpec, key: Any, *, with_mask: bool = False
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``unapply_scale(round_elements(apply_scale(xg)))``: the dequantized values, float32
    (and, ``with_mask``, :func:`inside_mask` of the scaled values, for the gradient).

    The same values as the three steps (tests compare their bits), arranged for one pass
    over memory: power-of-two scales choose the float multiply or the exact integer ldexp
    once for the whole pipeline (a ``lax.cond`` per step would make XLA write each
    intermediate to memory), and the elements round in the float domain
    (:func:`round_elements` with ``codes=False``), never through a code array.
    """

    def finish(y: jax.Array, out: jax.Array) -> jax.Array | tuple[jax.Array, jax.Array]:
        return (out, inside_mask(y, sc, spec)) if with_mask else out

    if sc.e is None:
        y = apply_scale(xg, sc, spec)
        return finish(y, unapply_scale(round_elements(y, sc, spec, key, codes=False), sc, spec))

    def pipeline(
        scale_by: Callable[[jax.Array, jax.Array], jax.Array],
    ) -> Callable[[jax.Array, jax.Array], jax.Array | tuple[jax.Array, jax.Array]]:
        def run(xg: jax.Array, e: jax.Array) -> jax.Array | tuple[jax.Array, jax.Array]:
            y = scale_by(xg, spec.frac_bits - e)
            values = round_elements(y, sc, spec, key, codes=False)
            out = scale_by(values, e - spec.frac_bits)
            if sc.bad is not None:  # inside the branch: one fused pass writes the result
                out = jnp.where(sc.bad, jnp.float32(jnp.nan), out)
            return finish(y, out)

        return run

    safe = jnp.all((sc.e >= _FAST_E_MIN) & (sc.e <= _FAST_E_MAX))
    fast = pipeline(lambda v, k: v * pow2.pow2(k))
    return jax.lax.cond(safe, fast, pipeline(pow2.ldexp), xg, sc.e)


def unapply_scale(v: jax.Array, sc: Scale, spec: QuantSpec) -> jax.Array:
    """Element values (zero point removed) times the scale, float32."""
    if sc.e is not None:
        out = _pow2_scale(v, sc.e - spec.frac_bits, sc.e)
    else:
        out = v * sc.float_s
    if sc.bad is not None:
        out = jnp.where(sc.bad, jnp.float32(jnp.nan), out)
    return out


# --- elements ------------------------------------------------------------------------------
def _wide_int(spec: QuantSpec) -> IntFormat:
    # Rounds y before the zero point is added: wide enough never to clip a useful value.
    return IntFormat(name=f"int{spec.fmt.bits + 2}", bits=spec.fmt.bits + 2)


def _rounding_kwargs(spec: QuantSpec, key: jax.Array | None) -> dict[str, Any]:
    if spec.rounding == "stochastic":
        return {"rounding": "stochastic", "key": key}
    return {"rounding": spec.rounding}


def round_int_grid(yc: jax.Array) -> jax.Array:
    """``round_to_format(yc, int_fmt)`` for float32 ``yc`` already clipped to the format's
    range, nearest-even, in the float domain: round half to even is exact on float32, and
    every zero (-0 included) and NaN becomes +0, as through the two's-complement codes.
    A rounding and a select instead of an encode and a decode (tests: same bits on every float32
    exponent and rounding boundary, all 2**32 inputs under ``-m slow``)."""
    r = jax.lax.round(yc, jax.lax.RoundingMethod.TO_NEAREST_EVEN)
    return jnp.where(jnp.abs(r) > 0, r, jnp.float32(0.0))


def round_elements(
    y: jax.Array, sc: Scale, spec: QuantSpec, key: jax.Array | None, *, codes: bool
) -> jax.Array:
    """Round scaled values to the element format.

    Returns codes of the element format (``codes=True``; asymmetric codes include the zero
    point) or float32 element values with the zero point already removed.
    """
    kw = _rounding_kwargs(spec, key)
    fmt = spec.fmt
    if isinstance(fmt, FloatFormat):
        conv = encode if codes else round_to_format
        # A plain cast (scale "none") overflows as the format does (inf, NaN or saturation);
        # scaled quantization saturates to +-max, as every production recipe does.
        return conv(y, fmt, saturate=spec.scale != "none", **kw)
    if spec.scheme == "symmetric":
        yc = jnp.clip(y, spec.qmin, spec.qmax)
        if not codes and spec.rounding == "nearest_even":
            return round_int_grid(yc)
        return encode(yc, fmt, **kw) if codes else round_to_format(yc, fmt, **kw)
    r = round_to_format(y, _wide_int(spec), **kw)
    q = jnp.clip(r + sc.zero_point, spec.qmin, spec.qmax)
    return encode(q, fmt) if codes else q - sc.zero_point


def inside_mask(y: jax.Array, sc: Scale, spec: QuantSpec) -> jax.Array:
    """True where round-to-nearest of ``y`` lands inside the element range (not clipped):
    within half a step beyond the extreme codes, so the element at amax counts as inside."""
    if isinstance(spec.fmt, FloatFormat):
        fmt = spec.fmt
        half_top = np.ldexp(1.0, fmt.emax - fmt.mantissa_bits - 1)
        # A tie at max + half an ulp rounds to even: inward when max's mantissa is even
        # (E4M3FN's 448), outward (clipped) when it is odd (E5M2's 57344, FP4's 6).
        top_mantissa = round((fmt.max / np.ldexp(1.0, fmt.emax) - 1) * 2**fmt.mantissa_bits)
        limit = jnp.float32(fmt.max + half_top)
        if top_mantissa % 2 == 0:
            return jnp.abs(y) <= limit
        return jnp.abs(y) < limit
    # Inside iff nearest-even rounding lands in [qmin, qmax]: an exact tie at qmax + 0.5
    # rounds outward when qmax is odd (127.5 -> 128, clipped to 127) and gets no gradient.
    z = y if sc.zp is None else y + sc.zp
    r = jnp.round(z)  # half to even
    return (r >= spec.qmin) & (r <= spec.qmax)


# --- clip values ---------------------------------------------------------------------------
#: A prologue applied to each element and the reduce that combines the results.
_Part: TypeAlias = tuple[
    Callable[[jax.Array], jax.Array], Callable[[jax.Array, jax.Array], jax.Array]
]


def _reduce_with_nan(
    xg: jax.Array, axes: tuple[int, ...], parts: tuple[_Part, ...]
) -> tuple[jax.Array, ...]:
    """Per-group reduces of ``xg`` over ``axes`` in one pass, each NaN-propagating.

    ``parts`` pairs a prologue (elementwise on ``xg``) with ``jnp.maximum`` or
    ``jnp.minimum``; returns their keepdims float32 results, NaN in every group holding a NaN.
    XLA's CPU float max/min reduce drops NaN once arrays are large (openxla/xla#21461), so
    one variadic reduce carries an any-NaN flag beside the values: XLA fuses the prologues
    and the flag into one loop over the input. Measured on 1024x4096 float32 (CPU time, one
    run, 2-core x86 at load 1-3, against an astype round trip): per channel 0.61x, per block of
    128 0.68x, versus 1.51x and 5.35x for a float max plus a separate ``isnan`` reduce, and
    0.48x and 1.47x for the float max alone (which loses NaN).
    """
    inits = tuple(jnp.float32(-jnp.inf if op is jnp.maximum else jnp.inf) for _, op in parts)

    def combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        vals = tuple(op(u, v) for (_, op), u, v in zip(parts, a[:-1], b[:-1], strict=True))
        return (*vals, a[-1] | b[-1])

    operands = (*(pro(xg) for pro, _ in parts), jnp.isnan(xg))
    *vals, nan = jax.lax.reduce(operands, (*inits, np.bool_(False)), combine, axes)
    nan = jnp.expand_dims(nan, axes)
    return tuple(jnp.where(nan, jnp.float32(jnp.nan), jnp.expand_dims(v, axes)) for v in vals)


def group_amax(xg: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """max |x| per group (keepdims), float32; NaN in a group gives NaN."""
    (m,) = _reduce_with_nan(xg, axes, ((jnp.abs, jnp.maximum),))
    return m


def _identity(v: jax.Array) -> jax.Array:
    return v


def _min_max(xg: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(min(x, 0), max(x, 0)) per group (keepdims), float32; NaN in a group makes both NaN."""
    lo, hi = _reduce_with_nan(xg, axes, ((_identity, jnp.minimum), (_identity, jnp.maximum)))
    return jnp.minimum(lo, 0.0), jnp.maximum(hi, 0.0)


def _search_mse(xg: jax.Array, axes: tuple[int, ...], spec: QuantSpec) -> Scale:
    """Try clipping ratios 1.0 .. MSE_MIN_RATIO; keep, per group, the least squared error."""
    ratios = jnp.asarray(np.geomspace(1.0, MSE_MIN_RATIO, MSE_GRID), jnp.float32)
    near = dataclasses.replace(spec, rounding="nearest_even")
    base: tuple[jax.Array, ...]
    if spec.scheme == "symmetric":
        base = (group_amax(xg, axes),)
    else:
        base = _min_max(xg, axes)

    def err_for(r: jax.Array) -> jax.Array:
        sc = _rescale(near, base, r)
        y = apply_scale(xg, sc, near)
        xh = unapply_scale(round_elements(y, sc, near, None, codes=False), sc, near)
        return jnp.sum(jnp.square(xg - xh), axis=axes, keepdims=True)

    def step(
        carry: tuple[jax.Array, jax.Array], r: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], None]:
        best_err, best_r = carry
        err = err_for(r)
        better = err < best_err
        return (jnp.where(better, err, best_err), jnp.where(better, r, best_r)), None

    init_err = err_for(ratios[0])
    init = (init_err, jnp.ones_like(init_err))
    (_, best_r), _ = jax.lax.scan(step, init, ratios[1:])
    return _rescale(spec, base, best_r)


def _rescale(spec: QuantSpec, base: tuple[jax.Array, ...], r: jax.Array) -> Scale:
    clip = tuple(b * r for b in base)
    if spec.scheme == "symmetric":
        return scale_from_clip(spec, c=clip[0])
    return scale_from_clip(spec, lo=clip[0], hi=clip[1])


def choose_scale(x: jax.Array, spec: QuantSpec) -> tuple[jax.Array, Scale]:
    """Grouped float32 view of ``x`` and its scales per ``spec.scale``."""
    x = jnp.asarray(x).astype(jnp.float32)
    if spec.scale == "percentile":
        # Padding is NaN so nanpercentile ignores it; a NaN of the input itself makes its
        # group's clip value NaN, so the group comes back NaN as with amax, mse and MX.
        xg_nan, axes = to_groups(x, spec, fill=np.nan)
        xg, _ = to_groups(x, spec)
        has_nan = jnp.any(jnp.isnan(xg), axis=axes, keepdims=True)
        p = spec.clip_percentile
        if spec.scheme == "symmetric":
            c = jnp.nanpercentile(jnp.abs(xg_nan), p, axis=axes, keepdims=True)
            c = jnp.where(has_nan, jnp.nan, c)
            return xg, scale_from_clip(spec, c=c.astype(jnp.float32))
        lo = jnp.nanpercentile(xg_nan, 100.0 - p, axis=axes, keepdims=True)
        hi = jnp.nanpercentile(xg_nan, p, axis=axes, keepdims=True)
        lo = jnp.where(has_nan, jnp.nan, jnp.minimum(lo, 0.0)).astype(jnp.float32)
        hi = jnp.where(has_nan, jnp.nan, jnp.maximum(hi, 0.0)).astype(jnp.float32)
        return xg, scale_from_clip(spec, lo=lo, hi=hi)
    xg, axes = to_groups(x, spec)
    if spec.scale == "mse":
        return xg, _search_mse(xg, axes, spec)
    if spec.scale == "none":
        return xg, scale_from_clip(spec)
    if spec.scheme == "symmetric":
        return xg, scale_from_clip(spec, c=group_amax(xg, axes))
    lo, hi = _min_max(xg, axes)
    return xg, scale_from_clip(spec, lo=lo, hi=hi)
