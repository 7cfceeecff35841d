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

The quantized copy is computed with the recipes' own quantizers
(:mod:`precisionlab.recipes`), so it is exactly what the recipe's GEMM would multiply.
"""

from __future__ import annotations

import dataclasses
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.formats import FloatFormat, get_format
from precisionlab.quant import pow2
from precisionlab.recipes import MX, get_recipe
from precisionlab.recipes import _scaling as S

__all__ = ["SCALINGS", "Target", "parse_targets"]

SCALINGS = ("none", "tensor", "row", "block", "mx")
_ALIASES = {"current": "e4m3:tensor", "rowwise": "e4m3:row", "blockwise": "e4m3:block"}
_MX_NAMES = ("mxfp8", "mxfp6", "mxfp4")
_SPEC = re.compile(r"^([^:]+?)(?::(tensor|row|block)(\d+)?)?$")
_EPS = 1e-12  # torchao's and TE's epsilon of the amax in current and row-wise scaling


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


def _parse_one(spec) -> Target:
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


def parse_targets(targets) -> tuple[Target, ...]:
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
    the element cast rounds), ``elems`` (the element-format values, saturated) and
    ``values`` (the dequantized copy the GEMM would multiply), all float32 (R, K)."""

    scaled: jax.Array
    elems: jax.Array
    values: jax.Array


def _pad(x: jax.Array, mult: int) -> jax.Array:
    pad = -x.shape[-1] % mult
    return jnp.pad(x, ((0, 0), (0, pad))) if pad else x


def quantize_target(x2: jax.Array, t: Target) -> Quantized:
    """Quantize a float32 (R, K) tensor as ``t`` says (along K)."""
    r, k = x2.shape
    if t.scaling == "none":
        q = S.round_elements(x2, t.fmt)
        return Quantized(x2, q, q)
    x3 = _pad(x2, t.block if t.scaling in ("block", "mx") else 1)[None]
    if t.scaling == "tensor":
        qo, s = S.tensorwise(x3, t.fmt, eps=_EPS, pow2_scales=False)
        scaled = jnp.where(jnp.isnan(s), jnp.float32(jnp.nan), x3 * s)
    elif t.scaling == "row":
        qo, s = S.per_row(x3, t.fmt, eps=_EPS)
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
