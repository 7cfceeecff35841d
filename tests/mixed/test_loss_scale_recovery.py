"""The default dynamic loss scale recovers after overflow."""

from __future__ import annotations

import jax.numpy as jnp


def test_w8_the_default_dynamic_loss_scale_recovers():
    import jax

    from precisionlab.mixed._loss_scale import DynamicLossScale

    adjust = jax.jit(lambda s, ok: s.adjust(ok))
    for dtype, floor in ((jnp.float32, 2.0**-126), (jnp.float16, 2.0**-14)):
        init = 2.0**16 if dtype == jnp.float32 else 2.0**15
        s = DynamicLossScale(init, growth_interval=1, dtype=dtype)
        gs = DynamicLossScale(init, growth_interval=1, dtype=dtype, min_scale=None)
        for _ in range(300):
            s, gs = adjust(s, jnp.asarray(False)), adjust(gs, jnp.asarray(False))
        assert float(s.loss_scale) == floor and float(gs.loss_scale) == 0.0
        s, gs = adjust(s, jnp.asarray(True)), adjust(gs, jnp.asarray(True))
        assert float(s.loss_scale) == 2 * floor and float(gs.loss_scale) == 0.0  # GradScaler
