"""The float32 fast paths of the codec against its general path (parse + round + pack), which
the exhaustive tests check against ml_dtypes and the exact reference.

The fast paths (nearest-even into narrow floats, E8M0 and small ints; E8M0 and int decode) take the
default calls; the general path is reached by calling ``_pack.pack`` directly. By default on every
float32 exponent with the mantissas around each rounding boundary; ``-m slow`` on all 2**32
inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.bits import _codec as codec
from precisionlab.bits import _fast_encode, _pack, _parse, decode
from precisionlab.bits._rounding import Rounding
from precisionlab.formats import FORMATS, FloatFormat, IntFormat, get_format

NARROW = [f for f in FORMATS.values() if _fast_encode.narrow_from_float32(_parse.F32, f)]
FAST = [*(f.name for f in NARROW), "float8_e8m0fnu", "bfloat16", "int8", "uint8", "int4", "int2"]
U32 = jnp.dtype(jnp.uint32)


def _general(x: jax.Array, fmt, saturate: bool) -> jax.Array:
    work = _parse.work_dtype(_parse.F32, fmt)
    p = _parse.parse_floats(x, work)
    return _pack.pack(p, fmt, Rounding.NEAREST_EVEN, saturate, True, None, 32)


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

    @jax.jit  # one program, not dozens of op-by-op ones
    def general(c):
        p = _parse.parse(c, fmt, U32)
        return _pack.pack(p, _parse.F32, Rounding.NEAREST_EVEN, False, True, None, 32)

    fast = decode(codes, fmt)
    np.testing.assert_array_equal(np.asarray(fast).view(np.uint32), np.asarray(general(codes)))


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

    @jax.jit  # one program, not dozens of op-by-op ones per case (seconds of compiling each)
    def general(c):
        p = _parse.parse(c, fmt, U32)
        return _pack.pack(p, _parse.F32, Rounding.NEAREST_EVEN, False, True, None, 32)

    fast = decode(codes, fmt)
    np.testing.assert_array_equal(np.asarray(fast).view(np.uint32), np.asarray(general(codes)))
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

# --- float32 -> small integers beyond FAST: uint4 and custom 16-, 12- and 3-bit integers ------
# The nearest-even fast path clamps in float32 and rounds by adding 1.5 * 2**23.
SMALL_INTS = [
    get_format("uint4"),
    IntFormat(name="int16", bits=16, signed=True),
    IntFormat(name="uint16", bits=16, signed=False),
    IntFormat(name="int12", bits=12, signed=True),
    IntFormat(name="uint3", bits=3, signed=False),
]


def _extra_inputs() -> np.ndarray:
    """Values at and around every format's limits and the halves between integers there."""
    edges = np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 2047, 2048, 32767, 32768, 65535, 65536])
    near = np.concatenate([edges + d for d in (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0)])
    v = np.concatenate([near, -near, [np.inf, -np.inf, np.nan, -np.nan, 2.0**22, 2.0**23]])
    return v.astype(np.float32)


@pytest.mark.parametrize("fmt", SMALL_INTS, ids=lambda f: f.name)
def test_small_int_fast_encode_equals_general_path(fmt):
    x = jnp.asarray(np.concatenate([_boundary_inputs(), _extra_inputs()]))
    fast = np.asarray(jax.jit(lambda v: _fast(v, fmt, False))(x))
    general = np.asarray(jax.jit(lambda v: _general(v, fmt, False))(x))
    bad = np.flatnonzero(fast != general)
    bits = np.asarray(x).view(np.uint32)
    assert bad.size == 0, [(hex(bits[i]), hex(fast[i]), hex(general[i])) for i in bad[:5]]
    text = jax.jit(lambda v: _fast(v, fmt, False)).lower(x).as_text()
    assert "clz" not in text and "count_leading_zeros" not in text  # the fast path ran


def test_small_int_fast_encode_matches_numpy_rint_and_clip():
    """An independent oracle: numpy's rint (ties to even), clipped, as two's complement."""
    x = _extra_inputs()
    finite = np.isfinite(x)
    for fmt in SMALL_INTS:
        got = np.asarray(_fast(jnp.asarray(x), fmt, False)).astype(np.int64)
        with np.errstate(invalid="ignore"):
            want = np.clip(np.rint(np.where(finite, x, np.sign(x) * 1e30)), fmt.min, fmt.max)
        want = np.where(np.isnan(x), 0, want).astype(np.int64) & ((1 << fmt.bits) - 1)
        np.testing.assert_array_equal(got, want, err_msg=fmt.name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", SMALL_INTS[:2], ids=lambda f: f.name)
def test_small_int_fast_encode_equals_general_path_on_every_float32(fmt):
    n = 1 << 24

    @jax.jit
    def mismatches(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        return jnp.sum(_fast(x, fmt, False) != _general(x, fmt, False))

    assert sum(int(mismatches(jnp.uint32(i * n))) for i in range(1 << 8)) == 0
