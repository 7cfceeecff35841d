"""Target formats and recipes a tensor is evaluated against ("what if this were e4m3 with
current scaling?").

A target names an element format and a scaling:

- ``"fp16"``, ``"bf16"``, ``"e4m3"``, ``"e5m2"``, ... (any float format of
  :func:`precisionlab.formats.get_format`): a plain cast, scale 1;
- ``"FMT:tensor"``: one scale per tensor, ``fmt_max / max(amax, 1e-12)`` (current scaling:
  TE ``Float8CurrentScaling``, torchao ``tensorwise``; the ``current`` recipe);
- ``"FMT:row"``: one power-of-two scale per row along the last axis (torchao ``rowwise``);
- ``"FMT:block"`` / ``"FMT:blockN"``: 1 x N tiles (default 128) along the last axis,
  power-of-two scales (DeepSeek-V3, the ``blockwise`` recipe's activation tiles);
- ``"mxfp8"``, ``"mxfp6"``, ``"mxfp4"``: the recipes' MX presets (32-element blocks along the
  last axis, E8M0 scales, the preset's scale rule);
- aliases ``"current"`` (``e4m3:tensor``), ``"rowwise"`` (``e4m3:row``), ``"blockwise"``
  (``e4m3:block``).

The quantized copy follows the recipes' scale rules (:mod:`precisionlab.recipes`), with the
element cast done by :func:`round_to_format` (a few float or bit operations per element, bit
for bit the recipes' integer encode and decode, which :func:`quantize_target_exact` uses and
the tests compare with), so it is exactly what the recipe's GEMM would multiply.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.formats import FloatFormat, Specials, get_format
from precisionlab.quant import _pow2 as pow2
from precisionlab.quant._pow2 import scale_exponent
from precisionlab.recipes import MX, get_recipe
from precisionlab.recipes import _scaling as S

__all__ = ["SCALINGS", "Target", "parse_targets"]

#: How a telemetry target scales a tensor before the what-if cast.
SCALINGS = ("none", "tensor", "row", "block", "mx")
_ALIASES = {"current": "e4m3:tensor", "rowwise": "e4m3:row", "blockwise": "e4m3:block"}
_MX_NAMES = ("mxfp8", "mxfp6", "mxfp4")
_SPEC = re.compile(r"^([^:]+?)(?::(tensor|row|block)(\d+)?)?$")
EPS = 1e-12  # torchao's and TE's epsilon of the amax in current and row-wise scaling


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One target: ``fmt`` (element format), ``scaling`` (one of :data:`SCALINGS`),
    ``block`` (block scalings), ``rule`` (MX scale rule), ``name`` (as written)."""

    name: str
    fmt: FloatFormat
    scaling: str = "none"
    block: int = 0
    rule: str = ""

    @property
    def overflow_threshold(self) -> tuple[float, bool]:
        """(T, tie_overflows): a scaled magnitude above T (or equal to it, when the tie
        rounds away from max) rounds past the format's max with round-to-nearest-even."""
        f = self.fmt
        ulp = 2.0 ** (f.emax - f.mantissa_bits)
        sig = round(f.max / ulp)  # the max's significand as an integer
        return f.max + ulp / 2, bool(sig % 2)


def _parse_one(spec: Any) -> Target:
    if isinstance(spec, Target):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a telemetry target is a string such as 'e4m3:tensor', got {spec!r}")
    key = spec.strip().lower()
    if key in _MX_NAMES:
        r = get_recipe(key)
        assert isinstance(r, MX)
        return Target(name=key, fmt=r.fmt("x"), scaling="mx", block=r.block, rule=r.scale_rule)
    m = _SPEC.match(_ALIASES.get(key, key))
    allowed = (
        "a float format (fp16, bf16, e4m3, ...), FMT:tensor, FMT:row, FMT:block[N], "
        f"{', '.join(_MX_NAMES)}, or {', '.join(_ALIASES)}"
    )
    if m is None:
        raise ValueError(f"unknown telemetry target {spec!r}; allowed: {allowed}")
    fname, scaling, block = m.groups()
    try:
        fmt = get_format(fname)
    except ValueError as err:
        raise ValueError(f"telemetry target {spec!r}: {err}") from None
    if not isinstance(fmt, FloatFormat) or fmt.bits > 32 or not fmt.signed:
        raise ValueError(
            f"telemetry target {spec!r}: the element format must be a signed float of at most "
            f"32 bits; allowed: {allowed}"
        )
    if block is not None and scaling != "block":
        raise ValueError(f"telemetry target {spec!r}: only FMT:block takes a size")
    size = int(block) if block is not None else (128 if scaling == "block" else 0)
    if scaling == "block" and size < 1:
        raise ValueError(f"telemetry target {spec!r}: the block size must be >= 1")
    return Target(name=spec.strip(), fmt=fmt, scaling=scaling or "none", block=size)


def parse_targets(targets: Any) -> tuple[Target, ...]:
    """A tuple of :class:`Target` from names (a single string is one target)."""
    if isinstance(targets, (str, Target)):
        targets = (targets,)
    out = tuple(_parse_one(t) for t in targets)
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise ValueError(f"telemetry targets repeat a name: {names}")
    return out


class Quantized(NamedTuple):
    """A target's view of a float32 (R, K) tensor: ``scaled`` (x times its scale, the values
    the element cast rounds; :func:`quantize_target` may flush float32 subnormals there, as
    the recipes' power-of-two scaling does: they never overflow), ``elems`` (the
    element-format values, saturated) and ``values`` (the dequantized copy the GEMM would
    multiply), all float32 (R, K)."""

    scaled: jax.Array
    elems: jax.Array
    values: jax.Array


def _pad(x: jax.Array, mult: int) -> jax.Array:
    pad = -x.shape[-1] % mult
    return jnp.pad(x, ((0, 0), (0, pad))) if pad else x


def quantize_target(x2: jax.Array, t: Target) -> Quantized:
    """Quantize a float32 (R, K) tensor as ``t`` says (along K): the recipes' scale rules
    with :func:`round_to_format` for the element cast (bit for bit
    :func:`quantize_target_exact`, which casts with the recipes' own quantizers)."""
    r, k = x2.shape
    if t.scaling == "none":
        q = round_to_format(x2, t.fmt)
        return Quantized(x2, q, q)
    if _fast_mode(t.fmt) == "exact":
        return quantize_target_exact(x2, t)
    x3 = _pad(x2, t.block if t.scaling in ("block", "mx") else 1)[None]
    nan = jnp.float32(jnp.nan)
    if t.scaling == "tensor":
        s, _ = S.scale_from_amax(S.amax(x3, None), t.fmt.max, eps=EPS, pow2_scales=False)
        scaled = jnp.where(jnp.isnan(s), nan, x3 * s)
        q = round_to_format(scaled, t.fmt)
        values = q * (jnp.float32(1.0) / s)
    elif t.scaling == "row":
        s, e = S.scale_from_amax(S.amax(x3, -1), t.fmt.max, eps=EPS, pow2_scales=True)
        scaled = jnp.where(jnp.isnan(s), nan, S.mul_pow2(x3, e))
        q = round_to_format(scaled, t.fmt)
        values = q * jnp.where(jnp.isnan(s), s, pow2.pow2(-e))
    elif t.scaling == "block":
        s, e = S.scale_from_amax(
            S.block_amax(x3, t.block, False), t.fmt.max, eps=0.0, pow2_scales=True
        )
        scaled = jnp.where(jnp.isnan(s), nan, S.mul_pow2(x3, e))
        q = round_to_format(scaled, t.fmt)
        values = jnp.where(jnp.isnan(s), nan, S.mul_pow2(q, -e))
    else:
        g = S.blocks_1d(x3, t.block)
        a = S.amax(g, -1)
        e = scale_exponent(a, float(t.fmt.max), t.fmt.emax, t.rule, t.fmt.mantissa_bits)
        bad = ~S.is_finite(a)
        e = jnp.where(bad, 0, e)
        y = jnp.where(bad, nan, S.mul_pow2(g, -e))
        q = round_to_format(y, t.fmt).reshape(x3.shape)
        eb = jnp.broadcast_to(e, g.shape).reshape(x3.shape)
        badb = jnp.broadcast_to(bad, g.shape).reshape(x3.shape)
        values = jnp.where(badb, nan, S.mul_pow2(q, eb))
        scaled = jnp.where(badb, nan, pow2.ldexp(x3, -eb))
    out = (scaled, q, values)
    return Quantized(*(jnp.broadcast_to(v, x3.shape)[0, :r, :k] for v in out))


def quantize_target_exact(x2: jax.Array, t: Target) -> Quantized:
    """Quantize a float32 (R, K) tensor as ``t`` says (along K) with the recipes' own
    quantizers (integer encode and decode): the reference of :func:`quantize_target`."""
    r, k = x2.shape
    if t.scaling == "none":
        q = S.round_elements(x2, t.fmt)
        return Quantized(x2, q, q)
    x3 = _pad(x2, t.block if t.scaling in ("block", "mx") else 1)[None]
    if t.scaling == "tensor":
        qo, s = S.tensorwise(x3, t.fmt, eps=EPS, pow2_scales=False)
        scaled = jnp.where(jnp.isnan(s), jnp.float32(jnp.nan), x3 * s)
    elif t.scaling == "row":
        qo, s = S.per_row(x3, t.fmt, eps=EPS)
        scaled = _times_pow2(x3, s)
    elif t.scaling == "block":
        qo, s = S.block_pow2(x3, t.fmt, t.block, two_d=False)
        scaled = _times_pow2(x3, s)
    else:
        qo, xs = S.mx_blocks(x3, t.fmt, t.block, t.rule)
        e = jnp.where(jnp.isnan(xs), 0, pow2.floor_log2(xs))
        scaled = jnp.where(jnp.isnan(xs), jnp.float32(jnp.nan), pow2.ldexp(x3, -e))
    out = (scaled, qo.elems, qo.dequantize())
    return Quantized(*(jnp.broadcast_to(v, x3.shape)[0, :r, :k] for v in out))


def _times_pow2(x3: jax.Array, s: jax.Array) -> jax.Array:
    """x * s for a power-of-two (or NaN) scale, exact on the bits as the recipes do."""
    bad = jnp.isnan(s)
    e = jnp.where(bad, 0, pow2.floor_log2(jnp.where(bad, 1.0, s)))
    y = pow2.ldexp(x3, jnp.broadcast_to(e, x3.shape))
    return jnp.where(jnp.broadcast_to(bad, x3.shape), jnp.float32(jnp.nan), y)


def magnitude_bits(x: jax.Array) -> jax.Array:
    """uint32 bits of |x| (float32): ordered like the magnitudes, subnormals exact."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & jnp.uint32(0x7FFFFFFF)


# --- fast round to a format ---------------------------------------------------------------
def _fast_mode(fmt: FloatFormat) -> str:
    """How :func:`round_to_format` rounds to ``fmt``: ``"bits"`` (float32's exponent range:
    round the float32 bit pattern's fraction), ``"float"`` (float arithmetic on an exact
    power-of-two grid), or ``"exact"`` (the recipes' integer encode and decode)."""
    m, lo, hi = fmt.mantissa_bits, fmt.emin, fmt.emax
    if not fmt.subnormals or m > 23 or fmt.max > float(np.finfo(np.float32).max):
        return "exact"
    if lo == -126 and hi == 127:
        return "bits"
    # every power of two of the grid (2**(e - m), 2**(m - e) for emin <= e <= emax + 1) is a
    # normal float32, and a float32 subnormal (flushed to zero on CPU) rounds to zero anyway
    if lo - m >= -125 and m - lo <= 127 and hi + 1 - m <= 127 and m - hi - 1 >= -126:
        return "float"
    return "exact"


def _pow2_const(e: jax.Array) -> jax.Array:
    """float32 2**e for int32 e in the normal range, built from the exponent field."""
    return lax.bitcast_convert_type(((e + 127).astype(jnp.uint32)) << 23, jnp.float32)


def round_to_format(y: jax.Array, fmt: FloatFormat) -> jax.Array:
    """float32 ``y`` rounded to ``fmt`` (nearest even), saturated to +-max, NaN kept: the
    values of :func:`precisionlab.recipes._scaling.round_elements` (the same bits, up to the
    sign of zero), in a few float or integer operations per element instead of an encode
    and a decode. Formats outside float32's range or without subnormals use the encoder."""
    y = jnp.asarray(y, jnp.float32)
    mode = _fast_mode(fmt)
    if mode == "exact":
        return S.round_elements(y, fmt)
    b = lax.bitcast_convert_type(y, jnp.uint32)
    mag = b & jnp.uint32(0x7FFFFFFF)
    max_bits = jnp.uint32(np.float32(fmt.max).view(np.uint32))
    if mode == "bits":
        shift = 23 - fmt.mantissa_bits
        if shift:
            half = jnp.uint32((1 << (shift - 1)) - 1)
            lsb = (mag >> shift) & jnp.uint32(1)
            r = (mag + half + lsb) & jnp.uint32(~((1 << shift) - 1) & 0xFFFFFFFF)
        else:
            r = mag
        nan = mag > jnp.uint32(0x7F800000)
        r = jnp.where(nan, 0 if fmt.specials is Specials.NONE else mag, jnp.minimum(r, max_bits))
        return lax.bitcast_convert_type(r | (b & jnp.uint32(0x80000000)), jnp.float32)
    m = fmt.mantissa_bits
    a = lax.bitcast_convert_type(mag, jnp.float32)
    e = ((mag >> 23).astype(jnp.int32)) - 127  # floor(log2 a) for normal a
    e = jnp.clip(e, fmt.emin, fmt.emax + 1)
    q = jnp.round(a * _pow2_const(m - e)) * _pow2_const(e - m)
    q = jnp.minimum(q, jnp.float32(fmt.max))  # NaN stays NaN (jnp.minimum propagates it)
    if fmt.specials is Specials.NONE:  # no NaN code: the encoder writes NaN as zero
        q = jnp.where(jnp.isnan(q), jnp.float32(0.0), q)
    return lax.bitcast_convert_type(
        lax.bitcast_convert_type(q, jnp.uint32) | (b & jnp.uint32(0x80000000)), jnp.float32
    )


def _round_magnitude(v: float, fmt: FloatFormat) -> float:
    """Python reference: a float32 magnitude ``v`` rounded to ``fmt`` (nearest even,
    saturating), exact in float64 for the formats :func:`_fast_mode` accepts."""
    if v == 0.0:
        return 0.0
    e = max(math.frexp(v)[1] - 1, fmt.emin)
    ulp = math.ldexp(1.0, e - fmt.mantissa_bits)
    return min(round(v / ulp) * ulp, fmt.max)  # round(): ties to even


@functools.cache
def count_thresholds(fmt: FloatFormat) -> tuple[int, int, int] | None:
    """(U, N, M) on float32 magnitude bit patterns: a magnitude with bits ``<= U`` rounds
    to zero in ``fmt``, ``>= N`` to a normal value, ``>= M`` to the max (saturated), so
    counts need no cast. None for formats that :func:`round_to_format` casts exactly."""
    if _fast_mode(fmt) == "exact":
        return None

    def first(
        pred: Callable[[float], bool],
    ) -> int:  # smallest finite float32 bit pattern where pred holds
        lo, hi = 0, 0x7F800000
        while lo < hi:
            mid = (lo + hi) // 2
            if pred(float(np.uint32(mid).view(np.float32))):
                hi = mid
            else:
                lo = mid + 1
        return lo

    r = functools.partial(_round_magnitude, fmt=fmt)
    under = first(lambda v: r(v) > 0.0) - 1
    normal = first(lambda v: r(v) >= fmt.smallest_normal)
    sat = first(lambda v: r(v) >= fmt.max)
    return under, normal, sat
