"""Scale rules and operand quantizers of the recipes, on (B, R, K) operands.

Shared with telemetry (the same scale rules, so its what-if counts match the recipes); not
part of the public API (docs/reference/public_api.txt): users import from ``precisionlab.recipes``.

Every operand reaching a GEMM is laid out as ``(B, R, K)``: batch, kept rows, and the
contraction axis last, so "along the contraction axis" is always the last axis. A quantizer
returns a :class:`QOperand`: element values (exact float32 values of the element format),
an optional per-row factor (tensor- and row-wise recipes: applied to the GEMM's output, as
cuBLAS applies ``scale_a * scale_b``), and an optional per-element factor (block recipes:
applied to the elements before the GEMM; products stay exact).

Non-finite inputs: where a recipe derives its scale from the data (current, rowwise,
blockwise, MX, NVFP4), a NaN or inf poisons its scaling group (tensor, row or block): the
scale is NaN and so is every value of the group, instead of a silently saturated result.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from precisionlab.bits import decode, encode
from precisionlab.formats import FORMATS, FloatFormat
from precisionlab.quant import _pow2 as pow2
from precisionlab.quant._pow2 import scale_exponent

__all__ = ["Floor", "QOperand", "amax", "block_pow2", "mx_blocks", "nvfp4", "per_row", "tensorwise"]


def float_format(name: str) -> FloatFormat:
    """The float format called ``name`` (the element and scale formats of the recipes)."""
    fmt = FORMATS[name]
    assert isinstance(fmt, FloatFormat)  # the element formats are float formats
    return fmt


E4M3 = float_format("float8_e4m3fn")
_ABS = np.uint32(0x7FFFFFFF)


class QOperand(NamedTuple):
    """A quantized (B, R, K) operand: value = elems * block_inv, GEMM output * row_inv."""

    elems: jax.Array  # float32 (B, R, K): exact element values of the format
    row_inv: jax.Array | None  # float32 broadcastable to (B, R, 1), or None
    block_inv: jax.Array | None  # float32 broadcastable to (B, R, K), or None
    block_exp: jax.Array | None = None  # int32 log2 of a power-of-two block_inv, or None

    def block_values(self) -> jax.Array:
        """elems * block_inv, exact (power-of-two factors applied on the bits)."""
        if self.block_inv is None:
            return self.elems
        if self.block_exp is None:
            return self.elems * self.block_inv
        v = mul_pow2(self.elems, jnp.broadcast_to(self.block_exp, self.elems.shape))
        return jnp.where(jnp.isnan(self.block_inv), self.block_inv, v)

    def dequantize(self) -> jax.Array:
        """The float32 values the recipe's GEMM multiplies (scales applied once, rounded)."""
        v = self.block_values()
        return v if self.row_inv is None else v * self.row_inv

    def output_factor(self, rhs: QOperand) -> jax.Array | None:
        """The factor the (B, M, N) output of the GEMM of this lhs and ``rhs`` is multiplied
        by: the product of their row factors (lhs (B, M, 1), rhs transposed to (B, 1, N)),
        or None where neither has one."""
        factor = self.row_inv
        if rhs.row_inv is not None:
            fb = jnp.swapaxes(rhs.row_inv, -1, -2)
            factor = fb if factor is None else factor * fb
        return factor


def amax(x: jax.Array, axis: int | tuple[int, ...] | None, keepdims: bool = True) -> jax.Array:
    """float32 max |x| computed on the bits (exact for subnormals; NaN wins over inf)."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) & _ABS
    m = jnp.max(b, axis=axis, keepdims=keepdims)
    return lax.bitcast_convert_type(m, jnp.float32)


def _is_zero(a: jax.Array) -> jax.Array:
    """True for +-0 on the bits (XLA on CPU compares subnormals as zero)."""
    return (lax.bitcast_convert_type(a, jnp.uint32) & _ABS) == 0


def is_finite(a: jax.Array) -> jax.Array:
    return (lax.bitcast_convert_type(a, jnp.uint32) & _ABS) < np.uint32(0x7F800000)


def round_elements(
    y: jax.Array, fmt: FloatFormat, rounding: str = "nearest_even", key: jax.Array | None = None
) -> jax.Array:
    """Scaled values to the element format, saturating to +-max (NaN stays NaN), float32."""
    if rounding == "stochastic":
        return decode(encode(y, fmt, saturate=True, rounding=rounding, key=key), fmt)
    return decode(encode(y, fmt, saturate=True, rounding=rounding), fmt)


def mul_pow2(x: jax.Array, e: jax.Array) -> jax.Array:
    """``x * 2**e`` exactly: a float multiply while every |e| <= 100 (then a subnormal input
    maps below 2**-26, zero in every element format, and element values times 2**e stay
    normal), else the integer ldexp (XLA on CPU flushes float32 subnormals)."""
    safe = jnp.all(jnp.abs(e) <= 100)

    def fast(x: jax.Array, e: jax.Array) -> jax.Array:
        # 2**e built from its exponent field, on e's own (small) shape
        two_e = lax.bitcast_convert_type(
            (jnp.clip(e, -126, 127) + 127).astype(jnp.uint32) << 23, jnp.float32
        )
        return x * two_e

    def exact(x: jax.Array, e: jax.Array) -> jax.Array:
        return pow2.ldexp(x, jnp.broadcast_to(e, x.shape))

    return lax.cond(safe, fast, exact, x, e)


class Floor(NamedTuple):
    """An amax floor eps > 0 as the float32 numbers the scale rule uses (host constants, or
    arguments of a program so that floors share it): ``lo``, the smallest float32 >= eps,
    and ``clamp``, ``fmt_max / eps`` computed in float64 and rounded once."""

    lo: ArrayLike
    clamp: ArrayLike


def floor_numbers(fmt_max: float, eps: float) -> Floor:
    """The :class:`Floor` of ``eps`` > 0 for a format whose largest value is ``fmt_max``."""
    lo = np.float32(eps)
    if float(lo) < eps:  # the smallest float32 >= eps
        lo = np.nextafter(lo, np.float32(np.inf))
    return Floor(lo, np.float32(np.float64(fmt_max) / np.float64(eps)))


def _quotient_scale(a: jax.Array, fmt_max: float, eps: float | Floor) -> jax.Array:
    """float32 ``fmt_max / max(a, eps)``, computed as float64 then rounded once (torchao);
    the same as the float32 division (double rounding is innocuous for a quotient). Only
    compares and selects use eps, so a Floor of traced numbers gives the same bits."""
    if isinstance(eps, Floor) or eps > 0:
        lo, clamp = eps if isinstance(eps, Floor) else floor_numbers(fmt_max, eps)
        small = lax.bitcast_convert_type(a, jnp.uint32) < lax.bitcast_convert_type(
            jnp.asarray(lo, jnp.float32), jnp.uint32
        )
        return jnp.where(small, jnp.asarray(clamp, jnp.float32), jnp.float32(fmt_max) / a)
    return jnp.float32(fmt_max) / a


def _pow2_floor(s: jax.Array) -> jax.Array:
    """int32 floor(log2 s) of a positive finite float32, on the bits."""
    return pow2.floor_log2(s)


# --- tensor- and row-wise ----------------------------------------------------------------
@overload
def scale_from_amax(
    a: jax.Array, fmt_max: float, *, eps: float | Floor, pow2_scales: Literal[True]
) -> tuple[jax.Array, jax.Array]: ...
@overload
def scale_from_amax(
    a: jax.Array, fmt_max: float, *, eps: float | Floor, pow2_scales: Literal[False]
) -> tuple[jax.Array, None]: ...
@overload
def scale_from_amax(
    a: jax.Array, fmt_max: float, *, eps: float | Floor, pow2_scales: bool
) -> tuple[jax.Array, jax.Array | None]: ...
def scale_from_amax(
    a: jax.Array, fmt_max: float, *, eps: float | Floor, pow2_scales: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Quantization scale ``s`` (x * s lands in the element range) from an amax.

    ``s = fmt_max / max(amax, eps)`` (TE current scaling, torchao tensorwise/rowwise with
    eps 1e-12), rounded down to a power of two when ``pow2_scales`` (torchao
    ``round_scales_to_power_of_2``, TE ``force_pow_2_scales``). amax 0 with eps 0: s = 1.
    A non-finite amax gives NaN. Returns (s, e) with e the int32 exponent (pow2) or None.
    """
    s = _quotient_scale(a, fmt_max, eps)
    if not isinstance(eps, Floor) and eps == 0:
        s = jnp.where(_is_zero(a), jnp.float32(1.0), s)
    bad = ~is_finite(a)
    if pow2_scales:
        s = jnp.where(is_finite(s), s, jnp.float32(np.ldexp(1.0, 127)))  # TE: 2**127 for inf
        e = _pow2_floor(s)
        s = jnp.where(bad, jnp.float32(jnp.nan), pow2.pow2(e))
        return s, jnp.where(bad, 0, e)
    return jnp.where(bad, jnp.float32(jnp.nan), s), None


def _apply(x: jax.Array, s: jax.Array, e: jax.Array | None, fmt: FloatFormat) -> jax.Array:
    """``x * s`` (on the bits where ``e`` is s's exponent) rounded to nearest in ``fmt``."""
    y = mul_pow2(x, e) if e is not None else x * s
    y = jnp.where(jnp.isnan(s), jnp.float32(jnp.nan), y)
    return round_elements(y, fmt)


def _inv(s: jax.Array, e: jax.Array | None) -> jax.Array:
    if e is not None:
        return jnp.where(jnp.isnan(s), s, pow2.pow2(-e))
    return jnp.float32(1.0) / s


def tensorwise(
    x: jax.Array, fmt: FloatFormat, *, eps: float | Floor, pow2_scales: bool
) -> tuple[QOperand, jax.Array]:
    """One scale for the whole operand (current scaling). Returns (operand, scale s)."""
    s, e = scale_from_amax(amax(x, None), fmt.max, eps=eps, pow2_scales=pow2_scales)
    q = _apply(x, s, e, fmt)
    return QOperand(q, _inv(s, e).reshape(1, 1, 1), None), s


def with_scale(x: jax.Array, s: jax.Array, fmt: FloatFormat) -> QOperand:
    """Quantize with a given per-tensor scale (delayed scaling): saturating cast of x * s.
    TE saturates (NaN stays NaN); the inverse scale is float32 1/s."""
    q = round_elements(x * s, fmt)
    return QOperand(q, (jnp.float32(1.0) / s).reshape(1, 1, 1), None)


def per_row(x: jax.Array, fmt: FloatFormat, *, eps: float | Floor) -> tuple[QOperand, jax.Array]:
    """One power-of-two scale per row along the contraction (last) axis: torchao rowwise
    (axiswise scaling, ``round_scales_to_power_of_2=True``). Returns (operand, s (B,R,1))."""
    s, e = scale_from_amax(amax(x, -1), fmt.max, eps=eps, pow2_scales=True)
    q = _apply(x, s, e, fmt)
    return QOperand(q, _inv(s, e), None), s


# --- blocks ------------------------------------------------------------------------------
def blocks_1d(x: jax.Array, b: int) -> jax.Array:
    *lead, k = x.shape
    return x.reshape(*lead, k // b, b)


def blocks_2d(x: jax.Array, b: int) -> jax.Array:
    bb, r, k = x.shape
    return x.reshape(bb, r // b, b, k // b, b)


def block_amax(x: jax.Array, block: int, two_d: bool) -> jax.Array:
    """Per-element-broadcastable amax of 1 x block (along K) or block x block tiles."""
    if two_d:
        g = blocks_2d(x, block)
        a = amax(g, (2, 4))
        return jnp.broadcast_to(a, g.shape).reshape(x.shape)
    g = blocks_1d(x, block)
    return jnp.broadcast_to(amax(g, -1), g.shape).reshape(x.shape)


def block_pow2(
    x: jax.Array, fmt: FloatFormat, block: int, *, two_d: bool
) -> tuple[QOperand, jax.Array]:
    """DeepSeek-V3 / TE Float8BlockScaling: per 1 x block (or block x block) tile, the scale
    ``s = 2**floor(log2(float32(fmt_max / amax)))``, amax 0 -> 1, inf quotient -> 2**127.
    Returns (operand, per-element s)."""
    a = block_amax(x, block, two_d)
    s, e = scale_from_amax(a, fmt.max, eps=0.0, pow2_scales=True)
    q = _apply(x, s, e, fmt)
    return QOperand(q, None, _inv(s, e), -e), s


def mx_blocks(x: jax.Array, fmt: FloatFormat, block: int, rule: str) -> tuple[QOperand, jax.Array]:
    """OCP MX: E8M0 scale X = 2**e per ``block`` elements along K, e by ``rule`` (see
    :data:`precisionlab.quant.SCALE_RULES`), clamped to [-127, 127]; elements x / X rounded and
    saturated; a block holding inf/NaN gets the NaN scale. Returns (operand, X per element).
    """
    g = blocks_1d(x, block)
    a = amax(g, -1)
    e = scale_exponent(a, float(fmt.max), fmt.emax, rule, fmt.mantissa_bits)
    bad = ~is_finite(a)
    e = jnp.where(bad, 0, e)
    y = mul_pow2(g, -e)
    y = jnp.where(bad, jnp.float32(jnp.nan), y)
    q = round_elements(y, fmt).reshape(x.shape)
    xs = jnp.where(bad, jnp.float32(jnp.nan), pow2.pow2(e))
    xs = jnp.broadcast_to(xs, g.shape).reshape(x.shape)
    e = jnp.broadcast_to(e, g.shape).reshape(x.shape)
    return QOperand(q, None, xs, e), xs


# --- NVFP4 -------------------------------------------------------------------------------
_E2M1 = float_format("float4_e2m1fn")
_NV_GLOBAL = np.float32(6.0 * 448.0)
_SIXTH = np.float32(np.float32(1.0) / np.float32(6.0))
_F32_MAX = np.float32(np.finfo(np.float32).max)


def nvfp4(
    x: jax.Array,
    block: int,
    *,
    two_d: bool,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
) -> tuple[QOperand, jax.Array, jax.Array]:
    """NVFP4 two-level scaling (TE NVFP4BlockScaling; NVIDIA, "Pretraining LLMs with NVFP4").

    float32 steps: ``s_enc = min(2688 / amax(x), float32 max)`` (1 where amax is 0); per block
    ``sb = e4m3(f32(f32(amax_b * f32(1/6)) * s_enc))`` (nearest even, saturating);
    elements ``e2m1(x * f32(s_enc / sb))`` (0 where sb is 0). Value = elem * sb / s_enc: the
    GEMM multiplies ``elem * sb`` (exact) and scales its output by ``f32(1 / s_enc)``.
    The clamp of ``s_enc`` at float32's max is TE's: a tensor of tiny values (amax 1e-38)
    quantizes to finite codes, not NaN. ``1 / s_enc`` is subnormal for amax below
    2688 * 2^-126 (about 3.2e-35); XLA on CPU flushes it, so such a tensor's product is 0
    there (a GPU keeps the subnormal scale).
    Returns (operand, sb per element, s_enc).
    """
    ga = amax(x, None)
    # TE's compute_global_encode_scaling_factor_FP4: min(2688 / amax, float32 max), and 1 for
    # amax 0 or a scale of 0; without the clamp a tensor of 1e-38s gave s_enc = inf, all NaN
    s_enc = jnp.minimum(_NV_GLOBAL / jnp.where(_is_zero(ga), 1.0, ga), _F32_MAX)
    s_enc = jnp.where(_is_zero(ga) | _is_zero(s_enc), jnp.float32(1.0), s_enc)
    s_enc = jnp.where(is_finite(ga), s_enc, jnp.float32(jnp.nan))
    a = block_amax(x, block, two_d)
    sb = round_elements((a * _SIXTH) * s_enc, E4M3)
    zero = _is_zero(sb)
    y = x * jnp.where(zero, jnp.float32(0.0), s_enc / jnp.where(zero, 1.0, sb))
    y = jnp.where(is_finite(a), y, jnp.float32(jnp.nan))
    q = round_elements(y, _E2M1, rounding, key)
    return QOperand(q, (jnp.float32(1.0) / s_enc).reshape(1, 1, 1), sb), sb, s_enc


def hadamard_matrix(seed: int, n: int = 16) -> np.ndarray:
    """The random Hadamard transform ``diag(signs) @ H_n / sqrt(n)`` (orthogonal, float32):
    Sylvester's H_n and n random signs from ``numpy.random.default_rng(seed)``."""
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=n)
    return (signs[:, None] * h / np.sqrt(n)).astype(np.float32)


def apply_hadamard(x: jax.Array, mat: np.ndarray | jax.Array) -> jax.Array:
    """Blocks of ``n`` along the last axis times the (n, n) matrix (float32, HIGHEST)."""
    n = mat.shape[0]
    g = blocks_1d(x, n)
    out = jnp.einsum(
        "...j,jk->...k", g, jnp.asarray(mat, jnp.float32), precision=lax.Precision.HIGHEST
    )
    return out.reshape(x.shape)
