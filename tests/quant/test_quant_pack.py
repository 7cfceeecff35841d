"""pack / unpack: two 4-bit codes per byte, exact round trip, odd lengths."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from precisionlab.bits import decode
from precisionlab.quant import dequantize, pack, quantize, unpack


@pytest.mark.parametrize("n", [1, 2, 3, 15, 16, 17, 33])
def test_round_trip_every_value_odd_and_even_lengths(n):
    codes = (np.arange(n * 3) % 16).astype(np.uint8).reshape(3, n)
    packed = pack(jnp.asarray(codes))
    assert packed.dtype == jnp.uint8 and packed.shape == (3, (n + 1) // 2)
    np.testing.assert_array_equal(unpack(packed, n), codes)


def test_every_int4_value_survives_quantize_pack_dequantize():
    values = np.arange(-8, 8, dtype=np.float32)  # all 16 int4 values
    q = quantize(jnp.asarray(values), "int4", scale="none", full_range=True)
    assert q.packed and q.codes.shape == (8,)
    np.testing.assert_array_equal(dequantize(q), values)
    # the packed codes decode, through the codec, to the int4 values
    np.testing.assert_array_equal(decode(unpack(q.codes, 16), "int4"), values)
    # same two's-complement nibbles as ml_dtypes' int4
    nibbles = values.astype(ml_dtypes.int4).view(np.uint8) & 0xF
    np.testing.assert_array_equal(unpack(q.codes, 16), nibbles)


def test_nibble_order_low_first():
    assert int(pack(jnp.asarray([1, 2], jnp.uint8))[0]) == 0x21
    assert int(pack(jnp.asarray([0xF], jnp.uint8))[0]) == 0x0F


def test_uint4_and_fp4_pack_and_jit():
    x = jnp.asarray(np.random.default_rng(0).uniform(0, 1, (5, 7)).astype(np.float32))
    q = jax.jit(lambda x: quantize(x, "uint4"))(x)
    assert q.packed and q.codes.shape == (18,)
    q2 = quantize(x, "uint4", pack_codes=False)
    np.testing.assert_array_equal(dequantize(q), dequantize(q2))
    q3 = quantize(x, "fp4")
    assert q3.packed and q3.nbytes == 18 + 4


def test_pack_errors():
    with pytest.raises(TypeError, match="integer"):
        pack(jnp.ones(4, jnp.float32))
    with pytest.raises(ValueError, match="ceil"):
        unpack(jnp.zeros(3, jnp.uint8), 9)
