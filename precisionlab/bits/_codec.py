"""Vectorized, jittable codecs built from integer and bit operations (and a few float ones).

Every conversion goes through one core, :func:`precisionlab.bits._pack.pack`: a value given
as sign, an unsigned integer significand ``m`` and a power-of-two exponent ``e2`` (value = m *
2**e2, parsed by :mod:`precisionlab.bits._parse`) is rounded to a target format and packed into
its code. Encoding parses the input float's bit pattern into that form; decoding parses a code
of the format and packs it into float32 (or float64). No float comparison and almost no float
arithmetic runs on the codec path: XLA on CPU flushes float32 subnormals in both, and
``lax.reduce_precision`` only knows IEEE-style formats. The common conversions from and into
float32 take fast paths with the same results (:mod:`precisionlab.bits._fast_encode`,
:mod:`precisionlab.bits._fast_decode`), which say where they use a float operation and why
flushing cannot change it.

This module holds the public functions: input checks and the jitted dispatch.
The conventions where formats leave a choice are those of :mod:`precisionlab.bits.reference`.
"""

from __future__ import annotations

from enum import IntEnum
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt
from jax import lax
from jax.typing import ArrayLike

from precisionlab.bits._fast_decode import decode_fast
from precisionlab.bits._fast_encode import encode_fast
from precisionlab.bits._pack import pack
from precisionlab.bits._parse import SOURCE_FORMATS, parse, parse_floats, work_dtype
from precisionlab.bits._rounding import Rounding, parse_rounding
from precisionlab.formats import Format, IntFormat, get_format

__all__ = [
    "Class",
    "classify",
    "decode",
    "encode",
    "fields",
    "round_to_format",
]


class Class(IntEnum):
    """Class of a code, as returned by :func:`classify`."""

    ZERO = 0
    SUBNORMAL = 1
    NORMAL = 2
    INF = 3
    NAN = 4


# --- public API -----------------------------------------------------------------------------
def _check_input(x: Any) -> jax.Array:
    if isinstance(x, bool):
        raise TypeError("encode takes floating-point values, got a bool")
    if isinstance(x, int | float):
        x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]  # made at run time
        x = jnp.asarray(x, dtype=jnp.float64 if x64 else jnp.float32)
    x = jnp.asarray(x)
    if jnp.dtype(x.dtype) not in SOURCE_FORMATS:
        raise TypeError(
            f"encode takes float32, float16, bfloat16 or (with jax_enable_x64) float64 "
            f"arrays, got {x.dtype}; cast explicitly first"
        )
    return x


@partial(jax.jit, static_argnames=("fmt", "mode", "saturate", "subnormals", "random_bits"))
def _encode(
    x: jax.Array,
    key: jax.Array | None,
    *,
    fmt: Format,
    mode: Rounding,
    saturate: bool,
    subnormals: bool,
    random_bits: int,
) -> jax.Array:
    src = SOURCE_FORMATS[jnp.dtype(x.dtype)]
    if mode is not Rounding.STOCHASTIC:
        fast = encode_fast(x, src, fmt, mode, saturate, subnormals)
        if fast is not None:
            return fast
    work = work_dtype(src, fmt)
    p = parse_floats(x, work)
    rand = None
    if mode is Rounding.STOCHASTIC:
        assert key is not None  # encode refuses stochastic rounding without a key
        rand = jax.random.bits(key, x.shape, jnp.uint32)
    return pack(p, fmt, mode, saturate, subnormals, rand, random_bits)


def encode(
    x: ArrayLike,
    fmt: Format | str,
    *,
    rounding: str | Rounding = "nearest_even",
    saturate: bool = False,
    subnormals: bool = True,
    key: jax.Array | None = None,
    random_bits: int | None = None,
) -> jax.Array:
    """Bit patterns of ``x`` stored in ``fmt``.

    Args:
      x: float32, float16 or bfloat16 array (upcast exactly), or float64 with
        ``jax_enable_x64`` (encoded from its own bits, no double rounding). Python scalars
        become float32 (float64 under x64) first.
      fmt: a format or its name; static.
      rounding: one of :data:`~precisionlab.bits._rounding.ROUNDING_MODES`; static.
      saturate: map out-of-range values and +-inf to +-max; NaN stays NaN where it exists.
      subnormals: if False, results that would be subnormal become zero of the same sign.
      key: PRNG key, required by ``rounding="stochastic"``.
      random_bits: random bits per element for stochastic rounding (1..32, default 32); the
        fractional distance is truncated to this many bits, as hardware does.

    Returns:
      Codes with ``x``'s shape, dtype ``fmt.code_dtype`` (uint8, uint16 or uint32). Integer
      formats hold two's-complement codes (int4 -1 is 0xF) of the rounded, saturated value.

    Example:
      float8_e4m3fn has no infinity: 500 overflows to NaN (0x7f), or saturates to 448 (0x7e).

      >>> import jax.numpy as jnp
      >>> from precisionlab import encode
      >>> x = jnp.array([1.0, -2.0, 0.1, 500.0])
      >>> [hex(c) for c in encode(x, "e4m3").tolist()]
      ['0x38', '0xc0', '0x1d', '0x7f']
      >>> [hex(c) for c in encode(x, "e4m3", saturate=True).tolist()]
      ['0x38', '0xc0', '0x1d', '0x7e']
    """
    fmt = get_format(fmt)
    mode = parse_rounding(rounding)
    x = _check_input(x)
    if mode is Rounding.STOCHASTIC:
        if key is None:
            raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(0)")
        bits = 32 if random_bits is None else random_bits
        if not isinstance(bits, int) or not 1 <= bits <= 32:
            raise ValueError(f"random_bits must be an int from 1 to 32, got {random_bits!r}")
    else:
        if key is not None:
            raise ValueError(f"key is only used by rounding='stochastic', not {mode.value!r}")
        bits = 32
    return _encode(
        x,
        key,
        fmt=fmt,
        mode=mode,
        saturate=bool(saturate),
        subnormals=bool(subnormals),
        random_bits=bits,
    )


@partial(jax.jit, static_argnames=("fmt", "dtype"))
def _decode(codes: jax.Array, *, fmt: Format, dtype: np.dtype) -> jax.Array:
    # Masked inside the jit: outside, it would be one more whole-array buffer and pass.
    mask = (1 << fmt.bits) - 1
    codes = codes.astype(fmt.code_dtype) & np.array(mask, dtype=fmt.code_dtype)
    fast = decode_fast(codes, fmt, dtype)
    if fast is not None:
        return fast
    out = SOURCE_FORMATS[jnp.dtype(dtype)]
    work = work_dtype(fmt, out)
    p = parse(codes, fmt, work)
    bits = pack(p, out, Rounding.NEAREST_EVEN, False, True, None, 32)
    return lax.bitcast_convert_type(bits, jnp.dtype(dtype))


def _check_codes(codes: Any, fmt: Format) -> jax.Array:
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"codes must be an integer array, got {codes.dtype}")
    return codes


def decode(codes: ArrayLike, fmt: Format | str, *, dtype: npt.DTypeLike = jnp.float32) -> jax.Array:
    """Values of the codes of ``fmt``.

    Args:
      codes: integer array of codes (only the low ``fmt.bits`` bits are read).
      fmt: a format or its name; static.
      dtype: float32 (default), float64 (needs ``jax_enable_x64``; exact for every format),
        float16 or bfloat16. Values that the dtype cannot hold are rounded to nearest even.

    Returns:
      An array of ``dtype`` with the codes' shape; integer formats give their integer value.

    Example:
      >>> import jax.numpy as jnp
      >>> from precisionlab import decode
      >>> decode(jnp.array([0x38, 0xC0, 0x1D, 0x7E, 0x7F], jnp.uint8), "e4m3").tolist()
      [1.0, -2.0, 0.1015625, 448.0, nan]
    """
    fmt = get_format(fmt)
    dtype = jnp.dtype(dtype)
    if dtype not in SOURCE_FORMATS:
        raise ValueError(f"decode produces float32, float64, float16 or bfloat16, not {dtype}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:  # type: ignore[attr-defined]
        raise ValueError("decode to float64 needs jax.config.update('jax_enable_x64', True)")
    return _decode(_check_codes(codes, fmt), fmt=fmt, dtype=dtype)


def round_to_format(x: ArrayLike, fmt: Format | str, **kwargs: Any) -> jax.Array:
    """The value ``x`` takes when stored in ``fmt``: ``decode(encode(x, fmt, ...), fmt)``.

    Returns float32 (float64 for float64 input); accepts the keyword arguments of
    :func:`encode`.

    Example:
      1 + 2**-8 lies halfway between two bfloat16 values and rounds to the even one, 1.0.

      >>> import jax.numpy as jnp
      >>> from precisionlab import round_to_format
      >>> round_to_format(jnp.array([0.1, 1.00390625, 3.0]), "bf16").tolist()
      [0.10009765625, 1.0, 3.0]
      >>> round_to_format(jnp.float32(500.0), "e4m3", saturate=True).tolist()
      448.0
    """
    x = _check_input(x)
    out = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    return decode(encode(x, fmt, **kwargs), fmt, dtype=out)


def fields(codes: ArrayLike, fmt: Format | str) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(sign, biased_exponent, mantissa)`` fields of float codes, each in the code dtype.

    Integer formats give ``(sign, 0, magnitude bits)`` of the two's-complement code.

    Example:
      -1.5 is -1.1 (binary) x 2**0: float8_e5m2 stores sign 1, exponent 0 + bias 15, mantissa 10.

      >>> import jax.numpy as jnp
      >>> from precisionlab import encode, fields
      >>> code = encode(jnp.float32(-1.5), "e5m2")
      >>> hex(int(code)), [int(f) for f in fields(code, "e5m2")]
      ('0xbe', [1, 15, 2])
    """
    fmt = get_format(fmt)
    return _fields(_check_codes(codes, fmt), fmt=fmt)


@partial(jax.jit, static_argnames="fmt")
def _fields(codes: jax.Array, *, fmt: Format) -> tuple[jax.Array, jax.Array, jax.Array]:
    codes = codes.astype(fmt.code_dtype)
    if isinstance(fmt, IntFormat):
        sign = (codes >> (fmt.bits - 1)) & 1 if fmt.signed else jnp.zeros_like(codes)
        low = codes & np.array((1 << (fmt.bits - int(fmt.signed))) - 1, fmt.code_dtype)
        return sign, jnp.zeros_like(codes), low
    m = fmt.mantissa_bits
    sign = (codes >> (fmt.bits - 1)) & 1 if fmt.signed else jnp.zeros_like(codes)
    exponent = (codes >> m) & np.array(fmt.exponent_field_max, fmt.code_dtype)
    mantissa = codes & np.array(fmt.mantissa_mask, fmt.code_dtype)
    return sign, exponent, mantissa


def classify(codes: ArrayLike, fmt: Format | str) -> jax.Array:
    """Class of each code as int8 :class:`Class` values (ZERO, SUBNORMAL, NORMAL, INF, NAN).

    Integer codes are ZERO or NORMAL.

    Example:
      float8_e5m2's smallest normal is 2**-14, so 2**-16 is stored as a subnormal.

      >>> import jax.numpy as jnp
      >>> from precisionlab import Class, classify, encode
      >>> codes = encode(jnp.array([0.0, 2.0**-16, 1.0, jnp.inf, jnp.nan]), "e5m2")
      >>> [Class(c).name for c in classify(codes, "e5m2").tolist()]
      ['ZERO', 'SUBNORMAL', 'NORMAL', 'INF', 'NAN']
    """
    fmt = get_format(fmt)
    return _classify(_check_codes(codes, fmt), fmt=fmt)


@partial(jax.jit, static_argnames="fmt")
def _classify(codes: jax.Array, *, fmt: Format) -> jax.Array:
    codes = codes.astype(fmt.code_dtype)
    if isinstance(fmt, IntFormat):
        mask = np.array((1 << fmt.bits) - 1, fmt.code_dtype)
        return jnp.where(codes & mask == 0, Class.ZERO, Class.NORMAL).astype(jnp.int8)
    work = work_dtype(fmt)
    p = parse(codes, fmt, work)
    exp_field = (codes >> fmt.mantissa_bits) & np.array(fmt.exponent_field_max, fmt.code_dtype)
    cls = jnp.full(codes.shape, Class.NORMAL, jnp.int8)
    if fmt.subnormals:
        cls = jnp.where(exp_field == 0, jnp.int8(Class.SUBNORMAL), cls)
        cls = jnp.where(p.m == 0, jnp.int8(Class.ZERO), cls)
    cls = jnp.where(p.inf, jnp.int8(Class.INF), cls)
    return jnp.where(p.nan, jnp.int8(Class.NAN), cls)
