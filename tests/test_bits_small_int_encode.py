"""The float32 -> small-integer nearest-even fast path (clamp in float32, round by adding
1.5 * 2**23) against the general path (parse + round + pack), for the integer formats that
``test_bits_fast_paths`` does not sweep: uint4 and custom 16-, 12- and 3-bit integers. The
general path is checked against numpy by ``test_bits_exhaustive``. By default on every
float32 exponent around each rounding boundary; ``-m slow`` on all 2**32 inputs.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab.bits import codec
from precisionlab.bits.rounding import Rounding
from precisionlab.formats import IntFormat, get_format

FORMATS = [
    get_format("uint4"),
    IntFormat(name="int16", bits=16, signed=True),
    IntFormat(name="uint16", bits=16, signed=False),
    IntFormat(name="int12", bits=12, signed=True),
    IntFormat(name="uint3", bits=3, signed=False),
]


def _general(x: jax.Array, fmt, saturate: bool) -> jax.Array:
    p = codec._parse_floats(x, codec._work_dtype(codec._F32, fmt))
    return codec._pack(p, fmt, Rounding.NEAREST_EVEN, saturate, True, None, 32)


def _fast(x: jax.Array, fmt, saturate: bool) -> jax.Array:
    return codec._encode(
        x, None, fmt=fmt, mode=Rounding.NEAREST_EVEN, saturate=saturate, subnormals=True,
        random_bits=32,
    )  # fmt: skip


def _boundary_inputs() -> np.ndarray:
    """Every float32 exponent field and sign, with mantissas 0, 1, max and around every
    drop position d: 2**d - 1, 2**d, 2**d + 1 and the halfway points (ties) +- 1."""
    mants = {0, 1, 0x7FFFFF}
    for d in range(1, 24):
        for base in (1 << d, 1 << (d - 1), 3 << (d - 1)):
            mants |= {(base + k) & 0x7FFFFF for k in (-1, 0, 1)}
    m = np.array(sorted(mants), dtype=np.uint32)
    e = np.arange(256, dtype=np.uint32) << np.uint32(23)
    bits = (e[:, None] | m[None, :]).ravel()
    return np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)


def _extra_inputs() -> np.ndarray:
    """Values at and around every format's limits and the halves between integers there."""
    edges = np.array([0, 1, 2, 3, 4, 7, 8, 15, 16, 2047, 2048, 32767, 32768, 65535, 65536])
    near = np.concatenate([edges + d for d in (-1.0, -0.5, -0.25, 0.0, 0.25, 0.5, 1.0)])
    v = np.concatenate([near, -near, [np.inf, -np.inf, np.nan, -np.nan, 2.0**22, 2.0**23]])
    return v.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
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
    for fmt in FORMATS:
        got = np.asarray(_fast(jnp.asarray(x), fmt, False)).astype(np.int64)
        with np.errstate(invalid="ignore"):
            want = np.clip(np.rint(np.where(finite, x, np.sign(x) * 1e30)), fmt.min, fmt.max)
        want = np.where(np.isnan(x), 0, want).astype(np.int64) & ((1 << fmt.bits) - 1)
        np.testing.assert_array_equal(got, want, err_msg=fmt.name)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f.name)
def test_small_int_fast_encode_equals_general_path_on_every_float32(fmt):
    n = 1 << 24

    @jax.jit
    def mismatches(start):
        x = jax.lax.bitcast_convert_type(start + jnp.arange(n, dtype=jnp.uint32), jnp.float32)
        return jnp.sum(_fast(x, fmt, False) != _general(x, fmt, False))

    assert sum(int(mismatches(jnp.uint32(i * n))) for i in range(1 << 8)) == 0
