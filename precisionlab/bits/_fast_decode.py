"""Fast decode paths into float32, each the general path's results in fewer operations.

:func:`decode_fast` returns float32 values of codes where a fast path applies (formats whose
nonzero finite values are float32 normals, E8M0, integers of at most 24 bits), else None, and
the caller takes the general path (parse, then pack into float32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax

from precisionlab.bits._parse import E8M0, F32, bias, const
from precisionlab.formats import FloatFormat, Format, IntFormat, Specials


def decode_fast(codes: jax.Array, fmt: Format, dtype: npt.DTypeLike) -> jax.Array | None:
    """Values of ``codes`` (masked to ``fmt.bits``, in ``fmt.code_dtype``) as ``dtype`` by a
    fast path, or None where none applies (every fast path produces float32)."""
    if _fast_decode_applies(fmt, dtype):
        assert isinstance(fmt, FloatFormat)
        return _decode_to_float32_fast(codes, fmt)
    if jnp.dtype(dtype) != jnp.float32:
        return None
    if fmt == E8M0:
        return _decode_e8m0_to_float32(codes)
    if isinstance(fmt, IntFormat) and fmt.bits <= 24:
        return _decode_small_int_to_float32(codes, fmt)
    return None


def _decode_to_float32_fast(codes: jax.Array, fmt: FloatFormat) -> jax.Array:
    """Fast decode into float32 for formats whose nonzero finite values are float32 normals.

    Normal codes are re-biased (one shift and one add); subnormal codes are small integers
    (converted to float32 exactly, then their exponent field lowered); same-exponent formats
    (bfloat16, tf32) are one shift.
    """
    work = jnp.dtype(jnp.uint32)
    c = codes.astype(work)
    m = fmt.mantissa_bits
    if fmt.exponent_bits == 8 and fmt.bias == 127 and fmt.specials is Specials.IEEE:
        return lax.bitcast_convert_type(c << const(32 - fmt.bits, work), jnp.float32)
    mag = c & const(fmt.magnitude_mask, work)
    sign = (c & const(fmt.sign_mask, work)) << const(32 - fmt.bits, work)
    bits = (mag << const(23 - m, work)) + const((127 - bias(fmt)) << 23, work)
    if fmt.subnormals:
        mant = mag & const(fmt.mantissa_mask, work)
        exact = lax.bitcast_convert_type(mant.astype(jnp.int32).astype(jnp.float32), work)
        sub_bits = exact - const((m - fmt.emin) << 23, work)
        is_sub = mag < const(1 << m, work)
        bits = jnp.where(is_sub, jnp.where(mag == 0, jnp.zeros_like(bits), sub_bits), bits)
    quiet_nan = const(0x7FC00000, work)
    if fmt.specials is Specials.IEEE:
        top = const(fmt.exponent_field_max << m, work)
        payload = (mag & const(fmt.mantissa_mask, work)) << const(23 - m, work)
        bits = jnp.where(mag >= top, const(0x7F800000, work) | payload, bits)
    elif fmt.specials is Specials.FN:
        bits = jnp.where(mag == const(fmt.magnitude_mask, work), quiet_nan, bits)
    elif fmt.specials is Specials.FNUZ:
        bits = jnp.where(c == const(fmt.sign_mask, work), quiet_nan, bits)
    return lax.bitcast_convert_type(bits | sign, jnp.float32)


def _fast_decode_applies(fmt: Format, dtype: npt.DTypeLike) -> bool:
    if jnp.dtype(dtype) != jnp.float32 or not isinstance(fmt, FloatFormat):
        return False
    if fmt.mantissa_bits > 23 or fmt.emax > F32.emax:
        return False
    if fmt.exponent_bits == 8 and fmt.bias == 127 and fmt.specials is Specials.IEEE:
        return fmt.signed  # bfloat16, tf32: a shift
    smallest = fmt.emin - fmt.mantissa_bits if fmt.subnormals else fmt.emin
    return smallest >= F32.emin and (fmt.subnormals or fmt.specials is not Specials.FNUZ)


def _decode_e8m0_to_float32(codes: jax.Array) -> jax.Array:
    """E8M0 code c is 2**(c - 127): float32's exponent field, except 2**-127 (code 0), a
    float32 subnormal, and 255, NaN (quiet, positive, as on the general path). Both are the
    shifted code with the bit 0x400000 set: it is set without a select, from one uint8 test
    (c - 1 wraps code 0 to 255); faster than two selects on the float32 bits in interleaved
    timings (uint8 codes, as :func:`precisionlab.bits._codec._decode` passes them)."""
    work = jnp.dtype(jnp.uint32)
    c = codes.astype(jnp.uint8)
    special = (c - np.uint8(1)) >= np.uint8(254)  # codes 0 and 255
    bits = (c.astype(work) << const(23, work)) | (special.astype(work) << const(22, work))
    return lax.bitcast_convert_type(bits, jnp.float32)


def _decode_small_int_to_float32(codes: jax.Array, fmt: IntFormat) -> jax.Array:
    """Integer codes of at most 24 bits into float32: sign-extend the two's complement code
    (shift it to the top of an int32 and back) and convert; every such integer is a float32,
    so the conversion is exact, and zero is +0 as on the general path."""
    c = codes.astype(jnp.uint32)
    if fmt.signed:
        up = const(32 - fmt.bits, jnp.uint32)
        v = lax.shift_right_arithmetic(
            lax.bitcast_convert_type(c << up, jnp.int32), up.astype(jnp.int32)
        )
    else:
        v = c.astype(jnp.int32)
    return v.astype(jnp.float32)
