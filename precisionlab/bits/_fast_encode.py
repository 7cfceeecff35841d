"""Fast encode paths from float32, each the general path's results in fewer operations.

:func:`encode_fast` picks the path for a source format, target format and rounding mode, or
returns None where only the general path (:func:`precisionlab.bits._pack.pack`) applies:
float32 -> formats with float32's exponent field (bfloat16, tf32), -> narrower floats (float16,
FP8, FP6, FP4), -> E8M0, -> integers of at most 16 bits. The tests check every path against
the general one over all 2**32 float32 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.bits._pack import finish, nan_magnitude, toward_zero
from precisionlab.bits._parse import E8M0, F32, Parsed, bias, const, uint
from precisionlab.bits._rounding import Rounding
from precisionlab.formats import FloatFormat, Format, IntFormat, Specials


def encode_fast(
    x: jax.Array,
    src: FloatFormat,
    fmt: Format,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
) -> jax.Array | None:
    """Codes of ``x`` (of format ``src``) in ``fmt`` by a fast path, or None where none applies.

    ``mode`` is deterministic (stochastic rounding always takes the general path); all
    arguments but ``x`` are static.
    """
    if isinstance(fmt, FloatFormat) and _same_exponent_field(src, fmt):
        return _encode_same_exponent(x, src, fmt, mode, saturate, subnormals)
    if isinstance(fmt, FloatFormat) and narrow_from_float32(src, fmt):
        if mode is Rounding.NEAREST_EVEN and subnormals and _nearest_even_applies(fmt):
            return _encode_narrow_nearest_even(x, fmt, saturate)
        return _encode_narrow(x, fmt, mode, saturate, subnormals)
    if src is F32 and fmt == E8M0 and mode is Rounding.NEAREST_EVEN and subnormals:
        return _encode_e8m0_nearest_even(x, saturate)
    if src is F32 and isinstance(fmt, IntFormat) and fmt.bits <= 16:
        if mode is Rounding.NEAREST_EVEN:
            return _encode_small_int_nearest_even(x, fmt)
        return _encode_small_int(x, fmt, mode)
    return None


def _apply_rounding(
    q: jax.Array, r: jax.Array, half: jax.Array, neg: jax.Array, mode: Rounding
) -> jax.Array:
    """Round the truncated significand ``q`` given its remainder ``r`` and the remainder of
    one half quantum ``half`` (deterministic modes; same dtype throughout)."""
    one = jnp.ones_like(q)
    if mode is Rounding.NEAREST_EVEN:
        return q + ((r > half) | ((r == half) & ((q & one) == one))).astype(q.dtype)
    if mode is Rounding.NEAREST_AWAY:
        return q + (r >= half).astype(q.dtype)
    if mode is Rounding.UP:
        return q + ((r != 0) & ~neg).astype(q.dtype)
    if mode is Rounding.DOWN:
        return q + ((r != 0) & neg).astype(q.dtype)
    if mode is Rounding.TO_ODD:
        return q | (r != 0).astype(q.dtype)
    return q  # toward_zero


def _same_exponent_field(src: FloatFormat, fmt: Format) -> bool:
    """Whether fmt is src with a shorter mantissa (float32 -> bfloat16, tf32)."""
    return (
        isinstance(fmt, FloatFormat)
        and fmt.specials is Specials.IEEE
        and src.specials is Specials.IEEE
        and fmt.signed
        and fmt.subnormals
        and fmt.exponent_bits == src.exponent_bits
        and fmt.bias == src.bias
        and fmt.mantissa_bits < src.mantissa_bits
    )


def _encode_same_exponent(
    x: jax.Array,
    src: FloatFormat,
    fmt: FloatFormat,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
) -> jax.Array:
    """Fast path: dropping mantissa bits is one shift of the magnitude, with rounding.

    A carry out of the mantissa moves into the exponent field and past the largest finite
    value into the inf code, as the general path would; NaN keeps its top payload bits and
    gets the quiet bit. Same results as :func:`~precisionlab.bits._pack.pack` (checked
    exhaustively by the tests, which go through :func:`~precisionlab.bits.encode`).
    """
    work = uint(src.bits)
    u = lax.bitcast_convert_type(x, work)
    drop = src.mantissa_bits - fmt.mantissa_bits
    mag = u & const(src.magnitude_mask, work)
    neg = (u >> const(src.bits - 1, work)) != 0
    if mode is Rounding.NEAREST_EVEN:  # the common case, in fewer operations
        q = _round_shift_even(mag, drop)
    else:
        q = mag >> const(drop, work)
        r = mag & const((1 << drop) - 1, work)
        q = _apply_rounding(q, r, const(1 << (drop - 1), work), neg, mode)
    inf_mag = const(fmt.exponent_field_max << fmt.mantissa_bits, work)
    max_mag = const(fmt.max_code_magnitude, work)
    src_inf = const(src.exponent_field_max << src.mantissa_bits, work)
    is_nan = mag > src_inf
    if saturate:
        q = jnp.where(q >= inf_mag, max_mag, q)
    elif mode in (Rounding.TOWARD_ZERO, Rounding.TO_ODD, Rounding.UP, Rounding.DOWN):
        # Directed modes overflow to the largest finite value toward zero (IEEE 754).
        toward = toward_zero(mode, neg)
        q = jnp.where((q >= inf_mag) & (mag < src_inf) & toward, max_mag, q)
    if not subnormals:
        q = jnp.where(q < const(1 << fmt.mantissa_bits, work), jnp.zeros_like(q), q)
    quiet = const(1 << (fmt.mantissa_bits - 1), work)
    q = jnp.where(is_nan, (mag >> const(drop, work)) | quiet, q)
    sign = (u >> const(src.bits - fmt.bits, work)) & const(fmt.sign_mask, work)
    return (q | sign).astype(fmt.code_dtype)


def narrow_from_float32(src: FloatFormat, fmt: Format) -> bool:
    """Whether the float32 fast path applies: a signed format with subnormals whose range
    lies inside float32's normal range (float16, the FP8, FP6 and FP4 formats)."""
    return (
        src is F32
        and isinstance(fmt, FloatFormat)
        and fmt.signed
        and fmt.subnormals
        and fmt.mantissa_bits <= 22
        and fmt.emin > F32.emin
        and fmt.emax <= F32.emax
    )


def _encode_narrow(
    x: jax.Array, fmt: FloatFormat, mode: Rounding, saturate: bool, subnormals: bool
) -> jax.Array:
    """Fast path float32 -> narrower float: the input's exponent is read off its bits.

    A result in fmt's normal range is float32's magnitude re-biased: one shift by
    ``23 - m`` with rounding, then a subtraction of the bias difference (a carry moves into
    the next binade). A result in fmt's subnormal range shifts the significand by one more
    bit per binade below fmt's smallest normal. Both share one rounding step and the tail of
    the general path (:func:`~precisionlab.bits._pack.finish`), so the conventions are the
    same by construction.
    """
    work = jnp.dtype(jnp.uint32)
    m = fmt.mantissa_bits
    u = lax.bitcast_convert_type(x, work)
    a = u & const(0x7FFFFFFF, work)
    neg = (u >> const(31, work)) != 0
    exp_field = a >> const(23, work)
    normal_floor = const((127 + fmt.emin) << 23, work)  # bits of fmt's smallest normal
    is_sub = a < normal_floor
    significand = jnp.where(exp_field == 0, a, (a & const(0x7FFFFF, work)) | const(0x800000, work))
    # Bits below fmt's last significand bit: 23 - m for normal results, more below them.
    sub_shift = jnp.minimum(
        const(150 + fmt.emin - m, work) - jnp.maximum(exp_field, const(1, work)),
        const(31, work),
    )
    value = jnp.where(is_sub, significand, a)
    shift = jnp.where(is_sub, sub_shift, const(23 - m, work))
    q = value >> shift
    r = value & ((const(1, work) << shift) - const(1, work))
    half = const(1, work) << (shift - const(1, work))
    q = _apply_rounding(q, r, half, neg, mode)
    rebias = const((127 - bias(fmt)) << m, work)
    mag = jnp.where(is_sub, q, q - rebias)
    inf_bits = const(0x7F800000, work)
    p = Parsed(
        neg=neg,
        m=a,
        e2=None,
        nan=a > inf_bits,
        inf=a == inf_bits,
        payload=a & const(0x7FFFFF, work),
        payload_bits=23,
    )
    overflow = ~is_sub & (mag > const(fmt.max_code_magnitude, work))
    return finish(mag, overflow, None, a != 0, p, fmt, mode, saturate, subnormals)


def _round_shift_even(v: jax.Array, shift: int, offset: int = 0) -> jax.Array:
    """``(v + offset) >> shift`` rounded to nearest, ties to even (``shift`` >= 1 and
    ``offset`` a multiple of ``2**(shift + 1)``, static; unsigned ``v`` with room for the carry,
    arithmetic modulo the dtype's width): adding half a quantum less one, plus the parity
    of the result, carries exactly when the dropped bits exceed half or equal it at an odd
    result."""
    dtype = v.dtype
    width = jnp.iinfo(dtype).bits
    odd = (v >> const(shift, dtype)) & const(1, dtype)
    add = (offset + (1 << (shift - 1)) - 1) % (1 << width)
    return (v + const(add, dtype) + odd) >> const(shift, dtype)


def _nearest_even_applies(fmt: FloatFormat) -> bool:
    """Formats whose overflow, inf and NaN codes :func:`_encode_narrow_nearest_even` gets
    from one ``min`` and one NaN select: IEEE, FN (NaN is the code after the largest), none."""
    if fmt.specials is Specials.FN:
        return nan_magnitude(fmt) == fmt.max_code_magnitude + 1
    return fmt.specials in (Specials.IEEE, Specials.NONE)


def _encode_narrow_nearest_even(x: jax.Array, fmt: FloatFormat, saturate: bool) -> jax.Array:
    """Fastest path, float32 -> narrower float, nearest-even with subnormals (the default).

    Normal results: float32's magnitude rounded at bit ``23 - m`` (:func:`_round_shift_even`)
    and re-biased; a carry moves into the next binade and past the largest finite value.
    Subnormal results (|x| below fmt's smallest normal): one float32 addition of
    ``2**(emin - m + 23)``, whose unit in the last place is fmt's subnormal quantum, so the
    FPU rounds to nearest-even and the sum's low bits are the code. The only float operation
    on the codec path: its operands and sum are float32 normals, except float32-subnormal
    inputs, which XLA may flush to zero, harmlessly: they round to zero either way.
    Overflow, inf and NaN: magnitudes above the largest code clamp to inf (IEEE), to the NaN
    code that follows the largest finite one (FN) or to the largest value (saturating, or
    formats without specials); NaN inputs are then selected. Same codes as
    :func:`_encode_narrow` (checked over all 2**32 inputs by the tests).
    """
    work = jnp.dtype(jnp.uint32)
    m = fmt.mantissa_bits
    u = lax.bitcast_convert_type(x, work)
    a = u & const(0x7FFFFFFF, work)
    # Re-biased before the shift (one add fewer): the sum wraps only where |x| is below
    # fmt's normal range, and those lanes take the subnormal result.
    norm = _round_shift_even(a, 23 - m, offset=-((127 - bias(fmt)) << 23))
    magic = (127 + fmt.emin - m + 23) << 23  # bits of 2**(emin - m + 23)
    total = lax.bitcast_convert_type(a, jnp.float32) + np.float32(2.0 ** (fmt.emin - m + 23))
    sub = lax.bitcast_convert_type(total, work) - const(magic, work)
    mag = jnp.where(a < const((127 + fmt.emin) << 23, work), sub, norm)
    if saturate or fmt.specials is Specials.NONE:
        top = fmt.max_code_magnitude
    elif fmt.specials is Specials.IEEE:
        top = fmt.exponent_field_max << m  # inf
    else:
        top = nan_magnitude(fmt)  # FN: overflow and inf become NaN
    mag = jnp.minimum(mag, const(top, work))
    sign = (u >> const(32 - fmt.bits, work)) & const(fmt.sign_mask, work)
    code = sign | mag
    is_nan = a > const(0x7F800000, work)
    if fmt.specials is Specials.IEEE:  # quiet NaN keeping the top payload bits
        payload = (a & const(0x7FFFFF, work)) >> const(23 - m, work)
        code = jnp.where(is_nan, sign | const(nan_magnitude(fmt), work) | payload, code)
    elif fmt.specials is Specials.FN:
        if saturate:  # otherwise NaN's magnitude, above every finite one, clamped to NaN
            code = jnp.where(is_nan, sign | const(nan_magnitude(fmt), work), code)
    else:  # documented choice: NaN into a format without NaN is +0
        code = jnp.where(is_nan, jnp.zeros_like(code), code)
    return code.astype(fmt.code_dtype)


def _encode_small_int(x: jax.Array, fmt: IntFormat, mode: Rounding) -> jax.Array:
    """Fast path float32 -> integers of at most 16 bits: round the significand at the
    binary point (its position read off the exponent field), saturate, two's complement.

    Magnitudes of 2**23 and more are integers beyond every such format's range, so they
    saturate without rounding; NaN gives 0, as on the general path.
    """
    work = jnp.dtype(jnp.uint32)
    u = lax.bitcast_convert_type(x, work)
    a = u & const(0x7FFFFFFF, work)
    neg = (u >> const(31, work)) != 0
    exp_field = a >> const(23, work)
    significand = jnp.where(exp_field == 0, a, (a & const(0x7FFFFF, work)) | const(0x800000, work))
    # value = significand * 2**(exp_field - 150): bits below the binary point.
    shift = jnp.clip(
        const(150, work) - jnp.maximum(exp_field, const(1, work)),
        const(1, work),
        const(31, work),
    )
    q = significand >> shift
    r = significand & ((const(1, work) << shift) - const(1, work))
    half = const(1, work) << (shift - const(1, work))
    q = _apply_rounding(q, r, half, neg, mode)
    one = const(1, work)
    limit = jnp.where(neg, const(-fmt.min, work), const(fmt.max, work))
    big = a >= const(150 << 23, work)  # |x| >= 2**23, inf included
    q = jnp.where(big, limit, jnp.minimum(q, limit))
    q = jnp.where(a > const(0x7F800000, work), jnp.zeros_like(q), q)  # NaN -> 0
    mask = const((1 << fmt.bits) - 1, work)
    code = jnp.where(neg, (~q + one) & mask, q)
    return code.astype(fmt.code_dtype)


def _encode_e8m0_nearest_even(x: jax.Array, saturate: bool) -> jax.Array:
    """Fast path float32 -> E8M0 (unsigned powers of two 2**-127 .. 2**127, code 255 NaN),
    nearest-even: float32's bits rounded at the exponent field give the code directly. A
    tie, 1.5 * 2**k, goes up: 2**(k + 1) is the even multiple of 2**k. Float32 subnormals
    lie between 2**-127 (code 0) and 2**-126 (code 1), whose midpoint is the pattern
    0x600000.
    Conventions as on the general path (same codes over all 2**32 inputs, by the tests):
    overflow and inf give NaN (the largest value when saturating), zeros and negative
    values NaN (code 0, the smallest value, when saturating), NaN stays NaN.
    """
    work = jnp.dtype(jnp.uint32)
    u = lax.bitcast_convert_type(x, work)
    if not saturate:  # the default, in 10 operations instead of 15
        return _encode_e8m0_nearest_even_nan(u)
    a = u & const(0x7FFFFFFF, work)
    code = (a + const(0x400000, work)) >> const(23, work)
    code = jnp.where(a < const(0x800000, work), (a >= const(0x600000, work)).astype(work), code)
    nan = const(0xFF, work)
    code = jnp.minimum(code, const(0xFE, work) if saturate else nan)
    invalid = (u > const(0x7FFFFFFF, work)) | (a == 0)  # negative, or a zero
    code = jnp.where(invalid, jnp.zeros_like(code) if saturate else nan, code)
    code = jnp.where(a > const(0x7F800000, work), nan, code)
    return code.astype(jnp.uint8)


def _encode_e8m0_nearest_even_nan(u: jax.Array) -> jax.Array:
    """:func:`_encode_e8m0_nearest_even` without saturation, from float32 bits ``u``.

    ``((u >> 22) + 1) >> 1`` is the exponent field rounded half up at its top mantissa bit
    for positive values; with the sign bit in it, every negative input (NaN, zeros and -inf
    included) lands above 255, so one ``min`` gives NaN (255) for them, for overflow, inf
    and positive NaN. Two selects remain: positive float32 subnormals in [2**-127, 1.5 *
    2**-127) (``u >> 21 == 2``) round down to code 0, not up, and +0 is NaN.
    """
    work = u.dtype
    code = ((u >> const(22, work)) + const(1, work)) >> const(1, work)
    code = jnp.minimum(code, const(0xFF, work))
    code = jnp.where(u >> const(21, work) == const(2, work), jnp.zeros_like(code), code)
    code = jnp.where(u == const(0, work), const(0xFF, work), code)
    return code.astype(jnp.uint8)


def _encode_small_int_nearest_even(x: jax.Array, fmt: IntFormat) -> jax.Array:
    """Fastest path float32 -> integers of at most 16 bits, nearest-even (the default).

    x is clamped to [min, max] in float32 (two compares and selects; NaN is selected to 0 at
    the end), then 1.5 * 2**23 is added: the sum has a unit in the last place of 1, so the
    FPU rounds to the nearest integer, ties to even, and the low bits of the sum are that
    integer in two's complement (for any |value| < 2**22). Rounding after the clamp equals
    rounding then saturating, since min and max are integers. Same codes as
    :func:`_encode_small_int` (checked over all 2**32 inputs by the tests). Float32-subnormal
    inputs, which XLA may flush to zero, round to zero either way. Seven operations per
    element, against fifteen for the same rounding on the integer bits.
    """
    work = jnp.dtype(jnp.uint32)
    lo, hi = np.float32(fmt.min), np.float32(fmt.max)
    # where(x > lo, x, lo) rather than maximum: XLA's NaN-propagating max costs more, and a
    # NaN lane is overwritten below anyway.
    y = jnp.where(x > lo, x, lo)
    y = jnp.where(y < hi, y, hi)
    code = lax.bitcast_convert_type(y + np.float32(1.5 * 2.0**23), work)
    is_nan = (lax.bitcast_convert_type(x, work) << const(1, work)) > const(0xFF000000, work)
    code = jnp.where(is_nan, jnp.zeros_like(code), code)
    if fmt.bits not in (8, 16):  # otherwise the cast to the code dtype drops the high bits
        code = code & const((1 << fmt.bits) - 1, work)
    return code.astype(fmt.code_dtype)
