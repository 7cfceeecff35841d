"""The block quantizers of the published 4-bit (E2M1) training recipes, in float32.

Every quantizer takes a float32 array blocked along its LAST axis (and, for 2-D tiles, its
last two axes) and returns an :class:`FP4Block`: the E2M1 element values, the per-element
block factor and the per-tensor (or per-outer-block) factor, so that

    value = (elems * scale) * tensor_inv

``elems * scale`` is exact in float32 (an E2M1 value times an E4M3 or power-of-two scale),
and ``tensor_inv`` is applied once, as a block-scaled GEMM applies the global scale to its
output. The quantizers (sources in each docstring; what a paper leaves open is stated there):

- :func:`nvfp4`: NVFP4 two-level scaling, 1 x 16 blocks or 16 x 16 tiles, with the options of
  the recipes built on it: the "Four Over Six" 4-or-6 block scale choice, a smaller target
  than 6 (headroom for stochastic rounding, Quartet II), TetraJet-v2's 1 x 128 outer blocks;
- :func:`mxfp4`: OCP MXFP4 (E8M0 power-of-two scales, 32-element blocks), with Tseng et al.'s
  3/4 pre-scale that keeps stochastic rounding from clipping;
- :func:`quest`: Quartet's forward quantizer (QuEST: a power-of-two scale from the block's
  standard deviation, RTN, and the trust mask of the elements that did not clip);
- :func:`ms_eden`: Quartet II's MS-EDEN: RTN elements, the EDEN correction of each rotation
  group folded into its micro-scales, which are then stochastically rounded (unbiased);
- :func:`qema_nearest`: TetraJet's Q-EMA rounding of a weight, each element rounded to the
  neighbour of its value nearest to its exponential moving average.

Stochastic rounding draws from :func:`uniform`: a counter-based integer hash of the element
index and a seed taken from a JAX PRNG key (24 random bits, the same numbers for the same key
and shape, 25x cheaper than ``jax.random.uniform`` on CPU: 0.3 vs 7.5 ms per million).

Shared with the recipes (:mod:`precisionlab.recipes`); the public entry is
:func:`precisionlab.quant.fake_quant` with a name of :data:`FP4_QUANTIZERS`.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.bits import round_to_format
from precisionlab.formats import FORMATS
from precisionlab.quant import _pow2 as pow2

__all__ = [
    "E2M1_MAX",
    "FP4_QUANTIZERS",
    "QUEST_GAUSSIAN_SCALE",
    "FP4Block",
    "e2m1",
    "e2m1_nearest",
    "e2m1_stochastic",
    "e4m3_nearest",
    "e4m3_stochastic",
    "fake_quant_named",
    "hadamard",
    "ms_eden",
    "mxfp4",
    "nvfp4",
    "qema_nearest",
    "quest",
    "random_signs",
    "rotate",
    "uniform",
]

#: The largest magnitude of FP4 E2M1 (float4_e2m1fn): 6.0.
E2M1_MAX = 6.0
E4M3_MAX = 448.0
_E4M3 = FORMATS["float8_e4m3fn"]
_F32_MAX = np.float32(np.finfo(np.float32).max)
_ABS = np.uint32(0x7FFFFFFF)
#: QuEST's Gaussian clipping factor for 4 bits divided by E2M1's max: the block's standard
#: deviation times this is the power-of-two scale's argument (Quartet's reference code).
QUEST_GAUSSIAN_SCALE = 2.92247856 / 6.0


class FP4Block(NamedTuple):
    """A quantized operand: ``value = (elems * scale) * tensor_inv``.

    elems: float32 E2M1 values (shape of the input). scale: float32 per-element block factor
    (an E4M3 value, a power of two, or a corrected MS-EDEN scale). tensor_inv: float32 factor
    broadcastable to the input (the inverse of NVFP4's global encode scale), or None.
    mask: bool, the elements that did not clip (QuEST's trust mask), or None.
    """

    elems: jax.Array
    scale: jax.Array
    tensor_inv: jax.Array | None = None
    mask: jax.Array | None = None

    def values(self) -> jax.Array:
        """The dequantized float32 values."""
        v = self.elems * self.scale
        return v if self.tensor_inv is None else v * self.tensor_inv


# --- random numbers --------------------------------------------------------------------------
def _mix(h: jax.Array) -> jax.Array:
    """A 32-bit avalanche hash (two multiply-xorshift rounds, "lowbias32")."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """float32 uniform numbers in [0, 1) on a 2**-24 grid, one per element of ``shape``.

    A counter-based generator: two 32-bit words drawn from ``key`` seed a hash of each
    element's row-major index (as GPU kernels draw their rounding bits from Philox). Cheap on
    CPU; the same for the same key and shape; independent keys give independent streams
    (tests: uniformity and independence of the draws, and the unbiasedness of stochastic
    rounding built on them).
    """
    seed = jax.random.bits(key, (2,), jnp.uint32)
    n = int(np.prod(shape)) if shape else 1
    idx = lax.iota(jnp.uint32, n).reshape(shape)
    h = _mix(idx * jnp.uint32(0x9E3779B9) + seed[0])
    h = _mix(h ^ seed[1])
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


# --- power-of-two scaling --------------------------------------------------------------------
def _mul_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """``x * 2**k`` (``k`` int32, broadcastable): a float multiply when every ``|k| <= 100``
    (the factor is a normal float32; an input or result a CPU would flush as subnormal is
    below 2**-26 of its block's largest value and rounds to 0 in E2M1 either way, so the
    quantized values are those of the exact path, tested), else :func:`pow2.ldexp` (exact)."""
    safe = jnp.all(jnp.abs(k) <= 100)
    return lax.cond(
        safe,
        lambda x, k: x * pow2.pow2(k),
        lambda x, k: pow2.ldexp(x, jnp.broadcast_to(k, x.shape)),
        x,
        k,
    )


# --- E2M1 elements ---------------------------------------------------------------------------
def e2m1_nearest(y: jax.Array) -> jax.Array:
    """``y`` rounded to E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6) to nearest, ties to even,
    saturating to +-6 (NaN stays NaN, the sign of a zero is kept): steps of 0.5 below 2, 1
    below 4, 2 above. The same values as ``round_to_format(y, "float4_e2m1fn",
    saturate=True)`` on every float32 (tests), in a few float operations."""
    a = jnp.abs(y)
    r = jnp.where(
        a < 2.0,
        jnp.round(a * 2.0) * 0.5,
        jnp.where(a < 4.0, jnp.round(a), jnp.round(a * 0.5) * 2.0),
    )
    return jnp.copysign(jnp.minimum(r, jnp.float32(E2M1_MAX)), y)


def e2m1_stochastic(y: jax.Array, u: jax.Array) -> jax.Array:
    """``y`` rounded to E2M1 stochastically: up (in magnitude) iff ``u`` < the fractional
    distance from the lower neighbour, saturating to +-6 (a value beyond 6 is clipped, so
    unbiased only for |y| <= 6, which every recipe ensures by its scale)."""
    a = jnp.abs(y)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    lo = jnp.floor(a / step) * step  # exact: step is a power of two
    frac = (a - lo) / step
    r = lo + jnp.where(u < frac, step, jnp.float32(0.0))
    return jnp.copysign(jnp.minimum(r, jnp.float32(E2M1_MAX)), y)


def e2m1(y: jax.Array, rounding: str = "nearest_even", key: jax.Array | None = None) -> jax.Array:
    """:func:`e2m1_nearest` or (``rounding="stochastic"``, with ``key``) :func:`e2m1_stochastic`."""
    if rounding == "stochastic":
        if key is None:
            raise ValueError("stochastic rounding needs a PRNG key")
        return e2m1_stochastic(y, uniform(key, y.shape))
    if rounding != "nearest_even":
        raise ValueError(f"E2M1 rounding must be 'nearest_even' or 'stochastic', got {rounding!r}")
    return e2m1_nearest(y)


# --- E4M3 scales -----------------------------------------------------------------------------
def e4m3_nearest(s: jax.Array) -> jax.Array:
    """float32 ``s`` rounded to E4M3 to nearest even, saturating to 448."""
    return round_to_format(s, _E4M3, saturate=True)


def e4m3_stochastic(s: jax.Array, u: jax.Array) -> jax.Array:
    """Non-negative ``s`` rounded to E4M3 stochastically (up iff ``u`` < the fractional
    distance between its two E4M3 neighbours), saturating to 448: unbiased for s <= 448."""
    lo = round_to_format(s, _E4M3, rounding="down", saturate=True)
    hi = round_to_format(s, _E4M3, rounding="up", saturate=True)
    gap = hi - lo
    frac = jnp.where(gap > 0, (s - lo) / jnp.where(gap > 0, gap, 1.0), 0.0)
    return jnp.where(u < frac, hi, lo)


# --- layout ----------------------------------------------------------------------------------
def _bits_amax(x: jax.Array, axis: int | tuple[int, ...]) -> jax.Array:
    """max |x| over ``axis`` (keepdims) on the float32 bits: exact, NaN wins over inf."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & _ABS
    return lax.bitcast_convert_type(jnp.max(b, axis=axis, keepdims=True), jnp.float32)


def _block_view(x: jax.Array, block: int, two_d: bool) -> jax.Array:
    """x (..., R, K) as (..., R/b, b, K/b, b) tiles (two_d) or (..., K/b, b) blocks."""
    if two_d:
        *lead, r, k = x.shape
        return x.reshape(*lead, r // block, block, k // block, block)
    *lead, k = x.shape
    return x.reshape(*lead, k // block, block)


def _block_axes(two_d: bool) -> tuple[int, ...]:
    return (-3, -1) if two_d else (-1,)


def check_blocks(x: jax.Array, block: int, two_d: bool, what: str) -> None:
    """ValueError unless the blocked axes of ``x`` are multiples of ``block``."""
    dims = [("last", x.shape[-1])] + ([("second-to-last", x.shape[-2])] if two_d else [])
    for label, n in dims:
        if n % block:
            raise ValueError(
                f"{what}: the {label} axis has size {n}, not a multiple of the block {block}"
            )


# --- NVFP4 -----------------------------------------------------------------------------------
def _global_scale(ga: jax.Array, target: float) -> jax.Array:
    """NVFP4's encode scale ``min(target / amax, float32 max)``: 1 where amax is 0 (TE's
    compute_global_encode_scaling_factor_FP4), NaN where amax is not finite."""
    zero = ga == 0
    s = jnp.minimum(jnp.float32(target) / jnp.where(zero, 1.0, ga), _F32_MAX)
    s = jnp.where(zero | (s == 0), jnp.float32(1.0), s)
    return jnp.where(jnp.isfinite(ga), s, jnp.float32(jnp.nan))


def nvfp4(
    x: jax.Array,
    *,
    block: int = 16,
    two_d: bool = False,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
    val_max: float = E2M1_MAX,
    scale_max: float = E4M3_MAX,
    four_over_six: str | None = None,
    outer: int | None = None,
) -> FP4Block:
    """NVFP4: E2M1 elements, an E4M3 scale per block, a float32 encode scale per tensor.

    float32 steps (TE's NVFP4 quantizer, NVIDIA arXiv 2509.25149 sec. 2): ``s_enc =
    min(scale_max * val_max / amax(x), float32 max)``; per block ``sb = e4m3(f32(amax_b *
    f32(1 / val_max)) * s_enc)``; elements ``e2m1(x * f32(s_enc / sb))`` (0 where sb is 0);
    ``value = (elem * sb) * f32(1 / s_enc)``. Defaults (val_max 6, scale_max 448) are plain
    NVFP4, bit for bit the values of the ``nvfp4`` recipe's quantizer (tests).

    Args:
      x: float32 (..., K), or (..., R, K) with ``two_d``.
      block: elements per block along K (16), or the tile side with ``two_d``.
      two_d: block x block tiles over the last two axes (NVIDIA's 2-D weight scaling, sec. 4).
      rounding: ``"nearest_even"`` or ``"stochastic"`` (needs ``key``).
      val_max: the element value a block's amax maps to: 6, or 6 * 16/17 (Quartet II's
        headroom: E4M3 rounds a scale down by at most a factor 16/17, so no element then
        exceeds 6 and stochastic rounding never clips).
      scale_max: the E4M3 value the tensor's amax maps to: 448, or 256 with Four Over Six
        (and MS-EDEN), leaving room for the x1.5 of scaling to 4 (and for the correction).
      four_over_six: None, or the error the "Four Over Six" choice minimises per block
        (``"mse"``, the authors' default; ``"mae"``; ``"abs_max"``): each block is quantized
        with ``sb`` and with ``sb4 = e4m3(f32(f32(amax_b * f32(1/val_max)) * s_enc) * 1.5)``
        (its amax maps to 4) and keeps the one with the smaller error, 6 on a tie.
      outer: None (one encode scale per tensor) or TetraJet-v2's outer block: an encode scale
        per ``outer`` elements along K.
    """
    x = x.astype(jnp.float32)
    check_blocks(x, block, two_d, "nvfp4")
    if outer is not None:
        if two_d or outer % block or x.shape[-1] % outer:
            raise ValueError(
                f"nvfp4 outer blocks of {outer} need 1-D blocks dividing it and a last axis "
                f"that is a multiple of it (got {x.shape[-1]})"
            )
        xo = x.reshape(*x.shape[:-1], x.shape[-1] // outer, outer)
        ga = _bits_amax(xo, (-1,))
        s_enc = jnp.broadcast_to(_global_scale(ga, scale_max * val_max), xo.shape)
        s_enc = s_enc.reshape(x.shape)
    else:
        ga = _bits_amax(x, tuple(range(x.ndim)))
        s_enc = _global_scale(ga, scale_max * val_max)
    g = _block_view(x, block, two_d)
    a = _bits_amax(g, _block_axes(two_d))
    if outer is not None:  # constant within a block: take one
        se = jnp.max(_block_view(s_enc, block, two_d), axis=-1, keepdims=True)
    else:
        se = s_enc.reshape((1,) * g.ndim)
    base = (a * jnp.float32(np.float32(1.0) / np.float32(val_max))) * se
    inv = jnp.float32(1.0) / se

    def candidate(sb: jax.Array, k: jax.Array | None) -> jax.Array:
        zero = sb == 0
        y = g * jnp.where(zero, jnp.float32(0.0), se / jnp.where(zero, 1.0, sb))
        y = jnp.where(jnp.isfinite(a), y, jnp.float32(jnp.nan))
        return e2m1(y, rounding, k)

    sb6 = e4m3_nearest(base)
    k6 = k4 = key
    if rounding == "stochastic" and four_over_six is not None:
        if key is None:  # found by mypy: jax.random.split(None) raised a bare TypeError
            raise ValueError("stochastic rounding needs a PRNG key")
        k6, k4 = jax.random.split(key)
    q = candidate(sb6, k6)
    sb = sb6
    if four_over_six is not None:
        sb4 = e4m3_nearest(base * jnp.float32(1.5))
        q4 = candidate(sb4, k4)
        err6 = _block_error(g, (q * sb6) * inv, four_over_six, _block_axes(two_d))
        err4 = _block_error(g, (q4 * sb4) * inv, four_over_six, _block_axes(two_d))
        pick4 = err4 < err6
        q = jnp.where(pick4, q4, q)
        sb = jnp.where(pick4, sb4, sb6)
    scale = jnp.broadcast_to(sb, g.shape).reshape(x.shape)
    tinv = (
        jnp.broadcast_to(inv, g.shape).reshape(x.shape)
        if outer is not None
        else inv.reshape((1,) * x.ndim)
    )
    return FP4Block(q.reshape(x.shape), scale, tinv)


def _block_error(g: jax.Array, deq: jax.Array, rule: str, axes: int | tuple[int, ...]) -> jax.Array:
    d = deq - g
    if rule == "mse":
        return jnp.sum(d * d, axis=axes, keepdims=True)
    if rule == "mae":
        return jnp.sum(jnp.abs(d), axis=axes, keepdims=True)
    if rule == "abs_max":
        return jnp.max(jnp.abs(d), axis=axes, keepdims=True)
    raise ValueError(f"unknown four_over_six rule {rule!r}; allowed: mse, mae, abs_max")


# --- MXFP4 -----------------------------------------------------------------------------------
def mxfp4(
    x: jax.Array,
    *,
    block: int = 32,
    two_d: bool = False,
    rule: str = "floor",
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
    prescale: bool = False,
) -> FP4Block:
    """OCP MXFP4: E2M1 elements and an E8M0 scale ``X = 2**e`` per block (OCP MX v1.0 sec.
    6.3: ``e = floor(log2 amax_b) - 2`` for ``rule="floor"``; the other rules of
    :data:`precisionlab.quant.SCALE_RULES`), clamped to [-127, 127]; elements ``e2m1(x / X)``.

    ``prescale`` (Tseng, Yu and Park, arXiv 2502.20586 sec. 3, the authors' ``dither_scale``
    patch of microxcaling): the elements are ``e2m1(3 * x / 2**(e + 2))``, i.e. x / X times
    3/4, so a block's largest element (x / X < 8 by the floor rule) lands at most at 6 and
    stochastic rounding never clips; the scale is then ``2**(e + 2) / 3`` (a float32 factor).
    """
    x = x.astype(jnp.float32)
    check_blocks(x, block, two_d, "mxfp4")
    g = _block_view(x, block, two_d)
    a = _bits_amax(g, _block_axes(two_d))
    e = pow2.scale_exponent(a, E2M1_MAX, 2, rule, 1)
    bad = ~jnp.isfinite(a)
    e = jnp.where(bad, 0, e)
    if prescale:
        y = _mul_pow2(g * jnp.float32(3.0), -(e + 2))
        sc = pow2.pow2(e + 2) / jnp.float32(3.0)
    else:
        y = _mul_pow2(g, -e)
        sc = pow2.pow2(e)
    y = jnp.where(bad, jnp.float32(jnp.nan), y)
    q = e2m1(y, rounding, key)
    sc = jnp.where(bad, jnp.float32(jnp.nan), sc)
    return FP4Block(q.reshape(x.shape), jnp.broadcast_to(sc, g.shape).reshape(x.shape))


# --- QuEST (Quartet's forward) ---------------------------------------------------------------
def quest(x: jax.Array, *, block: int = 32) -> FP4Block:
    """Quartet's forward quantizer (QuEST on MXFP4; Castro et al., arXiv 2505.14669 sec. 4,
    and the authors' reference kernel): per block the population standard deviation ``sd``
    (mean of squares minus squared mean), the power-of-two scale ``X = 2**floor(log2(
    QUEST_GAUSSIAN_SCALE * sd + 1e-8))`` (the Gaussian-optimal clip 2.92 sd maps near 6),
    elements ``e2m1(x / X)`` to nearest (saturating), and ``mask``: ``|x / X| < 6``, the
    elements whose gradient the trust estimator passes."""
    x = x.astype(jnp.float32)
    check_blocks(x, block, False, "quest")
    g = _block_view(x, block, False)
    mean = jnp.mean(g, axis=-1, keepdims=True)
    sd = jnp.sqrt(jnp.maximum(jnp.mean(g * g, axis=-1, keepdims=True) - mean * mean, 0.0))
    s = jnp.float32(QUEST_GAUSSIAN_SCALE) * sd + jnp.float32(1e-8)
    e = jnp.clip(pow2.floor_log2(s), pow2.SCALE_EXPONENT_MIN, pow2.SCALE_EXPONENT_MAX)
    y = _mul_pow2(g, -e)
    q = e2m1_nearest(y)
    sc = jnp.broadcast_to(pow2.pow2(e), g.shape).reshape(x.shape)
    return FP4Block(q.reshape(x.shape), sc, None, (jnp.abs(y) < E2M1_MAX).reshape(x.shape))


# --- MS-EDEN (Quartet II) --------------------------------------------------------------------
#: Quartet II's backward scale override (its reference ``Quartet_II_fn``): the block amax maps
#: to 6 / (17/16 * 0.93), i.e. slightly above 6 (a few elements clip by RTN).
MS_EDEN_VAL_MAX = 6.0 / ((17.0 / 16.0) * 0.93)
#: The E4M3 value the tensor's amax maps to in MS-EDEN: 256 leaves room for the correction.
MS_EDEN_SCALE_MAX = 255.99


def ms_eden(
    x: jax.Array,
    key: jax.Array,
    *,
    group: int,
    block: int = 16,
    val_max: float = MS_EDEN_VAL_MAX,
    scale_max: float = MS_EDEN_SCALE_MAX,
    scale_format: str = "e4m3",
) -> FP4Block:
    """MS-EDEN (Panferov et al., Quartet II, arXiv 2601.22813; the authors' reference
    kernel ``eden_1x16s_fp4_kernel``), for ``x`` already rotated by a random Hadamard
    transform over groups of ``group`` elements along K.

    NVFP4 scales as :func:`nvfp4` with ``val_max``/``scale_max``; elements RTN; per rotation
    group the EDEN correction ``c = <y, y> / <y, q>`` (y the scaled values, q their E2M1
    rounding; 1 where <y, q> is 0) multiplies the group's micro-scales, which are then rounded
    stochastically to E4M3 (``scale_format="e4m3"``, NVFP4) or to powers of two (``"e8m0"``,
    the MXFP4 variant of the authors' code, with ``scale_max`` unused): the stochasticity moves
    from the elements to the scales. Unbiased for the rotated vector in expectation over the
    rotation and the scale rounding (tests measure it), with far less error than stochastic
    rounding of the elements.
    """
    x = x.astype(jnp.float32)
    if group % block or x.shape[-1] % group:
        raise ValueError(f"ms_eden: group {group} must be a multiple of the block {block} and "
                         f"divide the last axis ({x.shape[-1]})")  # fmt: skip
    if scale_format == "e8m0":
        g = _block_view(x, block, False)
        a = _bits_amax(g, (-1,))
        # the authors' e8m0 path: scale 2**floor(log2 amax_b) and a global 1/3, so the
        # block's amax lands in [3, 6)
        e = jnp.where(a == 0, pow2.SCALE_EXPONENT_MIN, pow2.floor_log2(a))
        e = jnp.clip(e, pow2.SCALE_EXPONENT_MIN, pow2.SCALE_EXPONENT_MAX)
        sb = pow2.pow2(e)
        tinv = jnp.float32(np.float32(1.0) / np.float32(3.0))
        y = _mul_pow2(g * jnp.float32(3.0), -e)
    else:
        ga = _bits_amax(x, tuple(range(x.ndim)))
        s_enc = _global_scale(ga, scale_max * val_max)
        g = _block_view(x, block, False)
        a = _bits_amax(g, (-1,))
        sb = e4m3_nearest((a * jnp.float32(np.float32(1.0) / np.float32(val_max))) * s_enc)
        sb = jnp.where(sb == 0, jnp.float32(1.0), sb)  # the reference: a zero scale becomes 1
        tinv = jnp.float32(1.0) / s_enc
        y = g * (s_enc / sb)
    q = e2m1_nearest(y)
    yg, qg = y.reshape(*x.shape[:-1], -1, group), q.reshape(*x.shape[:-1], -1, group)
    num = jnp.sum(yg * yg, axis=-1, keepdims=True)
    den = jnp.sum(yg * qg, axis=-1, keepdims=True)
    c = jnp.where(den == 0, jnp.float32(1.0), num / jnp.where(den == 0, 1.0, den))
    sbg = sb.reshape(*x.shape[:-1], -1, group // block)
    corrected = (sbg * c).reshape(sb.shape)
    u = uniform(key, corrected.shape)
    if scale_format == "e8m0":
        lo = pow2.pow2(pow2.floor_log2(corrected))
        frac = jnp.clip((corrected - lo) / lo, 0.0, 1.0)
        sc = jnp.where(u < frac, lo * 2.0, lo)
    else:
        sc = e4m3_stochastic(corrected, u)
    scale = jnp.broadcast_to(sc, g.shape).reshape(x.shape)
    tinv = jnp.reshape(tinv, (1,) * x.ndim)
    return FP4Block(q.reshape(x.shape), scale, tinv)


# --- Q-EMA (TetraJet) ------------------------------------------------------------------------
def qema_nearest(y: jax.Array, ema: jax.Array) -> jax.Array:
    """TetraJet's Q-EMA rounding (Chen et al., arXiv 2502.20853 sec. 5.1; the authors'
    ``SymmQuantizer_with_EMA``) of scaled values ``y`` given their moving averages ``ema``
    (scaled by the same block scale): each element rounds to the lower or upper E2M1 neighbour
    of ``y`` (the binade is y's), whichever the EMA is nearer to (up iff the EMA's fraction of
    the step is at least one half), saturating to +-6. Where the EMA equals y this is RTN with
    ties rounded up in magnitude."""
    a = jnp.abs(y)
    ea = ema * jnp.sign(y)  # the EMA follows y's sign (the reference's ``sign * ema``)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    lo = jnp.floor(a / step) * step
    up = (ea - lo) / step >= 0.5
    r = jnp.minimum(lo + jnp.where(up, step, 0.0), jnp.float32(E2M1_MAX))
    return jnp.copysign(r, y)


# --- random Hadamard transforms --------------------------------------------------------------
def hadamard(n: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order ``n`` (a power of two) over sqrt(n): orthogonal."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-two size, got {n}")
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def random_signs(key: jax.Array, n: int) -> jax.Array:
    """n random signs (+-1.0, float32) from ``key``."""
    return jnp.where(jax.random.bits(key, (n,), jnp.uint32) >> 31 == 1, -1.0, 1.0).astype(
        jnp.float32
    )


def rotate(x: jax.Array, signs: jax.Array, *, inverse: bool = False) -> jax.Array:
    """Groups of n = len(signs) along the last axis times ``diag(signs) H_n`` (the random
    Hadamard transform; ``inverse``: times its transpose ``H_n diag(signs)``). float32,
    HIGHEST precision; orthogonal, so applying the same transform to both operands along the
    contraction leaves their product unchanged in exact arithmetic."""
    n = signs.shape[0]
    if x.shape[-1] % n:
        raise ValueError(f"rotation of size {n}: the last axis ({x.shape[-1]}) is not a multiple")
    h = jnp.asarray(hadamard(n))
    m = h.T * signs[None, :] if inverse else signs[:, None] * h
    g = x.reshape(*x.shape[:-1], x.shape[-1] // n, n).astype(jnp.float32)
    out = jnp.einsum("...j,jk->...k", g, m, precision=lax.Precision.HIGHEST)
    return out.reshape(x.shape)


# --- by name (fake_quant) --------------------------------------------------------------------
#: The 4-bit quantizers :func:`precisionlab.quant.fake_quant` takes by name (blocks along
#: ``axis``, default the last): what each recipe of :mod:`precisionlab.recipes` does to an
#: operand. ``key`` for stochastic rounding and random rotations.
FP4_QUANTIZERS: dict[str, str] = {
    "nvfp4": "NVFP4, 1 x 16 blocks (E4M3 scales, a float32 tensor scale)",
    "nvfp4_2d": "NVFP4 with 16 x 16 tiles over the last two axes (NVIDIA's weights)",
    "nvfp4_4over6": "NVFP4 with Four Over Six's per-block choice of 4 or 6 (squared error)",
    "nvfp4_double": "TetraJet-v2's NVFP4: tensor scales per 1 x 128 outer block",
    "mxfp4_prescaled": "Tseng et al.'s MXFP4: OCP floor scale, elements x 3/4 (SR never clips)",
    "quest": "Quartet's forward: 32-point Hadamard, QuEST scale from the block's deviation",
    "ms_eden": "Quartet II's MS-EDEN after a 128-point random Hadamard transform (unbiased)",
}


def fake_quant_named(
    x: jax.Array,
    name: str,
    *,
    axis: int | None = None,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
) -> jax.Array:
    """``x`` quantized and dequantized by the quantizer ``name`` of :data:`FP4_QUANTIZERS`,
    in ``x``'s dtype and layout; rotated quantizers rotate back, so every result estimates
    ``x``. The gradient is straight-through (QuEST: only where the element did not clip)."""
    if name not in FP4_QUANTIZERS:
        raise ValueError(f"unknown FP4 quantizer {name!r}; allowed: {', '.join(FP4_QUANTIZERS)}")
    if rounding not in ("nearest_even", "stochastic"):
        raise ValueError(f"{name}: rounding must be 'nearest_even' or 'stochastic', "
                         f"got {rounding!r}")  # fmt: skip
    needs_key = rounding == "stochastic" or name == "ms_eden"
    if needs_key and key is None:
        raise ValueError(f"{name} with rounding={rounding!r} needs a PRNG key: pass key=...")
    if not needs_key and key is not None:
        raise ValueError(f"key is only used by stochastic rounding and ms_eden, not {name} with "
                         f"rounding={rounding!r}")  # fmt: skip
    if name in ("quest", "ms_eden") and rounding != "nearest_even":
        raise ValueError(f"{name} rounds its elements to nearest (its own randomness: pass key)")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"fake_quant takes a float array, got {x.dtype}")
    ax = x.ndim - 1 if axis is None else axis % x.ndim
    moved = jnp.moveaxis(x, ax, -1)
    return jnp.moveaxis(_fake_ste(moved, name, rounding, key), -1, ax).astype(x.dtype)


def _named_values(
    x: jax.Array, name: str, rounding: str, key: jax.Array | None
) -> tuple[jax.Array, Any]:
    """(values, gradient residual) of the quantizer on float32 ``x`` blocked along the last
    axis; the residual is None (straight through) or QuEST's (trust mask, rotation)."""
    x = x.astype(jnp.float32)
    if name == "nvfp4":
        return nvfp4(x, rounding=rounding, key=key).values(), None
    if name == "nvfp4_2d":
        return nvfp4(x, two_d=True, rounding=rounding, key=key).values(), None
    if name == "nvfp4_4over6":
        q = nvfp4(x, rounding=rounding, key=key, scale_max=256.0, four_over_six="mse")
        return q.values(), None
    if name == "nvfp4_double":
        q = nvfp4(x, outer=_divisor(x.shape[-1], 128), rounding=rounding, key=key)
        return q.values(), None
    if name == "mxfp4_prescaled":
        return mxfp4(x, rounding=rounding, key=key, prescale=True).values(), None
    if name == "quest":
        signs = jnp.ones((_divisor(x.shape[-1], 32),), jnp.float32)
        q = quest(rotate(x, signs))
        return rotate(q.values(), signs, inverse=True), (q.mask, signs)
    assert key is not None  # ms_eden: fake_quant refused a missing key
    ks, kq = jax.random.split(key)
    n = _divisor(x.shape[-1], 128)
    signs = random_signs(ks, n)
    q = ms_eden(rotate(x, signs), kq, group=n)
    return rotate(q.values(), signs, inverse=True), None


def _divisor(n: int, cap: int) -> int:
    p = cap
    while p > 16 and n % p:
        p //= 2
    if n % p:
        raise ValueError(f"the quantized axis has size {n}, not a multiple of 16")
    return p


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_ste(x: jax.Array, name: str, rounding: str, key: jax.Array | None) -> jax.Array:
    return _named_values(x, name, rounding, key)[0]


def _fake_ste_fwd(
    x: jax.Array, name: str, rounding: str, key: jax.Array | None
) -> tuple[jax.Array, Any]:
    return _named_values(x, name, rounding, key)


def _fake_ste_bwd(name: str, rounding: str, res: Any, g: jax.Array) -> tuple[jax.Array, None]:
    if res is None:
        return g, None
    # QuEST: y = Q(x M) M^T, so dy/dx = M diag(mask) M^T (M the rotation)
    mask, signs = res
    gr = rotate(g.astype(jnp.float32), signs) * mask
    return rotate(gr, signs, inverse=True).astype(g.dtype), None


_fake_ste.defvjp(_fake_ste_fwd, _fake_ste_bwd)
