"""fake_quant: quantize then dequantize in one jittable op, with a straight-through gradient."""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any, Unpack

import jax
import jax.numpy as jnp

from precisionlab.quant import _core as core
from precisionlab.quant import fp4
from precisionlab.quant._spec import (
    OPTION_NAMES,
    QuantOptions,
    QuantSpec,
    check_input,
    check_option_names,
    prepare,
)

__all__ = ["STE_MODES", "fake_quant"]

#: "clipped": gradient 1 where the value was representable (including the element at amax),
#: 0 where it was clipped to the format's range. "identity": gradient 1 everywhere.
STE_MODES = ("clipped", "identity")


def _forward(
    x: jax.Array, key: Any, spec: QuantSpec, with_mask: bool
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """x_hat (x's dtype) and, ``with_mask``, the bool mask of elements inside the
    representable range (computed in the same pass, only where a gradient is taken)."""
    xg, sc = core.choose_scale(jax.lax.stop_gradient(x), spec)
    if not with_mask:
        values = core.fake_values(xg, sc, spec, key)
        return core.from_groups(values, spec, x.shape).astype(x.dtype)
    values, inside = core.fake_values(xg, sc, spec, key, with_mask=True)
    x_hat = core.from_groups(values, spec, x.shape)
    return x_hat.astype(x.dtype), core.from_groups(inside, spec, x.shape)


@lru_cache(maxsize=256)
def _make(spec: QuantSpec, ste: str) -> Callable[[jax.Array, Any], jax.Array]:
    @jax.custom_vjp
    def fq(x: jax.Array, key: Any) -> Any:
        return _forward(x, key, spec, with_mask=False)

    def fwd(x: jax.Array, key: Any) -> Any:
        return _forward(x, key, spec, with_mask=True)

    def bwd(mask: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
        if ste == "identity":
            return g, None
        return jnp.where(mask, g, jnp.zeros_like(g)), None

    fq.defvjp(fwd, bwd)
    return jax.jit(fq)


def fake_quant(
    x: jax.Array,
    fmt: Any,
    *,
    key: jax.Array | None = None,
    ste: str = "clipped",
    **options: Unpack[QuantOptions],
) -> jax.Array:
    """``dequantize(quantize(x, fmt, ...))`` in one op, same shape and dtype as ``x``.

    Takes the arguments of :func:`~precisionlab.quant.quantize` (``key`` and the
    :class:`~precisionlab.quant.QuantOptions`) but ``pack_codes``. The gradient is the
    straight-through estimator: ``ste="clipped"`` passes the incoming gradient where the
    scaled value rounds inside the element range (so the element at amax gets 1, unlike
    ``jnp.clip``'s 0.5 at its bound) and 0 where it was clipped; ``ste="identity"`` passes
    it everywhere. Scales are computed from ``x`` but carry no gradient.

    ``fmt`` may also name a 4-bit training recipe's quantizer (:data:`FP4_QUANTIZERS`:
    ``"nvfp4"``, ``"nvfp4_2d"``, ``"nvfp4_4over6"``, ``"nvfp4_double"``,
    ``"mxfp4_prescaled"``, ``"quest"``, ``"ms_eden"``; see :mod:`precisionlab.quant.fp4`),
    blocked along ``axis`` (default the last), with ``rounding`` ``"nearest_even"`` or
    ``"stochastic"`` and ``key``; it takes no other option.

    Example:
      The values :func:`~precisionlab.quant.quantize` then ``dequantize`` give (int8, scale
      amax / 127 = 1/64), with their gradient:

      >>> import jax, jax.numpy as jnp
      >>> from precisionlab import fake_quant
      >>> x = jnp.array([1.984375, -1.0, 0.3, 0.01])
      >>> fake_quant(x, "int8").tolist()
      [1.984375, -1.0, 0.296875, 0.015625]
      >>> jax.grad(lambda v: fake_quant(v, "int8").sum())(x).tolist()
      [1.0, 1.0, 1.0, 1.0]
    """
    if isinstance(fmt, str) and fmt.strip().lower() in fp4.FP4_QUANTIZERS:
        check_option_names(dict(options))
        extra = [
            name
            for name in OPTION_NAMES
            if name not in ("axis", "rounding", "full_range") and options.get(name) is not None
        ] + (["full_range"] * bool(options.get("full_range", False)))
        if extra or ste != "clipped":
            raise ValueError(
                f"{fmt!r} is a 4-bit recipe quantizer: it takes axis, rounding and key only, "
                f"not {', '.join(extra) or 'ste'}"
            )
        x = check_input(x)
        return fp4.fake_quant_named(
            x,
            fmt.strip().lower(),
            axis=options.get("axis"),
            rounding=options.get("rounding", "nearest_even"),
            key=key,
        )
    x = check_input(x)
    if ste not in STE_MODES:
        raise ValueError(f"unknown ste {ste!r}; allowed: {', '.join(STE_MODES)}")
    spec = prepare(x, fmt, key, options)  # as quantize: block_size 2**62 crashed XLA
    return _make(spec, ste)(x, key)
