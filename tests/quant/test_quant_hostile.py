"""Hostile quantizer inputs: fake_quant refuses the blocks quantize refuses; NVFP4 of tiny values
stays finite."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest


def test_c1_fake_quant_refuses_the_blocks_quantize_refuses():
    from precisionlab import quant

    x = jnp.ones((64, 64))
    for block in (2**62, 2**30):
        for fn in (quant.quantize, quant.fake_quant):
            with pytest.raises(ValueError, match="pads the input"):
                fn(x, "int8", block_size=block)
    assert quant.fake_quant(x, "int8", block_size=100).shape == (64, 64)  # padding < 2x: fine


def test_w6_nvfp4_of_tiny_values_is_finite():
    from precisionlab import recipes

    b = jnp.ones((32, 16), jnp.float32)
    for value in (1e-38, 1e-36):
        y = np.asarray(recipes.matmul(jnp.full((16, 32), value, jnp.float32), b, recipe="nvfp4"))
        assert np.isfinite(y).all()  # was all NaN: s_enc = 2688 / amax overflowed
    y = np.asarray(recipes.matmul(jnp.full((16, 32), 1e-30, jnp.float32), b, recipe="nvfp4"))
    np.testing.assert_allclose(y, 32e-30, rtol=1e-6)  # a normal decode scale: exact
