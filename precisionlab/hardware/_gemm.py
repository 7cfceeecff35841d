"""``gemm`` and ``dot_general``: what a device's tensor cores and library return, exactly."""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from precisionlab.hardware import _block, _wide
from precisionlab.hardware import _kernel as _k
from precisionlab.hardware._presets import Resolved, resolve
from precisionlab.hardware._presets import preset as _preset
from precisionlab.hardware._profiles import check_inputs
from precisionlab.hardware._schedule import Schedule
from precisionlab.hardware._step import Step

__all__ = ["BATCHED_GEMM_DIMS", "MEMORY_BUDGET", "check_gemm_size", "dot_general", "gemm"]

#: ``dot_general`` dimension numbers of a batched GEMM of (B, M, K) by (B, N, K) operands, both
#: contracting their last axis: the layout of a recipe's canonical operands and of a
#: convolution's patches and kernel rows (:class:`~precisionlab.hardware.ConvGemm`).
BATCHED_GEMM_DIMS = (((2,), (2,)), ((0,), (0,)))

EIGHT = ("float8_e4m3fn", "float8_e5m2")
_SIXTEEN = ("float16", "bfloat16")
_FOUR = ("float4_e2m1fn",)
_SIX = ("float6_e2m3fn", "float6_e3m2fn")  # no JAX dtype: operands are uint8 codes
_F8F6F4 = (*EIGHT, *_SIX, *_FOUR)
_OUT = ("float32", "float16", "bfloat16")


def _kind(na: str, nb: str) -> str:
    """The tensor-core kind of an ``na`` x ``nb`` GEMM (element format names)."""
    if na in EIGHT and nb in EIGHT:
        return "fp8"
    if na in _SIXTEEN and na == nb:
        return "16bit"
    if na in _FOUR and nb in _FOUR:
        return "fp4"
    if na in _F8F6F4 and nb in _F8F6F4:
        return "f8f6f4"  # FP6 on either side, or FP4 mixed with FP8/FP6
    raise ValueError(
        f"unsupported operand formats {na} x {nb}; supported: 8-bit "
        f"({' or '.join(EIGHT)}, mixed allowed), 16-bit ({' or '.join(_SIXTEEN)}, both the "
        f"same), 4-bit ({_FOUR[0]}, with block scales), or FP6 ({' or '.join(_SIX)}, uint8 "
        "codes with a_format/b_format) and FP4 mixed with any 8- or 6-bit format (Blackwell's "
        "f8f6f4)"
    )


#: Bytes of working memory one :func:`gemm` call may need (its decoded operands, padded to
#: the schedule's K, and one step's temporaries), as estimated by :func:`check_gemm_size`: a
#: larger call (huge M, N or K, or overrides such as ``products=2**30``, ``split_k=2**40``)
#: is a ValueError before anything is allocated, not an out-of-memory error inside XLA.
MEMORY_BUDGET = 8 << 30

#: The widest code of each format given as integer codes (``a_format``/``b_format``).
_WIDTH = {"float8_e4m3fn": 8, "float8_e5m2": 8, "float6_e2m3fn": 6, "float6_e3m2fn": 6,
          "float4_e2m1fn": 4}  # fmt: skip


@functools.cache
def _code_values(fmt: str) -> np.ndarray:
    """float32 value of every code of ``fmt`` (NaN, inf, zeros and subnormals included), by
    ml_dtypes: what an array of that dtype holds for the code."""
    dt = np.dtype(getattr(ml_dtypes, fmt))
    codes = np.arange(1 << _WIDTH[fmt], dtype=np.uint8)
    return codes.view(dt).astype(np.float32)


def _concrete(x: ArrayLike) -> np.ndarray | None:
    """``x`` as numpy when it has a value now (not a tracer under jit or vmap), else None."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def as_operand(
    x: ArrayLike, fmt: str | None, which: str
) -> tuple[jax.Array, str, jax.Array | None]:
    """``x`` as a JAX array, its element format name, and (integer codes under a trace only)
    the mask of codes out of the format's range, whose outputs become NaN. A numpy array of an
    FP6 dtype (ml_dtypes; JAX has none) becomes its uint8 codes. Integer codes need ``fmt``:
    FP8 and FP4 codes become arrays of that dtype (decoded exactly as such an array: NaN,
    inf, zeros, subnormals); FP6 codes stay codes. A code past the format's width is a
    ValueError (when ``x`` has a value now)."""
    dt = getattr(x, "dtype", None)
    if dt is not None and np.dtype(dt).name in _SIX and not isinstance(x, jax.Array):
        name = np.dtype(dt).name
        if fmt not in (None, name):
            raise ValueError(f"{which}_format={fmt!r} but {which} holds {name} values")
        return jnp.asarray(np.asarray(x).view(np.uint8)), name, None
    x = jnp.asarray(x)
    if fmt is None:
        if jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{which} holds integers ({x.dtype}): pass {which}_format, the "
                             f"format of its codes (one of {', '.join(_F8F6F4)})")  # fmt: skip
        return x, jnp.dtype(x.dtype).name, None
    if fmt not in _F8F6F4:
        raise ValueError(f"unknown {which}_format {fmt!r}; allowed: {', '.join(_F8F6F4)}")
    if x.dtype not in (jnp.uint8, jnp.uint16):
        raise ValueError(f"{which}_format={fmt!r} takes {which} as unsigned integer codes "
                         f"(uint8 or uint16); got {x.dtype}")  # fmt: skip
    top = 1 << _WIDTH[fmt]
    now = _concrete(x)
    bad = None
    if now is not None:
        over = now >= top
        if over.any():
            first = int(now[over].flat[0])
            raise ValueError(
                f"{which} holds code {first:#x}, out of {fmt}'s range 0..{top - 1:#x} "
                f"({_WIDTH[fmt]}-bit codes; {int(over.sum())} such codes)"
            )
    wide = x.astype(jnp.int32)  # a uint8 compared with 256 would wrap the 256
    if now is None:
        bad = wide >= top
    code = jnp.where(wide >= top, 0, wide).astype(jnp.uint8)
    if fmt in _SIX:
        return code, fmt, bad
    if fmt in _FOUR:  # no 4-bit bitcast from a byte: through the exact values
        table = jnp.asarray(_code_values(fmt))
        return table[code.astype(jnp.int32)].astype(jnp.dtype(fmt)), fmt, bad
    return lax.bitcast_convert_type(code, jnp.dtype(fmt)), fmt, bad


def _values(x: jax.Array, fmt: str) -> jax.Array:
    """float32 values of ``x`` (values of ``fmt``, or its integer codes), exact."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        return x.astype(jnp.float32)
    return jnp.asarray(_code_values(fmt))[x.astype(jnp.int32)]


def check_gemm_size(
    m: int, k: int, n: int, *, products: int = 32, restart_every: int | None = None,
    split_k: int | None = None, batch: int = 1,
) -> int:  # fmt: skip
    """The bytes of working memory a ``(m, k) x (k, n)`` :func:`gemm` (``batch`` of them under
    :func:`dot_general`) needs at most for steps of ``products`` under that schedule; a
    ValueError naming the sizes when that exceeds :data:`MEMORY_BUDGET` or K < 1."""
    if k < 1:
        raise ValueError(f"K = {k}: a GEMM needs at least one product per output (K >= 1)")
    unit = restart_every or products
    kp = max(-(-k // 32) * 32, -(-k // unit) * unit)
    if split_k:
        kp = max(kp, -(-k // split_k) * split_k)
    need = 4 * batch * (6 * (m + n) * kp + 8 * products * m * n + 4 * m * n)
    if need > MEMORY_BUDGET:
        raise ValueError(
            f"a {m} x {k} x {n} GEMM"
            + (f" (x{batch})" if batch > 1 else "")
            + f" with {products}-product steps"
            + (f", restart_every={restart_every}" if restart_every else "")
            + (f", split_k={split_k}" if split_k else "")
            + f" needs about {need / 2**30:.3g} GiB of working memory; the model's budget is "
            f"{MEMORY_BUDGET / 2**30:.3g} GiB (hardware.MEMORY_BUDGET): use smaller sizes"
        )
    return need


def chain_all(
    a: jax.Array,
    b: jax.Array,
    res: Resolved,
    a_off: jax.Array | None = None,
    b_off: jax.Array | None = None,
    fa: str | None = None,
    fb: str | None = None,
    init: jax.Array | None = None,
) -> jax.Array:
    """float32 accumulators of ``a`` (M, K) x ``b`` (K, N) under ``res``; ``a_off`` (M, K) and
    ``b_off`` (K, N): int32 exponent offsets (MX block scales) or None; ``fa``/``fb``: the
    element formats (default: the dtypes; needed for integer codes); ``init``: float32
    (M, N) accumulator the first step starts from (one chain only; default zero)."""
    step, sch = res.step, res.schedule
    if sch.upcast:
        a, b = a.astype(sch.upcast), b.astype(sch.upcast)
        fa = fb = None
    if sch.k_order == "fp8_pairs":
        a, b = _fp8_pairs(a, b, step, sch, a_off is not None)
    m, kk = a.shape
    n = b.shape[1]
    w = step.products
    fa, fb = fa or jnp.dtype(a.dtype).name, fb or jnp.dtype(b.dtype).name
    pa, pb = _k.INPUT_FORMATS[fa][0], _k.INPUT_FORMATS[fb][0]
    flush = step.subnormal_inputs == "flush"
    split = sch.split_k if (sch.split_k and kk >= sch.split_k_min_k) else None
    block = sch.restart_every
    unit = block or w
    if unit % w:
        raise ValueError(f"restart_every={block} is not a multiple of the step's {w} products")
    if split and split % unit:
        raise ValueError(f"split_k={split} is not a multiple of {unit} (restart/step width)")
    slice_w = split or unit * max(1, math.ceil(kk / unit))
    nslices = max(1, math.ceil(kk / slice_w))
    if sch.split_order != "sequential" and nslices != 2 ** len(sch.split_order):
        raise ValueError(
            f"split_order {sch.split_order} needs {2 ** len(sch.split_order)} slices, K={kk} "
            f"with split_k={split} gives {nslices}"
        )
    block_w = block or slice_w
    nblocks = slice_w // block_w
    if init is not None and nslices * nblocks != 1:
        raise ValueError("an initial accumulator is modelled for one chain over K only")
    nsteps = block_w // w
    kp = nslices * slice_w
    a = jnp.pad(a, ((0, 0), (0, kp - kk)))
    b = jnp.pad(b, ((0, kp - kk), (0, 0)))
    am, ae = _k.decode(a, _k.shift_for(step, pa, pb), flush, fa)
    bm, be = _k.decode(b, 0, flush, fb)
    if a_off is not None:
        assert b_off is not None  # block scales come in pairs (_check_blocks)
        ae = ae + jnp.pad(a_off, ((0, 0), (0, kp - kk)))
        be = be + jnp.pad(b_off, ((0, kp - kk), (0, 0)))

    # (nslices, nblocks, nsteps, w, M or N): slices, then blocks, then steps, run in order
    def lay(x: jax.Array, r: int) -> jax.Array:
        x = x.reshape(r, nslices, nblocks, nsteps, w)
        return jnp.transpose(x, (1, 2, 3, 4, 0))

    am, ae = lay(am, m)[..., :, None], lay(ae, m)[..., :, None]
    bm, be = lay(bm.T, n)[..., None, :], lay(be.T, n)[..., None, :]
    zero = jnp.zeros((m, n), jnp.float32)
    start = zero if init is None else init

    apply: Callable[..., jax.Array] = (
        _wide.step_apply if step.fraction_bits > _k.MAX_F else _k.step_apply
    )

    def one_step(c: jax.Array, x: tuple) -> tuple[jax.Array, None]:
        return apply(*x, c, step, pa, pb), None

    def one_block(total: jax.Array, x: tuple) -> tuple[jax.Array, None]:
        c, _ = lax.scan(one_step, start, x)
        # restart: the block's chain is added into a float32 register, rounded to nearest
        return (c if nblocks == 1 else total + c), None

    def one_slice(_: None, x: tuple) -> tuple[None, jax.Array]:
        total, _ = lax.scan(one_block, zero, x)
        return None, total

    _, acc = lax.scan(one_slice, None, (am, ae, bm, be))
    return _reduce_slices(acc, sch)


def _fp8_pairs(
    a: jax.Array, b: jax.Array, step: Step, sch: Schedule, scaled: bool
) -> tuple[jax.Array, jax.Array]:
    """``a`` (M, K) and ``b`` (K, N) reordered along K as ``k_order="fp8_pairs"`` takes them
    (:mod:`~precisionlab.hardware._schedule`): K zero-padded to a multiple of 32, then in each
    32-k block the k with ``k % 4`` in {0, 1} first, those in {2, 3} second."""
    if step.products != 16 or scaled:
        raise ValueError(
            "k_order='fp8_pairs' is modelled for 16-product steps without block scales "
            f"(FP8 upcast to float16); got {step.products} products"
            + (" with block scales" if scaled else "")
            + "; pass k_order='natural'"
        )
    for name in ("restart_every", "split_k"):
        v = getattr(sch, name)
        if v is not None and v % 32:
            raise ValueError(f"k_order='fp8_pairs' needs {name} to be a multiple of 32, got {v}")
    (m, kk), n = a.shape, b.shape[1]
    kp = -(-kk // 32) * 32
    a = jnp.pad(a, ((0, 0), (0, kp - kk))).reshape(m, kp // 32, 8, 2, 2)
    b = jnp.pad(b, ((0, kp - kk), (0, 0))).reshape(kp // 32, 8, 2, 2, n)
    # axes (block, k // 4 % 8, k // 2 % 2, k % 2): the pair half moves ahead of the quad
    a = jnp.transpose(a, (0, 1, 3, 2, 4)).reshape(m, kp)
    b = jnp.transpose(b, (0, 2, 1, 3, 4)).reshape(kp, n)
    return a, b


def _reduce_slices(acc: jax.Array, sch: Schedule) -> jax.Array:
    if acc.shape[0] == 1:
        return acc[0]
    if sch.split_order == "sequential":
        out, _ = lax.scan(lambda s, x: (s + x, None), acc[0], acc[1:])
        return out
    bits = sch.split_order
    assert not isinstance(bits, str)  # Schedule takes no other string than "sequential"
    nb = len(bits)
    x = acc.reshape((2,) * nb + acc.shape[1:])  # axis j holds bit nb - 1 - j
    for bit in bits:
        ax = nb - 1 - bit
        x = lax.index_in_dim(x, 0, ax) + lax.index_in_dim(x, 1, ax)
    return x.reshape(acc.shape[1:])


def specials(
    a: jax.Array,
    b: jax.Array,
    acc: jax.Array,
    fa: str | None = None,
    fb: str | None = None,
    init: jax.Array | None = None,
) -> jax.Array:
    """The outputs the special inputs decide, whatever the order of the sum (the step model
    covers finite values): NaN where a product is NaN (a NaN input, or an infinity times a
    zero) or where +inf and -inf products (with ``init``, the accumulator going in, if any)
    meet; +-inf where the infinite products agree; elsewhere ``acc``, the chain's value, which
    overflows to inf by itself where the chain's own sums do (in its order)."""
    fa, fb = fa or jnp.dtype(a.dtype).name, fb or jnp.dtype(b.dtype).name
    if fa in _SIX + _FOUR and fb in _SIX + _FOUR and init is None:
        return acc  # FP6 and FP4 have no inf or NaN
    va, vb = _values(a, fa), _values(b, fb)

    def meet(
        left: list[jax.Array], right: list[jax.Array]
    ) -> jax.Array:  # any k with left[i, k] and right[k, j]: a 0/1 matmul, exact > 0
        lhs = jnp.concatenate([x.astype(jnp.float32) for x in left], axis=1)
        rhs = jnp.concatenate([x.astype(jnp.float32) for x in right], axis=0)
        return jnp.matmul(lhs, rhs, precision=lax.Precision.HIGHEST) > 0

    inf_a, inf_b = jnp.isinf(va), jnp.isinf(vb)
    a_pos, a_neg, b_pos, b_neg = va > 0, va < 0, vb > 0, vb < 0
    a_pinf, a_ninf, b_pinf, b_ninf = inf_a & a_pos, inf_a & a_neg, inf_b & b_pos, inf_b & b_neg
    nan = jnp.any(jnp.isnan(va), axis=1)[:, None] | jnp.any(jnp.isnan(vb), axis=0)[None, :]
    nan = nan | meet([inf_a, va == 0], [vb == 0, inf_b])
    pos = meet([a_pinf, a_ninf, a_pos, a_neg], [b_pos, b_neg, b_pinf, b_ninf])
    neg = meet([a_pinf, a_ninf, a_pos, a_neg], [b_neg, b_pos, b_ninf, b_pinf])
    if init is not None:
        nan = nan | jnp.isnan(init)
        pos, neg = pos | (init == jnp.inf), neg | (init == -jnp.inf)
    out = jnp.where(pos, jnp.float32(jnp.inf), acc)
    out = jnp.where(neg, jnp.float32(-jnp.inf), out)
    return jnp.where(nan | (pos & neg), jnp.float32(jnp.nan), out)


def poison(out: jax.Array, bad_a: jax.Array | None, bad_b: jax.Array | None) -> jax.Array:
    """NaN in every output whose row of ``a`` or column of ``b`` holds an out-of-range code
    (masks from :func:`as_operand`; None: none possible)."""
    if bad_a is not None:
        out = jnp.where(jnp.any(bad_a, axis=1)[:, None], jnp.float32(jnp.nan), out)
    if bad_b is not None:
        out = jnp.where(jnp.any(bad_b, axis=0)[None, :], jnp.float32(jnp.nan), out)
    return out


def _check_blocks(
    a: jax.Array, b: jax.Array, bsa: jax.Array | None, bsb: jax.Array | None, kind: str
) -> int:
    """Validate block scales against the operands; the block size (elements per scale)."""
    if bsa is None or bsb is None:
        raise ValueError("block-scaled GEMMs need both block_scale_a and block_scale_b")
    if kind == "16bit":
        raise ValueError("block scales apply to FP8 (MXFP8) and float4_e2m1fn (MXFP4, NVFP4) "
                         "operands, not 16-bit ones")  # fmt: skip
    (m, kk), n = a.shape, b.shape[1]
    names = {jnp.dtype(x.dtype).name for x in (bsa, bsb)}
    known = ", ".join(_block.SCALE_FORMATS)
    if len(names) != 1 or not names <= set(_block.SCALE_FORMATS):
        raise ValueError(f"block scales must share one dtype of {known}; got {sorted(names)}")
    name = names.pop()
    if bsa.ndim != 2 or bsb.ndim != 2 or bsa.shape[1] == 0 or kk % bsa.shape[1]:
        raise ValueError(f"block_scale_a must be (M, K / block) with K={kk}; got {bsa.shape}")
    block = kk // bsa.shape[1]
    if bsa.shape != (m, kk // block) or bsb.shape != (kk // block, n):
        raise ValueError(
            f"block scales must be ({m}, {kk // block}) and ({kk // block}, {n}) for a "
            f"{a.shape} x {b.shape} GEMM; got {bsa.shape} and {bsb.shape}"
        )
    allowed = {("fp4", "float8_e8m0fnu"): (16, 32), ("fp4", "float8_e4m3fn"): (16,),
               ("fp8", "float8_e8m0fnu"): (32,),
               ("f8f6f4", "float8_e8m0fnu"): (32,)}.get((kind, name), ())  # fmt: skip
    if block not in allowed:
        raise ValueError(
            f"{kind} operands with {name} scales: block size {block} is not supported; "
            "supported: MXFP4 (E8M0, 32 or 16), NVFP4 (float8_e4m3fn as UE4M3, 16), "
            "MXFP8 and MXFP6 (E8M0, 32)"
        )
    return block


@partial(jax.jit, static_argnames=("device", "library", "fast_accumulation", "out_dtype", "ov",
                                   "fa", "fb"))  # fmt: skip
def _gemm(
    a: jax.Array,
    b: jax.Array,
    scale_a: ArrayLike | None,
    scale_b: ArrayLike | None,
    bias: ArrayLike | None,
    bsa: jax.Array | None,
    bsb: jax.Array | None,
    bad_a: jax.Array | None,
    bad_b: jax.Array | None,
    *,
    device: str,
    library: str,
    fast_accumulation: bool,
    out_dtype: str,
    ov: tuple,
    fa: str,
    fb: str,
) -> jax.Array:
    kind = _kind(fa, fb)  # gemm checked the call; this is the traced body
    res = resolve(device, library, fast_accumulation, kind, dict(ov), a.shape[1])
    if kind == "fp4":
        assert bsa is not None and bsb is not None  # gemm refuses FP4 without block scales
        acc = _block.chain_fp4(a, b, bsa, bsb, res.step)
    elif bsa is not None:
        assert bsb is not None  # block scales come in pairs (_check_blocks)
        block = a.shape[1] // bsa.shape[1]
        a_off, nan_a = _block.exponent_offsets(bsa, block, axis=1)
        b_off, nan_b = _block.exponent_offsets(bsb, block, axis=0)
        acc = specials(a, b, chain_all(a, b, res, a_off, b_off, fa, fb), fa, fb)
        nan = jnp.any(nan_a, axis=1)[:, None] | jnp.any(nan_b, axis=0)[None, :]
        acc = jnp.where(nan, jnp.float32(jnp.nan), acc)
    else:
        acc = specials(a, b, chain_all(a, b, res, fa=fa, fb=fb), fa, fb)
    if scale_a is not None or scale_b is not None:
        sa = jnp.float32(1) if scale_a is None else jnp.asarray(scale_a, jnp.float32)
        sb = jnp.float32(1) if scale_b is None else jnp.asarray(scale_b, jnp.float32)
        acc = acc * (sa * sb)
    if bias is not None:
        acc = acc + jnp.asarray(bias, jnp.float32)
    return poison(acc, bad_a, bad_b).astype(out_dtype)


def gemm(
    a: ArrayLike, b: ArrayLike, device: str = "h100", library: str = "cublaslt",
    fast_accumulation: bool = True, out_dtype: DTypeLike = jnp.float32, *,
    scale_a: ArrayLike | None = None, scale_b: ArrayLike | None = None,
    bias: ArrayLike | None = None, block_scale_a: ArrayLike | None = None,
    block_scale_b: ArrayLike | None = None, a_format: str | None = None,
    b_format: str | None = None, **overrides: Any,
) -> jax.Array:  # fmt: skip
    """``a @ b`` as ``device``'s tensor cores under ``library`` compute it, bit for bit.

    a: (M, K), b: (K, N), 8-bit (float8_e4m3fn / float8_e5m2, mixed allowed) or 16-bit
    (float16 or bfloat16, both the same). ``scale_a``/``scale_b``: float32 scalars
    (``torch._scaled_mm``'s per-tensor scales); ``bias``: (N,) added in float32;
    ``out_dtype``: float32, float16 or bfloat16 (rounded to nearest even).
    ``block_scale_a`` (M, K / block), ``block_scale_b`` (K / block, N): block scales inside
    the contraction (Blackwell): float4_e2m1fn operands with float8_e8m0fnu scales (MXFP4,
    block 32 or 16) or float8_e4m3fn scales read as UE4M3 (NVFP4, block 16) run the
    ``kind::mxf4nvf4`` step (K a multiple of 64); FP8 operands with E8M0 scales per 32
    (MXFP8) run the f8f6f4 step with the scales' exponents added.
    FP6 (Blackwell's ``kind::f8f6f4``, device b200): JAX has no FP6 dtype, so pass uint8
    codes with ``a_format``/``b_format`` ``"float6_e2m3fn"`` or ``"float6_e3m2fn"`` (or numpy
    arrays of the ml_dtypes FP6 dtypes, converted here); FP6 may meet FP6, FP8 or FP4, and
    FP4 may meet FP8 (``float4_e2m1fn`` arrays), with E8M0 scales per 32 (MXFP6) or none.
    That profile extends MMA-Sim's f8f6f4 model to FP6 (``PROFILES["b200/f8f6f4"].note``).
    ``library="xla"`` on an h100 takes XLA's split-K by K (:func:`xla_split`);
    ``library="deepgemm"`` (FP8 on h100 only) DeepGEMM's chain restarted every 128 with unit
    scales (the blockwise recipe adds its scales, ``precisionlab.recipes``).
    ``overrides``: any :class:`Step` or :class:`Schedule` field (``fraction_bits=12``,
    ``restart_every=64``, ``split_k=None``, ...). Pure and jittable; works under ``vmap``.
    Unknown device, library, dtypes or override: ``ValueError`` listing what exists.

    Example:
      An H100 FP8 step aligns its products to the largest exponent (448: 2**8) with 13 fraction
      bits and cuts the rest: 2**-7 lies below 2**(8 - 13) and is lost. A B200 keeps 25 bits.

      >>> import jax.numpy as jnp
      >>> from precisionlab.hardware import gemm
      >>> a = jnp.array([[448.0, 2.0**-7]], jnp.float8_e4m3fn)
      >>> b = jnp.ones((2, 1), jnp.float8_e4m3fn)
      >>> gemm(a, b, "h100").tolist()
      [[448.0]]
      >>> gemm(a, b, "b200").tolist()
      [[448.0078125]]
    """
    a, fa, bad_a = as_operand(a, a_format, "a")
    b, fb, bad_b = as_operand(b, b_format, "b")
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm needs a (M, K) and b (K, N); got {a.shape} and {b.shape}")
    kind = _kind(fa, fb)
    bsa = None if block_scale_a is None else jnp.asarray(block_scale_a)
    bsb = None if block_scale_b is None else jnp.asarray(block_scale_b)
    if bsa is not None or bsb is not None:
        _check_blocks(a, b, bsa, bsb, kind)
    elif kind == "fp4":
        raise ValueError("float4_e2m1fn operands need block_scale_a and block_scale_b "
                         "(MXFP4: float8_e8m0fnu; NVFP4: float8_e4m3fn)")  # fmt: skip
    od = jnp.dtype(out_dtype).name
    if od not in _OUT:
        raise ValueError(f"unsupported out_dtype {od}; supported: {', '.join(_OUT)}")
    ov = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items()))
    # resolve eagerly, so that errors surface here with their message
    res = resolve(device, library, fast_accumulation, kind, dict(ov), a.shape[1])
    check_inputs(res.profile.device, kind, (fa, fb), "gemm")
    sch = res.schedule
    split = sch.split_k if a.shape[1] >= sch.split_k_min_k else None
    check_gemm_size(a.shape[0], a.shape[1], b.shape[1], products=res.step.products,
                    restart_every=sch.restart_every, split_k=split)  # fmt: skip
    if res.step.fraction_bits > 64:
        raise ValueError(f"fraction_bits={res.step.fraction_bits}: at most 64 are modelled")
    if kind == "f8f6f4" and res.schedule.upcast:
        raise ValueError(f"upcast={res.schedule.upcast!r} is not modelled for {fa} x {fb} "
                         "operands (Blackwell's f8f6f4 step takes them as they are)")  # fmt: skip
    if kind == "fp4":
        if res.schedule != Schedule():
            raise ValueError(f"block-scaled FP4 runs one chain over K; schedule {res.schedule} "
                             "is not modelled for it")  # fmt: skip
        if a.shape[1] % res.step.products:
            raise ValueError(f"block-scaled FP4 needs K a multiple of the instruction's "
                             f"{res.step.products}; got K={a.shape[1]}")  # fmt: skip
    return _gemm(a, b, scale_a, scale_b, bias, bsa, bsb, bad_a, bad_b, device=device,
                 library=library,
                 fast_accumulation=bool(fast_accumulation), out_dtype=od, ov=ov, fa=fa,
                 fb=fb)  # fmt: skip


def dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, *, preset: str | None = None,
    device: str = "h100", library: str = "cublaslt", fast_accumulation: bool = True,
    out_dtype: DTypeLike = jnp.float32, **overrides: Any,
) -> jax.Array:  # fmt: skip
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` computed by :func:`gemm`.

    Output layout as ``lax.dot_general``: batch dims, then lhs free dims, then rhs free dims.
    Contracting dims are flattened into one K (in their listed order), batch dims are mapped.
    ``preset`` (``"h100-cublaslt-fast"``, ``"h100-cublaslt"``, ``"h100-xla"``, an alias such
    as ``"h100-fast"``; see :data:`PRESETS`) sets device, library and fast_accumulation.
    ``out_dtype`` plays ``preferred_element_type``'s part.
    """
    if preset is not None:
        kw = _preset(preset)
        device, library, fast_accumulation = kw["device"], kw["library"], kw["fast_accumulation"]
    overrides = dict(overrides)
    for key, x in (("a_format", lhs), ("b_format", rhs)):  # FP6 numpy arrays: their codes
        name = np.dtype(getattr(x, "dtype", np.float32)).name
        if name in _SIX and not isinstance(x, jax.Array):
            if overrides.get(key, name) != name:
                raise ValueError(f"{key}={overrides[key]!r} but the operand holds {name} values")
            overrides[key] = name
    lhs, rhs = (
        jnp.asarray(np.asarray(x).view(np.uint8)) if k in overrides and
        np.dtype(getattr(x, "dtype", np.float32)).name in _SIX else jnp.asarray(x)
        for k, x in (("a_format", lhs), ("b_format", rhs))
    )  # fmt: skip
    lc, rc, lb, rb = _dimensions(dimension_numbers, lhs.shape, rhs.shape)
    for x, key, which in ((lhs, "a_format", "lhs"), (rhs, "b_format", "rhs")):
        if overrides.get(key) is not None:  # codes checked now, before vmap hides their values
            as_operand(x, overrides[key], which)
    lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    bshape = tuple(lhs.shape[d] for d in lb)
    lfs = tuple(lhs.shape[d] for d in lf)
    rfs = tuple(rhs.shape[d] for d in rf)
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    bsz = int(np.prod(bshape, dtype=np.int64))
    m, n = int(np.prod(lfs, dtype=np.int64)), int(np.prod(rfs, dtype=np.int64))
    check_gemm_size(m, k, n, batch=bsz)
    if bsz == 0 or m == 0 or n == 0:  # no output: nothing to compute
        return jnp.zeros(bshape + lfs + rfs, jnp.dtype(out_dtype))
    a3 = jnp.transpose(lhs, (*lb, *lf, *lc)).reshape(bsz, -1, k)
    b3 = jnp.transpose(rhs, (*rb, *rc, *rf)).reshape(bsz, k, -1)

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return gemm(a, b, device=device, library=library, fast_accumulation=fast_accumulation,
                    out_dtype=out_dtype, **overrides)  # fmt: skip

    y = jax.vmap(f)(a3, b3)
    return y.reshape(bshape + lfs + rfs)


def _dimensions(
    dimension_numbers: Any, lshape: Sequence[int], rshape: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """``(lc, rc, lb, rb)`` of ``dimension_numbers`` ``((lc, rc), (lb, rb))``; ValueError
    unless each is a sequence of distinct in-range axes, paired axes have equal sizes, and an
    axis is contracting or batch, not both."""
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        lc, rc, lb, rb = (tuple(operator.index(d) for d in x) for x in (lc, rc, lb, rb))
    except (TypeError, ValueError):
        raise ValueError(
            "dimension_numbers must be ((lhs_contracting, rhs_contracting), (lhs_batch, "
            f"rhs_batch)), each a sequence of axes; got {dimension_numbers!r}"
        ) from None
    for dims, shape, what in ((lc + lb, lshape, "lhs"), (rc + rb, rshape, "rhs")):
        bad = [d for d in dims if not 0 <= d < len(shape)]
        if bad or len(set(dims)) != len(dims):
            raise ValueError(
                f"dot_general: {what} axes {dims} must be distinct and in 0..{len(shape) - 1} "
                f"for its shape {tuple(shape)}"
            )
    for left, right, what in ((lc, rc, "contracting"), (lb, rb, "batch")):
        if len(left) != len(right) or any(
            lshape[i] != rshape[j] for i, j in zip(left, right, strict=True)
        ):
            raise ValueError(
                f"dot_general: {what} axes {left} of lhs {tuple(lshape)} and {right} of rhs "
                f"{tuple(rshape)} must pair axes of equal sizes"
            )
    return lc, rc, lb, rb
