"""quantize / dequantize: tensors to codes plus scales (QArray) and back."""

from __future__ import annotations

from functools import partial
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from precisionlab.bits import decode, encode
from precisionlab.formats import FORMATS
from precisionlab.quant import _core as core
from precisionlab.quant import _pow2 as pow2
from precisionlab.quant._mx import MXFormat
from precisionlab.quant._pack import pack, unpack
from precisionlab.quant._qarray import QArray
from precisionlab.quant._spec import QuantOptions, QuantSpec, check_input, prepare
from precisionlab.quant.fp4 import FP4_QUANTIZERS

__all__ = ["dequantize", "quantize"]

_E8M0 = FORMATS["float8_e8m0fnu"]


def _stored_scales(sc: core.Scale, spec: QuantSpec) -> jax.Array:
    stored: jax.Array | None
    if spec.pow2:
        assert sc.e is not None  # power-of-two scales are exponents
        value = pow2.pow2(sc.e)
        if sc.bad is not None:
            value = jnp.where(sc.bad, jnp.float32(jnp.nan), value)
        stored = encode(value, _E8M0) if spec.scale_format == "e8m0" else value
    elif sc.s_codes is not None:
        stored = sc.s_codes
    else:
        stored = sc.s
    assert stored is not None
    full = jnp.broadcast_to(stored, _group_shape(sc))
    return core.store_groups(full, spec)


def _group_shape(sc: core.Scale) -> tuple[int, ...]:
    ref = sc.e if sc.e is not None else sc.s
    assert ref is not None
    return ref.shape


@partial(jax.jit, static_argnames=("spec", "packed"))
def _quantize(
    x: jax.Array, key: jax.Array | None, *, spec: QuantSpec, packed: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    xg, sc = core.choose_scale(x, spec)
    y = core.apply_scale(xg, sc, spec)
    codes = core.from_groups(core.round_elements(y, sc, spec, key, codes=True), spec, x.shape)
    if packed:
        codes = pack(codes.reshape(-1))
    zp = None
    if sc.zp is not None:
        zp = core.store_groups(jnp.broadcast_to(encode(sc.zp, spec.fmt), sc.zp.shape), spec)
    return codes, _stored_scales(sc, spec), zp


def quantize(
    x: jax.Array,
    fmt: Any,
    *,
    key: jax.Array | None = None,
    pack_codes: bool | None = None,
    **options: Unpack[QuantOptions],
) -> QArray:
    """Quantize ``x`` to codes of ``fmt`` with per-tensor, per-channel or per-block scales.

    Args:
      x: float32/float16/bfloat16 array (computed in float32).
      fmt: an int or float format of :mod:`precisionlab.formats` (``"int8"``, ``"int4"``,
        ``"uint8"``, ``"e4m3fn"``, ``"fp4"``, ...) or an MX format (``"mxfp8_e4m3"``,
        ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4"``, ``"mxint8"``).
      key: PRNG key for ``rounding="stochastic"``.
      pack_codes: pack 4-bit codes two per byte (default: True for 4-bit formats).
      **options: the keywords of :class:`QuantOptions`: ``axis`` and ``block_size``
        (per-tensor by default, per-channel along ``axis``, or per-block), ``scheme``,
        ``scale``, ``scale_format``, ``scale_rule``, ``rounding``, ``full_range``.

    Returns:
      A :class:`QArray`.

    Example:
      int8, symmetric, one scale per tensor: amax / 127 (here 1/64, so every step is exact).

      >>> import jax.numpy as jnp
      >>> from precisionlab import dequantize, quantize
      >>> q = quantize(jnp.array([1.984375, -1.0, 0.3, 0.01]), "int8")
      >>> float(q.scales)
      0.015625
      >>> q.codes.tolist()  # round(x / scale) as two's-complement bytes: 192 is -64
      [127, 192, 19, 1]
      >>> dequantize(q).tolist()
      [1.984375, -1.0, 0.296875, 0.015625]
    """
    x = check_input(x)
    if isinstance(fmt, str) and fmt.strip().lower() in FP4_QUANTIZERS:
        raise ValueError(
            f"{fmt!r} is a 4-bit recipe quantizer (two scale levels, rotations): use "
            f"fake_quant(x, {fmt!r}, ...) for its values; quantize stores one level of scales"
        )
    spec = prepare(x, fmt, key, options)
    packed = spec.fmt.bits == 4 if pack_codes is None else bool(pack_codes)
    if packed and spec.fmt.bits != 4:
        raise ValueError(f"pack_codes=True packs 4-bit formats only, not {spec.fmt.name}")
    codes, scales, zp = _quantize(x, key, spec=spec, packed=packed)
    return QArray(
        codes=codes, scales=scales, zero_points=zp, fmt=spec.format_obj, shape=tuple(x.shape),
        granularity=spec.granularity, axis=spec.axis, block_size=spec.block_size,
        scheme=spec.scheme, scale_method=spec.scale_method, scale_format=spec.scale_format,
        scale_rule=spec.scale_rule, rounding=spec.rounding, packed=packed, dtype=str(x.dtype),
    )  # fmt: skip


def spec_of(q: QArray) -> QuantSpec:
    """The static spec a QArray was made with (enough to dequantize it)."""
    mx = q.fmt if isinstance(q.fmt, MXFormat) else None
    method, p = q.scale_method, None
    if method.startswith("percentile:"):
        method, p = "percentile", float(q.scale_method.split(":", 1)[1])
    return QuantSpec(
        fmt=q.element_format, mx=mx, ndim=len(q.shape), granularity=q.granularity,
        axis=q.axis, block_size=q.block_size, scheme=q.scheme, scale=method, percentile=p,
        scale_format=q.scale_format, scale_rule=q.scale_rule, rounding=q.rounding,
        full_range=False,
    )  # fmt: skip


def loaded_scale(q: QArray, spec: QuantSpec) -> core.Scale:
    """The QArray's scales as a :class:`core.Scale` on the grouped view."""
    stored = core.load_groups(q.scales, spec)
    zp = None
    if q.zero_points is not None:
        zp = decode(core.load_groups(q.zero_points, spec), spec.fmt)
    if spec.pow2:
        value = decode(stored, _E8M0) if spec.scale_format == "e8m0" else stored
        bad = jnp.isnan(value)
        e = jnp.where(bad, 0, pow2.floor_log2(value)).astype(jnp.int32)
        return core.Scale(None, e, bad, zp, None)
    if spec.scale_format in core.SCALE16:
        return core.Scale(decode(stored, core.SCALE16[spec.scale_format]), None, None, zp, None)
    return core.Scale(stored.astype(jnp.float32), None, None, zp, None)


@partial(jax.jit, static_argnames=("dtype",))
def _dequantize(q: QArray, dtype: np.dtype) -> jax.Array:
    spec = spec_of(q)
    codes = q.codes
    if q.packed:
        codes = unpack(codes, q.size).reshape(q.shape)
    values = decode(codes, spec.fmt)
    vg, _ = core.to_groups(values, spec)
    sc = loaded_scale(q, spec)
    if sc.zp is not None:
        vg = vg - sc.zp
    out = core.from_groups(core.unapply_scale(vg, sc, spec), spec, q.shape)
    return out.astype(dtype)


def dequantize(q: QArray, dtype: npt.DTypeLike = jnp.float32) -> jax.Array:
    """Values of a :class:`QArray` as ``dtype`` (float32 by default), shape ``q.shape``.

    Example:
      int4 keeps [-7, 7]; the scale is amax / 7 = 0.5, so 1.2 and 0.3 round to 2 and 1 steps.

      >>> import jax.numpy as jnp
      >>> from precisionlab import dequantize, quantize
      >>> dequantize(quantize(jnp.array([3.5, -1.0, 1.2, 0.3]), "int4")).tolist()
      [3.5, -1.0, 1.0, 0.5]
    """
    if not isinstance(q, QArray):
        raise TypeError(f"dequantize takes a QArray, got {type(q).__name__}")
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dequantize produces a float dtype, got {dtype}")
    return _dequantize(q, dtype)


def element_scales(q: QArray) -> jax.Array:
    """float32 array of ``q.shape``: the scale each element was quantized with (including
    MXINT8's 2**-6), i.e. the size of one element-format unit in the input's units."""
    spec = spec_of(q)
    sc = loaded_scale(q, spec)
    ones, _ = core.to_groups(jnp.ones(q.shape, jnp.float32), spec)
    return core.from_groups(core.unapply_scale(ones, sc, spec), spec, q.shape)
