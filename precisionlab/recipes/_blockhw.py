"""Block-scaled recipes (MX, NVFP4) on a hardware preset: Blackwell's block-scaled MMA.

A recipe with block scales inside the contraction hands the tensor core its quantized
elements and its block scales, as cuBLASLt does on Blackwell (``tcgen05.mma`` with
``block_scale``), instead of multiplying dequantized float32 values:

- MX recipes: elements in their format (``float8_e4m3fn``/``float8_e5m2``: MXFP8,
  ``float6_e2m3fn``/``float6_e3m2fn``: MXFP6, as uint8 codes since JAX has no FP6 dtype, or
  ``float4_e2m1fn``: MXFP4; FP4 or FP6 against FP8 gradients: the mixed ``kind::f8f6f4``),
  the scale ``X = 2**e`` of each ``block`` elements along K as its E8M0 code ``e + 127``
  (the recipe clamps ``e`` to E8M0's -127..127, so the code is exact);
- NVFP4: E2M1 elements and each 16-block's E4M3 scale ``sb`` as UE4M3 (``sb >= 0``: the same
  code); weights' 16 x 16 tiles are 16-blocks along K whose scale repeats over 16 rows. The
  per-tensor float32 scale is no MMA input: the float32 accumulator is multiplied by
  ``fl32(1/s_enc_a * 1/s_enc_b)`` afterwards, cuBLASLt's ``alpha`` (``hw.gemm``'s
  ``scale_a``/``scale_b`` do the same).

Every GEMM of :mod:`precisionlab.recipes._dot` (fprop, dgrad, wgrad) quantizes its operands
along its own contraction axis (transposed copies are quantized from the high-precision
tensors), so the blocks always run along K, as the MMA needs. A block holding NaN (the recipe
poisons blocks with a non-finite input) gets the NaN scale code (E8M0 0xFF, UE4M3 0x7F) and
zero elements: the MMA returns NaN in that row or column, as the float path does. FP4
steps take 64 products: K is padded to a multiple of 64 with zero elements and zero scale
bytes (what a TMA load fills out of bounds).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab import hardware as hw
from precisionlab.bits import encode
from precisionlab.recipes._scaling import QOperand

__all__ = [
    "ELEMENT_PAIRS", "block_gemm", "block_presets", "check_pairs", "device_error",
    "hardware_operand",
]  # fmt: skip

_FP8 = ("float8_e4m3fn", "float8_e5m2")
_FP6 = ("float6_e2m3fn", "float6_e3m2fn")
_FP4 = "float4_e2m1fn"
#: What the modelled block-scaled MMA takes: (pair kind, scale format) -> block sizes. Pair
#: kinds: "fp8" (FP8 x FP8), "fp4" (E2M1 x E2M1, ``kind::mxf4nvf4``), "f8f6f4" (FP6 on a
#: side, or FP4 against FP8/FP6: ``kind::mxf8f6f4``).
ELEMENT_PAIRS = {
    ("fp8", "float8_e8m0fnu"): (32,),
    ("f8f6f4", "float8_e8m0fnu"): (32,),
    ("fp4", "float8_e8m0fnu"): (32, 16),
    ("fp4", "float8_e4m3fn"): (16,),
}
SUPPORTED = (
    "MXFP8 (float8_e4m3fn/float8_e5m2 elements, E8M0 scales per 32), MXFP6 (float6_e2m3fn/"
    "float6_e3m2fn, E8M0 per 32; also against FP8 or FP4), MXFP4 (float4_e2m1fn, E8M0 per 32 "
    "or 16; per 32 also against FP8 or FP6) and NVFP4 (float4_e2m1fn, UE4M3 per 16)"
)
_NAN_CODE = {"float8_e8m0fnu": 0xFF, "float8_e4m3fn": 0x7F}


def block_presets() -> tuple[str, ...]:
    """Hardware presets (names, then aliases) whose device has a block-scaled MMA."""
    devs = {p.device for p in hw.PROFILES.values() if p.kind == "fp4" and p.step is not None}
    names = [n for n, (d, _, _) in hw.PRESETS.items() if d in devs]
    return (*names, *(a for a, t in hw.PRESET_ALIASES.items() if t in names))


def device_error(recipe_name: str, acc: str, what: str) -> ValueError | None:
    """The error for a block recipe on a preset whose device has no block-scaled MMA, or
    None where it has one."""
    works = block_presets()
    if hw.canonical_preset(acc) in works:
        return None
    dev = hw.PRESETS[hw.canonical_preset(acc)][0]
    return ValueError(
        f"accumulate={acc!r}: the {recipe_name} recipe scales {what} inside the contraction, "
        f"which only a block-scaled MMA computes; {dev} has none (block scales are "
        f"Blackwell's tcgen05.mma). Presets that work: {', '.join(works)}"
    )


def _pair_kind(fa: str, fb: str) -> str | None:
    """The MMA kind of an ``fa`` x ``fb`` element pairing (see :data:`ELEMENT_PAIRS`)."""
    if fa in _FP8 and fb in _FP8:
        return "fp8"
    if fa == fb == _FP4:
        return "fp4"
    known = (*_FP8, *_FP6, _FP4)
    return "f8f6f4" if fa in known and fb in known else None


def check_pairs(
    recipe_name: str, acc: str, pairs: Iterable[tuple[str, str, str]], scale: str, block: int
) -> None:
    """ValueError unless every (label, lhs format, rhs format) of ``pairs`` is an element
    pairing the modelled MMA takes with ``scale`` blocks of ``block``."""
    sname = "E8M0" if scale == "float8_e8m0fnu" else "UE4M3"
    for label, fa, fb in pairs:
        kind = _pair_kind(fa, fb)
        blocks = ELEMENT_PAIRS.get((kind, scale), ()) if kind is not None else ()
        if block not in blocks:
            raise ValueError(
                f"accumulate={acc!r}: the {recipe_name} recipe's {label} multiplies {fa} x {fb} "
                f"elements with {sname} scales per {block}; Blackwell's block-scaled MMA (as "
                f"modelled, MMA-Sim) takes {SUPPORTED}"
            )


def _scale_codes(exp_or_value: jax.Array, scale: str, nan: jax.Array) -> jax.Array:
    """Block scales (B, R, K / block) in ``scale``'s dtype: E8M0 from int32 exponents, UE4M3
    from the (nonnegative, exact) float32 E4M3 values; NaN where ``nan``."""
    if scale == "float8_e8m0fnu":
        code = (jnp.clip(exp_or_value, -127, 127) + 127).astype(jnp.uint8)
    else:
        v = jnp.where(nan, jnp.float32(0), exp_or_value)
        code = lax.bitcast_convert_type(v.astype(jnp.float8_e4m3fn), jnp.uint8)
    code = jnp.where(nan, jnp.uint8(_NAN_CODE[scale]), code)
    return lax.bitcast_convert_type(code, jnp.dtype(scale))


def hardware_operand(
    q: QOperand, element: str, scale: str, block: int
) -> tuple[jax.Array, jax.Array]:
    """A quantized (B, R, K) operand (:class:`scaling.QOperand` with block scales) as the
    MMA's inputs: elements (B, R, K) of ``element`` (FP6: its uint8 codes) and scales
    (B, R, K / block) of ``scale`` (E8M0 from the operand's ``block_exp``, UE4M3 from its
    ``block_inv``)."""
    b, r, k = q.elems.shape
    nblk = k // block
    elems = q.elems.reshape(b, r, nblk, block)
    nan = jnp.any(jnp.isnan(elems), axis=-1)
    assert q.block_inv is not None  # an operand with block scales
    inv = jnp.broadcast_to(q.block_inv, q.elems.shape).reshape(b, r, nblk, block)[..., 0]
    nan = nan | jnp.isnan(inv)
    if scale == "float8_e8m0fnu":
        assert q.block_exp is not None  # E8M0 scales are powers of two
        src = jnp.broadcast_to(q.block_exp, q.elems.shape).reshape(b, r, nblk, block)[..., 0]
    else:
        src = inv
    codes = _scale_codes(src, scale, nan)
    e = jnp.where(jnp.isnan(q.elems), jnp.float32(0), q.elems)
    if element in _FP6:  # no JAX dtype: the codes (exact, the elements are on its grid)
        return encode(e.astype(jnp.float32), element), codes
    return e.astype(jnp.dtype(element)), codes


def _pad_k(e: jax.Array, s: jax.Array, mult: int, block: int) -> tuple[jax.Array, jax.Array]:
    pad = -e.shape[-1] % mult
    if not pad:
        return e, s
    e = jnp.pad(e, ((0, 0), (0, 0), (0, pad)))
    zero = lax.bitcast_convert_type(jnp.zeros((), jnp.uint8), s.dtype)
    s = jnp.concatenate([s, jnp.broadcast_to(zero, (*s.shape[:2], pad // block))], axis=-1)
    return e, s


def block_gemm(
    qa: QOperand, qb: QOperand, elements: tuple[str, str], scale: str, block: int, preset: str
) -> jax.Array:
    """float32 accumulators (B, M, N) of block-scaled ``qa`` (B, M, K) x ``qb`` (B, N, K) as
    ``preset``'s block-scaled MMA computes them (per-tensor / per-row factors not applied)."""
    ea, sa = hardware_operand(qa, elements[0], scale, block)
    eb, sb = hardware_operand(qb, elements[1], scale, block)
    if _pair_kind(*elements) == "fp4":
        step = hw.get_profile(hw.preset(preset)["device"], "fp4").step
        assert step is not None  # get_profile raised for a profile without one
        ea, sa = _pad_k(ea, sa, step.products, block)
        eb, sb = _pad_k(eb, sb, step.products, block)
    kw = hw.preset(preset)
    fa, fb = (f if f in _FP6 else None for f in elements)

    def one(a: jax.Array, b: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        return hw.gemm(a, b.T, block_scale_a=x, block_scale_b=y.T, a_format=fa, b_format=fb,
                       **kw)  # fmt: skip

    return jax.vmap(one)(ea, eb, sa, sb)
