"""quantize / dequantize: tensors to codes plus scales (QArray) and back."""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from precisionlab.bits import decode, encode
from precisionlab.formats import FORMATS
from precisionlab.quant import core, pow2
from precisionlab.quant.fp4 import FP4_QUANTIZERS
from precisionlab.quant.mx import MXFormat
from precisionlab.quant.pack import pack, unpack
from precisionlab.quant.qarray import QArray
from precisionlab.quant.spec import QuantSpec, resolve

__all__ = ["dequantize", "quantize"]

_E8M0 = FORMATS["float8_e8m0fnu"]
_FLOAT_INPUTS = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)


def check_input(x) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in [jnp.dtype(d) for d in _FLOAT_INPUTS]:
        raise TypeError(
            f"quantization takes float32, float16, bfloat16 or float64 arrays, got {x.dtype}"
        )
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    return x


def _stored_scales(sc: core.Scale, spec: QuantSpec) -> jax.Array:
    if spec.pow2:
        value = pow2.pow2(sc.e)
        if sc.bad is not None:
            value = jnp.where(sc.bad, jnp.float32(jnp.nan), value)
        stored = encode(value, _E8M0) if spec.scale_format == "e8m0" else value
    elif sc.s_codes is not None:
        stored = sc.s_codes
    else:
        stored = sc.s
    full = jnp.broadcast_to(stored, _group_shape(sc))
    return core.store_groups(full, spec)


def _group_shape(sc: core.Scale) -> tuple[int, ...]:
    ref = sc.e if sc.e is not None else sc.s
    return ref.shape


@partial(jax.jit, static_argnames=("spec", "packed"))
def _quantize(x, key, *, spec: QuantSpec, packed: bool):
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
    fmt,
    *,
    axis: int | None = None,
    block_size: int | None = None,
    scheme: str | None = None,
    scale: str | None = None,
    scale_format: str | None = None,
    scale_rule: str | None = None,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
    full_range: bool = False,
    pack_codes: bool | None = None,
) -> QArray:
    """Quantize ``x`` to codes of ``fmt`` with per-tensor, per-channel or per-block scales.

    Args:
      x: float32/float16/bfloat16 array (computed in float32).
      fmt: an int or float format of :mod:`precisionlab.formats` (``"int8"``, ``"int4"``,
        ``"uint8"``, ``"e4m3fn"``, ``"fp4"``, ...) or an MX format (``"mxfp8_e4m3"``,
        ``"mxfp8_e5m2"``, ``"mxfp6_e2m3"``, ``"mxfp6_e3m2"``, ``"mxfp4"``, ``"mxint8"``).
      axis: per-channel: one scale per index along ``axis``. With ``block_size``: the axis
        the blocks run along (default: the last).
      block_size: blocks of this many consecutive elements share a scale (a ragged last
        block is allowed). MX formats always use 32.
      scheme: ``"symmetric"`` (zero point 0; default for signed ints and floats; signed ints
        use [-(2**(b-1)-1), 2**(b-1)-1] unless ``full_range``) or ``"asymmetric"`` (integer
        zero point from min/max; default for unsigned ints).
      scale: ``"amax"``, ``"percentile:<p>"`` (clip at the p-th percentile of |x|), ``"mse"``
        (least squared error over 64 clipping ratios 1.0..0.01), ``"none"`` (scale 1: a plain
        cast), or None: amax, except none for float formats of 16 bits or more.
      scale_format: ``"float32"`` (default), ``"float16"``/``"bfloat16"`` (rounded up),
        ``"pow2"`` (float32 powers of two) or ``"e8m0"`` (uint8 E8M0 codes; MX always).
      scale_rule: for power-of-two scales, one of :data:`SCALE_RULES`: ``"floor"`` (OCP MX
        rule; the default for MX formats), ``"ceil"`` (torchao CEIL), ``"rceil"`` (TE /
        cuBLAS: ``2**ceil(log2(amax / max))``, never saturates; the default otherwise) or
        ``"even"`` (torchao EVEN).
      rounding: a mode of :data:`precisionlab.bits.ROUNDING_MODES`.
      key: PRNG key for ``rounding="stochastic"``.
      full_range: symmetric signed ints may also use code -2**(b-1).
      pack_codes: pack 4-bit codes two per byte (default: True for 4-bit formats).

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
    if isinstance(fmt, str) and fmt.strip().lower() in _fp4_names():
        raise ValueError(
            f"{fmt!r} is a 4-bit recipe quantizer (two scale levels, rotations): use "
            f"fake_quant(x, {fmt!r}, ...) for its values; quantize stores one level of scales"
        )
    spec = resolve(
        x.ndim, fmt, axis=axis, block_size=block_size, scheme=scheme, scale=scale,
        scale_format=scale_format, scale_rule=scale_rule, rounding=rounding,
        full_range=full_range,
    )  # fmt: skip
    _check_key(spec, key)
    _check_padding(x.shape, spec)
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


def _fp4_names():
    return FP4_QUANTIZERS


# Blocks pad their axis to whole blocks; a block far longer than its axis (block_size 100000
# on a width-1 axis) would allocate block_size times the input. Refused past this bound.
MAX_PADDED_ELEMENTS = 2**26


def _check_padding(shape: tuple[int, ...], spec: QuantSpec) -> None:
    if spec.granularity != "block":
        return
    n = shape[spec.axis]
    size = math.prod(shape)
    padded = size // n * (-(-n // spec.block_size) * spec.block_size)
    if padded > 2 * size and padded > MAX_PADDED_ELEMENTS:
        raise ValueError(
            f"block_size {spec.block_size} along axis {spec.axis} (length {n}) pads the input "
            f"from {size:,} to {padded:,} elements (limit 2^26 when padding more than doubles "
            f"it); use a block_size of at most {n}"
        )


def _check_key(spec: QuantSpec, key) -> None:
    if spec.rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(0)")
    if spec.rounding != "stochastic" and key is not None:
        raise ValueError(f"key is only used by rounding='stochastic', not {spec.rounding!r}")


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
    if spec.scale_format in core._SCALE16:
        return core.Scale(decode(stored, core._SCALE16[spec.scale_format]), None, None, zp, None)
    return core.Scale(stored.astype(jnp.float32), None, None, zp, None)


@partial(jax.jit, static_argnames=("dtype",))
def _dequantize(q: QArray, dtype):
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


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
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
