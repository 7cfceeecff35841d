"""The float32 fast paths of the codec against its general path (parse + round + pack), which
the exhaustive tests check against ml_dtypes and the exact reference.

The fast paths (nearest-even into narrow floats, E8M0 and small ints; E8M0 and int decode) take the
default calls; the general path is reached by calling ``_pack`` directly. By default on every
float32 exponent with the mantissas around each rounding boundary; ``-m slow`` on all 2**32
inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.bits import codec, decode
from precisionlab.bits.rounding import Rounding
from precisionlab.formats import FORMATS, FloatFormat, IntFormat, get_format

NARROW = [f for f in FORMATS.values() if codec._narrow_from_float32(codec._F32, f)]
FAST = [*(f.name for f in NARROW), "float8_e8m0fnu", "bfloat16", "int8", "uint8", "int4", "int2"]
U32 = jnp.dtype(jnp.uint32)


def _general(x: jax.Array, fmt, saturate: bool) -> jax.Array:
    work = codec._work_dtype(codec._F32, fmt)
    p = codec._parse_floats(x, work)
    return codec._pack(p, fmt, Rounding.NEAREST_EVEN, saturate, True, None, 32)


def _fast(x: jax.Array, fmt, saturate: bool) -> jax.Array:
    return codec._encode(
        x, None, fmt=fmt, mode=Rounding.NEAREST_EVEN, saturate=saturate, subnormals=True,
        random_bits=32,
    )  # fmt: skip


def _boundary_inputs() -> np.ndarray:
    """Every float32 exponent field and sign, with mantissas 0, 1, max and, for every drop
    position d, 2**d - 1, 2**d, 2**d + 1 and the halfway points 2**(d-1) +- 1 (ties)."""
    mants = {0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x400001, 0x600000, 0x5FFFFF, 0x600001}
    for d in range(1, 24):
        for base in (1 << d, 1 << (d - 1), 3 << (d - 1)):
            mants |= {(base + k) & 0x7FFFFF for k in (-1, 0, 1)}
    m = np.array(sorted(mants), dtype=np.uint32)
    e = np.arange(256, dtype=np.uint32) << np.uint32(23)
    bits = (e[:, None] | m[None, :]).ravel()
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", FAST)
def test_fast_encode_equals_general_path_at_boundaries(name, saturate):
    fmt = get_format(name)
    if isinstance(fmt, IntFormat) and saturate:
        pytest.skip("integer formats always saturate")
    x = jnp.asarray(_boundary_inputs())
    fast = np.asarray(jax.jit(lambda v: _fast(v, fmt, saturate))(x))
    general = np.asarray(jax.jit(lambda v: _general(v, fmt, saturate))(x))
    bad = np.flatnonzero(fast != general)
    bits = np.asarray(x).view(np.uint32)
    assert bad.size == 0, [(hex(bits[i]), hex(fast[i]), hex(general[i])) for i in bad[:5]]


def test_fast_paths_are_taken():
    """The formats above do take a fast path (else the test compares a path with itself)."""
    x = jnp.zeros(8, jnp.float32)
    for name in FAST:
        fmt = get_format(name)
        text = jax.jit(lambda v, fmt=fmt: _fast(v, fmt, False)).lower(x).as_text()
        assert "count_leading_zeros" not in text, name  # the general path counts them
        assert "clz" not in text, name


def test_e8m0_decode_equals_general_path():
    fmt = get_format("e8m0")
    codes = jnp.arange(256, dtype=jnp.uint8)
    p = codec._parse(codes, fmt, U32)
    general = codec._pack(p, codec._F32, Rounding.NEAREST_EVEN, False, True, None, 32)
    fast = decode(codes, fmt)
    np.testing.assert_array_equal(np.asarray(fast).view(np.uint32), np.asarray(general))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8, 12, 16, 20, 24])
@pytest.mark.parametrize("signed", [True, False])
def test_small_int_decode_equals_general_path(bits, signed):
    """Every code of integers up to 16 bits (a sample of the low, high and sign-boundary
    codes above), with garbage above the format's bits (decode reads the low bits only)."""
    fmt = IntFormat(name=f"{'' if signed else 'u'}int{bits}", bits=bits, signed=signed)
    n = 1 << bits
    codes = (
        np.arange(n, dtype=np.int64)
        if bits <= 16
        else np.r_[0:4096, n // 2 - 4096 : n // 2 + 4096, n - 4096 : n]
    )
    codes = jnp.asarray(codes.astype(fmt.code_dtype))
    p = codec._parse(codes, fmt, U32)
    general = codec._pack(p, codec._F32, Rounding.NEAREST_EVEN, False, True, None, 32)
    fast = decode(codes, fmt)
    np.testing.assert_array_equal(np.asarray(fast).view(np.uint32), np.asarray(general))
    if bits < 8 * fmt.code_dtype.itemsize:  # high garbage bits are ignored
        dirty = codes | jnp.asarray(
            np.array(~(n - 1) & np.iinfo(fmt.code_dtype).max, fmt.code_dtype)
        )
        np.testing.assert_array_equal(np.asarray(decode(dirty, fmt)), np.asarray(fast))
    text = jax.jit(lambda c: decode(c, fmt)).lower(codes).as_text()
    assert "clz" not in text and "count_leading_zeros" not in text  # the fast path ran


@pytest.mark.slow
@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("name", FAST)
def test_fast_encode_equals_general_path_on_every_float32(name, saturate):
    fmt = get_format(name)
    if isinstance(fmt, IntFormat) and saturate:
        pytest.skip("integer formats always saturate")
    n = 1 << 24

    @jax.jit
    def mismatches(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        return jnp.sum(_fast(x, fmt, saturate) != _general(x, fmt, saturate))

    assert sum(int(mismatches(jnp.uint32(i * n))) for i in range(1 << 8)) == 0


assert all(isinstance(f, FloatFormat) for f in NARROW)
