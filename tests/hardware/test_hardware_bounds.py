"""The GEMM models' inf/NaN outcome does not depend on the CPU's summation order; sizes and
overrides are bounded."""

from __future__ import annotations

import numpy as np
import pytest


def test_the_inf_nan_outcome_does_not_depend_on_the_cpus_summation_order():
    """Specials came from a float32 matmul on the CPU (its order): three bfloat16 products
    1.5 * 2^127 * (1, 1, -1) in one 16-product step sum exactly to a finite 1.5 * 2^127 on the
    tensor core (the scalar reference), but the CPU's left-to-right sum overflowed and the
    GEMM said inf. Across two steps the float32 accumulator does overflow (inf, the IEEE rule
    for an infinite accumulator). Infinite inputs decide by sign whatever their positions:
    +inf and -inf products give NaN, an infinity times zero NaN."""
    import jax.numpy as jnp

    from precisionlab import hardware as hw
    from precisionlab.hardware._reference import chain_reference

    big = 1.5 * 2.0**127
    one_step = np.zeros((1, 16), np.float32)
    one_step[0, :3] = [big, big, -big]
    a = jnp.asarray(one_step, jnp.bfloat16)
    b = jnp.ones((16, 1), jnp.bfloat16)
    step = hw.get_profile("h100", "16bit").step
    ref = chain_reference(one_step[0].tolist(), [1.0] * 16, 0.0, step, "bfloat16", "bfloat16")
    assert ref == big
    assert float(hw.gemm(a, b)[0, 0]) == big
    two_steps = np.zeros((1, 32), np.float32)
    two_steps[0, [0, 1, 16]] = [big, big, -big]  # the overflow happens in the first step
    assert (
        float(hw.gemm(jnp.asarray(two_steps, jnp.bfloat16), jnp.ones((32, 1), jnp.bfloat16))[0, 0])
        == np.inf
    )
    for where in ((0, 1), (0, 31), (30, 2)):
        x = np.zeros((1, 32), np.float32)
        x[0, list(where)] = [np.inf, -np.inf]
        out = hw.gemm(jnp.asarray(x, jnp.bfloat16), jnp.ones((32, 1), jnp.bfloat16))
        assert np.isnan(out[0, 0]), where
    x = np.zeros((1, 32), np.float32)
    x[0, 5] = np.inf
    y = np.ones((32, 2), np.float32)
    y[5, 1] = 0.0
    out = hw.gemm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16))
    assert out[0, 0] == np.inf and np.isnan(out[0, 1])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), products=2**30), "GiB"),
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), split_k=2**40,
                                 split_k_min_k=0), "GiB"),
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), restart_every=2**40),
         "GiB"),
        (lambda hw, jnp: hw.dot_general(jnp.ones((2, 3), jnp.float16), jnp.ones((3, 2),
                                        jnp.float16), (([5], [0]), ([], []))), "in 0..1"),
        (lambda hw, jnp: hw.dot_general(jnp.ones((2, 0), jnp.float16), jnp.ones((0, 2),
                                        jnp.float16), (([1], [0]), ([], []))), "K >= 1"),
        (lambda hw, jnp: hw.gemm(jnp.ones((2, 0), jnp.float16), jnp.ones((0, 2), jnp.float16)),
         "K >= 1"),
    ],
    ids=["products", "split_k", "restart_every", "axis", "dot-k0", "gemm-k0"],
)  # fmt: skip
def test_gemm_sizes_and_overrides_are_bounded(call, message):
    """Why: huge products/restart_every/split_k overrides ran out of memory or raised
    OverflowError inside XLA; dot_general raised IndexError / ZeroDivisionError for an
    out-of-range axis or K = 0."""
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    with pytest.raises(ValueError, match=message):
        call(hw, jnp)
