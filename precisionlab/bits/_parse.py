"""Codes as unsigned integer words: the work dtype, shifts safe at any count, and parsing.

A code of any format, or a float's bit pattern, is split into a sign, an unsigned integer
significand ``m`` and a power-of-two exponent ``e2`` (value = m * 2**e2) or a special
(:class:`Parsed`), with integer operations only; :mod:`precisionlab.bits._pack` rounds that
form into a format.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax

from precisionlab.formats import FORMATS, FloatFormat, Format, IntFormat, Specials


def _float_format(name: str) -> FloatFormat:
    fmt = FORMATS[name]
    assert isinstance(fmt, FloatFormat)
    return fmt


F32 = _float_format("float32")
F64 = _float_format("float64")
E8M0 = _float_format("float8_e8m0fnu")
#: The float formats of the array dtypes the codec reads and writes.
SOURCE_FORMATS: dict[np.dtype, FloatFormat] = {
    jnp.dtype(jnp.float32): F32,
    jnp.dtype(jnp.float16): _float_format("float16"),
    jnp.dtype(jnp.bfloat16): _float_format("bfloat16"),
    jnp.dtype(jnp.float64): F64,
}


class Parsed(NamedTuple):
    """A decoded value: (-1)**neg * m * 2**e2, or a special. Arrays of one shape.

    ``lead``/``emin`` describe the source when it is a float format: its normal significands
    have their leading bit at ``lead`` and its smallest normal exponent is ``emin``. A target
    whose smallest normal exponent is larger never needs the exact exponent of a source
    subnormal (it is clamped away), which spares a count-leading-zeros per element.
    """

    neg: jax.Array  # bool
    m: jax.Array  # unsigned work dtype; 0 for zeros
    e2: jax.Array | None  # int32; None where only the specials are read (fast paths)
    nan: jax.Array  # bool
    inf: jax.Array  # bool
    payload: jax.Array  # NaN payload bits aligned to the top of the source mantissa, work dtype
    payload_bits: int  # width of the payload field
    lead: int | None = None
    emin: int | None = None


def uint(bits: int) -> jnp.dtype:
    return jnp.dtype({8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[bits])


def work_dtype(*formats: Format) -> jnp.dtype:
    """uint32 unless a significand of a format needs more (then uint64, which needs x64)."""
    need = 0
    for fmt in formats:
        if isinstance(fmt, FloatFormat):
            need = max(need, fmt.mantissa_bits + 3)
        else:
            need = max(need, fmt.bits + 1)
    if need <= 31:
        return jnp.dtype(jnp.uint32)
    if not jax.config.jax_enable_x64:  # type: ignore[attr-defined]  # made at run time
        raise ValueError(
            "formats with more than 28 mantissa bits (float64) need 64-bit integers: "
            "enable them with jax.config.update('jax_enable_x64', True)"
        )
    return jnp.dtype(jnp.uint64)


def shr(x: jax.Array, n: jax.Array) -> jax.Array:
    """Logical right shift that gives 0 for shift counts >= the bit width."""
    width = jnp.iinfo(x.dtype).bits
    n_c = jnp.clip(n, 0, width - 1).astype(x.dtype)
    return jnp.where(n >= width, jnp.zeros_like(x), lax.shift_right_logical(x, n_c))


def shl(x: jax.Array, n: jax.Array) -> jax.Array:
    """Left shift that gives 0 for shift counts >= the bit width."""
    width = jnp.iinfo(x.dtype).bits
    n_c = jnp.clip(n, 0, width - 1).astype(x.dtype)
    return jnp.where(n >= width, jnp.zeros_like(x), lax.shift_left(x, n_c))


def const(value: int, dtype: npt.DTypeLike) -> jax.Array:
    """A scalar array of ``dtype`` holding ``value`` exactly (no weak-type promotion)."""
    return jnp.asarray(np.array(value, dtype=dtype))


def bias(fmt: FloatFormat) -> int:
    """``fmt``'s exponent bias (a FloatFormat fills in the IEEE default when built)."""
    assert fmt.bias is not None
    return fmt.bias


def parse(codes: jax.Array, fmt: Format, work: jnp.dtype) -> Parsed:
    """Split codes of ``fmt`` into sign, significand and exponent (integer ops only)."""
    c = codes.astype(work)
    if isinstance(fmt, IntFormat):
        if fmt.signed:
            neg = (c >> const(fmt.bits - 1, work)) & const(1, work) == const(1, work)
            mag = jnp.where(neg, (const((1 << fmt.bits), work) - c), c)
        else:
            neg = jnp.zeros(c.shape, bool)
            mag = c
        false = jnp.zeros(c.shape, bool)
        return Parsed(neg, mag, jnp.zeros(c.shape, jnp.int32), false, false, jnp.zeros_like(c), 0)

    m_bits = fmt.mantissa_bits
    zero = jnp.zeros_like(c)
    neg = (c & const(fmt.sign_mask, work)) != zero if fmt.signed else jnp.zeros(c.shape, bool)
    mag = c & const(fmt.magnitude_mask, work)
    exp_field = (mag >> const(m_bits, work)).astype(jnp.int32)
    mant = mag & const(fmt.mantissa_mask, work)
    top = fmt.exponent_field_max
    if fmt.specials is Specials.IEEE:
        special = exp_field == top
        nan = special & (mant != zero)
        inf = special & (mant == zero)
    elif fmt.specials is Specials.FN:
        nan = mag == const((top << m_bits) | fmt.mantissa_mask, work)
        inf = jnp.zeros(c.shape, bool)
    elif fmt.specials is Specials.FNUZ:
        nan = c == const(fmt.sign_mask, work)
        inf = jnp.zeros(c.shape, bool)
    else:
        nan = inf = jnp.zeros(c.shape, bool)
    implicit = const(1 << m_bits, work)
    if fmt.subnormals:
        is_sub = exp_field == 0
        m = jnp.where(is_sub, mant, mant | implicit)
        e2 = jnp.where(is_sub, fmt.emin, exp_field - bias(fmt)) - m_bits
    else:
        m = mant | implicit
        e2 = exp_field - bias(fmt) - m_bits
    return Parsed(neg, m, e2.astype(jnp.int32), nan, inf, mant, m_bits, m_bits, fmt.emin)


def parse_floats(x: jax.Array, work: jnp.dtype) -> Parsed:
    src = SOURCE_FORMATS[jnp.dtype(x.dtype)]
    return parse(lax.bitcast_convert_type(x, uint(src.bits)), src, work)
