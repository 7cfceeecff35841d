"""The quantized matmul: ``lax.dot_general``'s signature, three GEMMs quantized by a recipe.

Both operands are laid out as ``(B, R, K)`` (batch, kept rows, contraction last). With
``a`` (B, M, K), ``b`` (B, N, K) and the output gradient ``g`` (B, M, N):

- fprop ``y  = Q(a) Q(b)^T``                       (contraction K)
- dgrad ``da = Q(g) Q(b^T)^T``, ``b^T`` (B, K, N)   (contraction N)
- wgrad ``db = Q(g^T) Q(a^T)^T``, ``a^T`` (B, K, M)  (contraction M)

``Q`` quantizes along the last axis as the recipe says for the operand's kind, and the
transposed copies are quantized from the high-precision tensors. Products accumulate in
float32 (HIGHEST precision) unless the recipe emulates a narrower accumulator.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from precisionlab import hardware
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS
from precisionlab.intercept import _boundary as boundary
from precisionlab.recipes import _scaling as S
from precisionlab.recipes._accumulate import batched_gemm
from precisionlab.recipes._blockhw import block_gemm
from precisionlab.recipes._deepgemm import blockwise_gemm
from precisionlab.recipes._fp4 import FP4Recipe
from precisionlab.recipes._names import get_recipe
from precisionlab.recipes._recipes import (
    MX,
    NVFP4,
    Blocked,
    Blockwise,
    Current,
    Delayed,
    Recipe,
    Reference,
)

E4M3_NAME = "float8_e4m3fn"

__all__ = [
    "WEIGHT_OPERANDS",
    "GemmRecord",
    "Weight",
    "dot_general",
    "fprop_gemm",
    "matmul",
    "operand_gemm",
    "vjp_gemms",
]

#: Which operand of a product is the weight: a name of :data:`WEIGHT_OPERANDS`, or the kinds of
#: (lhs, rhs) as a pair (an intercepted site's ``Site.roles``; :func:`operand_kinds` checks it).
Weight: TypeAlias = str | tuple[str, ...]
#: which operand is the weight: kinds of (lhs, rhs) ("both": a product of two parameters).
WEIGHT_OPERANDS = {"rhs": ("x", "w"), "lhs": ("w", "x"), "none": ("x", "x"), "both": ("w", "w")}
_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


# --- layout --------------------------------------------------------------------------------
def canonical_operand(
    x: jax.Array, contract: Sequence[int], batch: Sequence[int]
) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` laid out as a recipe's GEMM reads an operand: (B, R, K) with the ``batch`` axes,
    the kept axes and the ``contract`` axes each flattened, in that order; and the kept axes'
    sizes (to restore the output's shape)."""
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    xt = jnp.transpose(x, (*batch, *free, *contract))
    bsz = math.prod(x.shape[d] for d in batch)
    r = math.prod(x.shape[d] for d in free)
    k = math.prod(x.shape[d] for d in contract)
    return xt.reshape(bsz, r, k), tuple(x.shape[d] for d in free)


# --- GEMM ----------------------------------------------------------------------------------
def _pad_to(x: jax.Array, axis: int, mult: int) -> jax.Array:
    n = x.shape[axis]
    pad = -n % mult
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _check_blocks(recipe: Recipe, t: jax.Array, kind: str, what: str) -> None:
    for blk in recipe.block_sizes(kind):
        dims = [("contraction", t.shape[-1])]
        if recipe.two_d(kind):
            dims.append(("row", t.shape[-2]))
        for label, n in dims:
            if n % blk and not recipe.pad_ok():
                raise ValueError(
                    f"{recipe.name}: the {what} operand's {label} size {n} is not a multiple "
                    f"of the block size {blk}; pass recipe=get_recipe(recipe, pad=True) (zeros "
                    "fill the last block: they change neither its amax nor the products) or use "
                    "other sizes"
                )


def _prepare(recipe: Recipe, t: jax.Array, kind: str, what: str) -> jax.Array:
    _check_blocks(recipe, t, kind, what)
    for blk in recipe.block_sizes(kind):
        t = _pad_to(t, -1, blk)
        if recipe.two_d(kind):
            t = _pad_to(t, -2, blk)
    return t


def _element_dtype(recipe: Recipe, kind: str, q: S.QOperand) -> np.dtype:
    """The dtype holding a quantized operand's elements exactly, for the hardware GEMM."""
    if q.block_inv is not None:
        raise ValueError(
            f"accumulate={recipe.accumulate!r}: the {recipe.name} recipe scales blocks inside "
            "the contraction; the hardware models cover per-tensor and per-row scaled GEMMs "
            "(recipes delayed, current, rowwise, reference with dtype bfloat16), blockwise "
            "on h100-deepgemm, and, on Blackwell presets, mxfp8, mxfp4 and nvfp4"
        )
    if isinstance(recipe, Reference):
        if recipe.dtype != "bfloat16":
            raise ValueError("accumulate= a hardware preset needs Reference(dtype='bfloat16')")
        return jnp.dtype(jnp.bfloat16)
    # rowwise: E4M3 for every operand (no formats to choose)
    name = recipe.fmt(kind).name if isinstance(recipe, (Delayed, Current, MX)) else E4M3_NAME
    return jnp.dtype(name)


def _hardware_gemm(
    recipe: Recipe, preset: str, qa: S.QOperand, qb: S.QOperand, kinds: tuple[str, str]
) -> jax.Array:
    """The GEMM as hardware ``preset`` (the recipe's ``accumulate``) computes it."""
    if isinstance(recipe, Blockwise):  # DeepGEMM's per-128 promotion (the recipe checked it)
        return blockwise_gemm(qa, qb, preset)
    if qa.block_inv is not None and qb.block_inv is not None and isinstance(recipe, (MX, NVFP4)):
        # block scales inside the contraction: Blackwell's block-scaled MMA (the recipe
        # checked the preset and its formats when it was made)
        (ea, scale), (eb, _) = recipe.hardware_blocks(kinds[0]), recipe.hardware_blocks(kinds[1])
        return block_gemm(qa, qb, (ea, eb), scale, recipe.block, preset)
    da = _element_dtype(recipe, kinds[0], qa)
    db = _element_dtype(recipe, kinds[1], qb)
    a, b = qa.elems.astype(da), qb.elems.astype(db)  # exact: the elements are format values
    if jnp.dtype(da).itemsize != jnp.dtype(db).itemsize:
        raise ValueError(f"hardware GEMM of {jnp.dtype(da).name} x {jnp.dtype(db).name}")
    kw = hardware.preset(preset)
    return hardware.dot_general(a, b, BATCHED_GEMM_DIMS, **kw)


def _gemm(
    recipe: Recipe, qa: S.QOperand, qb: S.QOperand, kinds: tuple[str, str] = ("x", "w")
) -> jax.Array:
    a, b = qa.block_values(), qb.block_values()
    preset = recipe.accumulate
    if preset is not None and preset != "sequential":
        acc = _hardware_gemm(recipe, preset, qa, qb, kinds)
    else:
        acc = batched_gemm(a, b, recipe.accumulate_bits, recipe.accumulate_rounding,
                           recipe.promote_every)  # fmt: skip
    factor = qa.output_factor(qb)
    return acc if factor is None else acc * factor


class GemmRecord(NamedTuple):
    """What one GEMM of the quantized matmul computed, handed to a ``tap`` (instruments that
    record a step, :mod:`precisionlab.verify`): ``what`` ("fprop", "dgrad", "wgrad"),
    ``kinds`` of (lhs, rhs), ``inputs`` the float32 (B, R, K) operands as quantized (padded,
    Hadamard-transformed), ``scales`` / ``keys`` as given to the quantizer, ``operands`` the
    two :class:`~precisionlab.recipes._scaling.QOperand` (None for a GEMM the recipe keeps in
    high precision), ``out`` the float32 (B, M, N) product."""

    what: str
    kinds: tuple[str, str]
    inputs: tuple[jax.Array, jax.Array]
    scales: tuple[Any, Any]
    keys: tuple[Any, Any]
    operands: tuple[S.QOperand, S.QOperand] | None
    out: jax.Array


#: A pair of per-operand arguments of a quantizer (scales, keys), None where not given.
_Pair: TypeAlias = tuple[jax.Array | None, jax.Array | None]
#: A function receiving each :class:`GemmRecord` while the GEMMs are traced.
Tap = Callable[[GemmRecord], None]
#: A replacement of :func:`operand_gemm`: ``gemm(recipe, qa, qb, kinds) -> (B, M, N)``.
GemmFn = Callable[..., jax.Array]


def operand_gemm(
    recipe: Recipe, qa: S.QOperand, qb: S.QOperand, kinds: tuple[str, str] = ("x", "w")
) -> jax.Array:
    """The float32 (B, M, N) GEMM of two quantized (B, M, K) and (B, N, K) operands as
    ``recipe`` computes it (its accumulator, hardware preset, row and block factors)."""
    return _gemm(recipe, qa, qb, kinds)


def quantized_gemm(
    recipe: Recipe, a: jax.Array, b: jax.Array, kinds: tuple[str, str], *, what: str,
    scales: _Pair = (None, None), keys: _Pair = (None, None),
    hadamard: np.ndarray | jax.Array | None = None, tap: Tap | None = None,
    gemm: GemmFn | None = None,
) -> jax.Array:  # fmt: skip
    """``Q(a) Q(b)^T`` of float32 (B, M, K) and (B, N, K) operands: (B, M, N) float32;
    ``hadamard``: the (16, 16) transform applied to both along K first (NVFP4's wgrad)."""
    m, n = a.shape[1], b.shape[1]
    a = _prepare(recipe, a, kinds[0], f"{what} lhs")
    b = _prepare(recipe, b, kinds[1], f"{what} rhs")
    if a.shape[-1] != b.shape[-1]:  # 2-D tiles padded one operand's K further
        k = max(a.shape[-1], b.shape[-1])
        a, b = _pad_to(a, -1, k), _pad_to(b, -1, k)
    if hadamard is not None:
        a = S.apply_hadamard(_pad_to(a, -1, 16), hadamard)
        b = S.apply_hadamard(_pad_to(b, -1, 16), hadamard)
    qa = recipe.quantize(a, kinds[0], scale=scales[0], key=keys[0])
    qb = recipe.quantize(b, kinds[1], scale=scales[1], key=keys[1])
    out = (gemm or _gemm)(recipe, qa, qb, kinds)[:, :m, :n]
    if tap is not None:
        tap(GemmRecord(what, kinds, (a, b), scales, keys, (qa, qb), out))
    return out


# --- custom VJP ----------------------------------------------------------------------------
def _hp_gemm(
    a: jax.Array, b: jax.Array, kinds: tuple[str, str], what: str, tap: Tap | None = None
) -> jax.Array:
    out = jnp.einsum(
        "bmk,bnk->bmn", a, b, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    if tap is not None:
        tap(GemmRecord(what, kinds, (a, b), (None, None), (None, None), None, out))
    return out


def _observe(a3: jax.Array, b3: jax.Array) -> jax.Array:
    return jnp.stack([S.amax(a3, None, False), S.amax(b3, None, False)])


#: A recipe's numbers as arguments of a program (see :meth:`Recipe.with_numbers`), or None.
_Numbers: TypeAlias = Mapping[str, ArrayLike] | None
#: What the forward of the custom VJP saves: the operands, the state, the key, the numbers.
_Saved: TypeAlias = tuple[jax.Array, jax.Array, dict | None, jax.Array | None, _Numbers]


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _qdot3(
    recipe: Recipe, kinds: tuple[str, str], a3: jax.Array, b3: jax.Array, state: dict | None,
    key: jax.Array | None, nums: _Numbers,
) -> jax.Array:  # fmt: skip
    return _fprop(recipe.with_numbers(nums), kinds, a3, b3, state)


def _scales(state: dict | None) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
    if state is None:
        return None, None, None
    s = state["scale"]
    return s[0], s[1], s[2]


def fprop_gemm(
    recipe: Recipe, kinds: tuple[str, str], a3: jax.Array, b3: jax.Array, state: dict | None,
    *, tap: Tap | None = None, gemm: GemmFn | None = None,
) -> jax.Array:  # fmt: skip
    """The forward GEMM of :func:`dot_general` on (B, M, K) and (B, N, K) operands (float32
    (B, M, N)); ``tap`` receives its :class:`GemmRecord`, ``gemm`` replaces
    :func:`operand_gemm`."""
    sa, sb, _ = _scales(state)
    return quantized_gemm(
        recipe, a3.astype(jnp.float32), b3.astype(jnp.float32), kinds, what="fprop",
        scales=(sa, sb), tap=tap, gemm=gemm,
    )  # fmt: skip


def _fprop(
    recipe: Recipe, kinds: tuple[str, str], a3: jax.Array, b3: jax.Array, state: dict | None
) -> jax.Array:
    return fprop_gemm(recipe, kinds, a3, b3, state)


def _qdot3_fwd(
    recipe: Recipe, kinds: tuple[str, str], a3: jax.Array, b3: jax.Array, state: dict | None,
    key: jax.Array | None, nums: _Numbers,
) -> tuple[jax.Array, _Saved]:  # fmt: skip
    return _fprop(recipe.with_numbers(nums), kinds, a3, b3, state), (a3, b3, state, key, nums)


def vjp_gemms(
    recipe: Recipe,
    kinds: tuple[str, str],
    a3: jax.Array,
    b3: jax.Array,
    state: dict | None,
    key: jax.Array | None,
    g: jax.Array,
    *,
    tap: Tap | None = None,
    gemm: GemmFn | None = None,
) -> tuple[jax.Array, jax.Array, dict | None]:
    """The backward GEMMs of :func:`dot_general` for the output gradient ``g`` (B, M, N):
    ``(da, db, state cotangent)`` (the cotangent carries the observed amaxes, delayed
    scaling); ``tap`` receives the dgrad and wgrad :class:`GemmRecord`, ``gemm`` replaces
    :func:`operand_gemm`."""
    a = a3.astype(jnp.float32)
    b = b3.astype(jnp.float32)
    g = g.astype(jnp.float32)
    sa, sb, sg = _scales(state)
    kg1 = kg2 = None
    if isinstance(recipe, NVFP4) and recipe.stochastic_gradients:
        if key is None:
            raise ValueError(
                "nvfp4 rounds gradients stochastically and needs a PRNG key: pass "
                "key=jax.random.key(0) (or recipe=get_recipe('nvfp4', stochastic_gradients=False))"
            )
        kg1, kg2 = jax.random.split(key)
    gt = jnp.swapaxes(g, -1, -2)
    # dgrad: da (B, M, K) = g (B, M, N) . b^T (B, K, N), contraction N
    da = quantized_gemm(
        recipe, g, jnp.swapaxes(b, -1, -2), ("g", kinds[1]), what="dgrad",
        scales=(sg, sb), keys=(kg1, None), tap=tap, gemm=gemm,
    )  # fmt: skip
    # wgrad: db (B, N, K) = g^T (B, N, M) . a^T (B, K, M), contraction M
    if recipe.wgrad_hp and kinds[1] == "w":
        db = _hp_gemm(gt, jnp.swapaxes(a, -1, -2), ("g", kinds[0]), "wgrad", tap)
    else:
        db = quantized_gemm(
            recipe, gt, jnp.swapaxes(a, -1, -2), ("g", kinds[0]), what="wgrad",
            scales=(sg, sa), keys=(kg2, None),
            hadamard=_wgrad_hadamard(recipe), tap=tap, gemm=gemm,
        )  # fmt: skip
    if recipe.wgrad_hp and kinds[0] == "w":  # the weight is the lhs: its gradient is da
        da = _hp_gemm(g, b3.astype(jnp.float32).swapaxes(-1, -2), ("g", kinds[1]), "dgrad", tap)
    ct_state = None
    if state is not None:
        seen = jnp.concatenate([_observe(a3, b3), S.amax(g, None, False)[None]])
        ct_state = {
            "scale": jnp.zeros_like(state["scale"]),
            "history": jnp.zeros_like(state["history"]),
            "probe": seen.astype(state["probe"].dtype),
        }
    return da.astype(a3.dtype), db.astype(b3.dtype), ct_state


def _wgrad_hadamard(recipe: Recipe) -> np.ndarray | jax.Array | None:
    """The transform NVFP4 applies to the wgrad operands (``hadamard``), or None."""
    return recipe.hadamard_matrix() if isinstance(recipe, NVFP4) and recipe.hadamard else None


def _qdot3_bwd(
    recipe: Recipe, kinds: tuple[str, str], res: _Saved, g: jax.Array
) -> tuple[jax.Array, jax.Array, dict | None, None, None]:
    a3, b3, state, key, nums = res
    da, db, ct_state = vjp_gemms(recipe.with_numbers(nums), kinds, a3, b3, state, key, g)
    return da, db, ct_state, None, None


_qdot3.defvjp(_qdot3_fwd, _qdot3_bwd)
# Compiled once per recipe and shapes: eager calls would dispatch hundreds of small ops.
qdot3_jit = jax.jit(_qdot3, static_argnums=(0, 1))


# --- public --------------------------------------------------------------------------------
def operand_kinds(weight: Weight) -> tuple[str, str]:
    """The kinds of (lhs, rhs): a name of :data:`WEIGHT_OPERANDS` or the pair itself
    (``("x", "w")``, a site's ``Site.roles``)."""
    if isinstance(weight, str) and weight in WEIGHT_OPERANDS:
        return WEIGHT_OPERANDS[weight]
    if isinstance(weight, tuple) and len(weight) == 2 and all(k in ("x", "w") for k in weight):
        return (str(weight[0]), str(weight[1]))
    raise ValueError(
        f"unknown weight {weight!r}; allowed: {', '.join(WEIGHT_OPERANDS)} or a pair of "
        "operand kinds ('x' or 'w')"
    )


def as_recipe(recipe: Recipe | str) -> Recipe:
    """The recipe; a name gets ``pad=True`` where the recipe has the field (a 10-class
    output's data-gradient GEMM contracts over 10, not a multiple of a 32-element block)."""
    if not isinstance(recipe, str):
        return get_recipe(recipe)
    r = get_recipe(recipe)
    if isinstance(r, (Blocked, FP4Recipe)):  # the recipes with a pad field
        return dataclasses.replace(r, pad=True)
    return r


def check_float(x: jax.Array, what: str) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOATS]:
        raise ValueError(
            f"quantized matmul takes float operands (float32, bfloat16, float16, float64); "
            f"the {what} is {x.dtype}"
        )


def checked_operands(
    recipe: Recipe, weight: Weight, lhs: Any, rhs: Any, state: Any, what: str
) -> tuple[tuple[str, str], jax.Array, jax.Array]:
    """The checks a quantized matmul and convolution (``what``) share: the operands' kinds
    (from ``weight``), float operands (returned as arrays), and a state for the delayed
    recipe."""
    kinds = operand_kinds(weight)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    check_float(lhs, "lhs")
    check_float(rhs, "rhs")
    if isinstance(recipe, Delayed) and state is None:
        raise ValueError(
            f"the delayed recipe needs this {what}'s state: pass state=init_site_state(recipe)"
        )
    return kinds, lhs, rhs


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Recipe | str,
    state: dict | None = None,
    key: jax.Array | None = None,
    weight: Weight = "rhs",
) -> jax.Array:
    """``lax.dot_general`` whose forward and backward GEMMs are quantized by ``recipe``.

    Args:
      lhs, rhs, dimension_numbers, preferred_element_type: as in ``lax.dot_general``
        (``precision`` is accepted and ignored: products are exact and accumulate in
        float32, or in the recipe's emulated accumulator).
      recipe: a :class:`Recipe` or a name of :data:`RECIPE_NAMES`. A named block recipe pads
        contractions that are not a multiple of its block with zeros, as
        :func:`~precisionlab.recipes.apply` does; a Recipe object with ``pad=False`` refuses
        them.
      state: for :class:`Delayed`, this matmul's state (see :func:`init_site_state`); its
        cotangent carries the observed amaxes (``"probe"``: lhs, rhs, output gradient).
      key: PRNG key for stochastic rounding of gradients (NVFP4).
      weight: which operand is the weight (2-D tiles, weight-gradient GEMM): ``"rhs"``
        (``x @ w``, Flax, plain models; default), ``"lhs"`` (Equinox's ``w @ x``),
        ``"none"`` (two activations), ``"both"`` (two parameters), or the kinds of (lhs,
        rhs) as a pair (``("x", "w")``: an intercepted site's ``roles``).

    Returns:
      The product, dtype ``preferred_element_type`` or the operands' result dtype.
    """
    recipe = as_recipe(recipe)
    kinds, lhs, rhs = checked_operands(recipe, weight, lhs, rhs, state, "matmul")
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
    a3, lfree = canonical_operand(lhs, lc, lb)
    b3, rfree = canonical_operand(rhs, rc, rb)
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    if not recipe.stateful:
        state = None
    if isinstance(recipe, FP4Recipe):  # a recipe owning its three GEMMs (recipes._fp4)
        wc, wb = (lc, lb) if kinds == ("w", "x") else (rc, rb)
        out = recipe.dot3(
            kinds, a3, b3, state, key, canon=lambda t: canonical_operand(t, wc, wb)[0]
        )
        batch_shape = tuple(lhs.shape[d] for d in lb)
        return out.reshape(*batch_shape, *lfree, *rfree).astype(out_dtype)
    # the recipe's numbers (given by with_numbers: arguments of the caller's program) enter
    # as arguments, the recipe without them as the static part
    nums = recipe.given_numbers
    # inside shard_map (check_vma=True) every input varies over the data's axes, so the custom
    # VJP's cotangents (as varying as the data) match their inputs' types; JAX sums the
    # gradient of an invariant input (a replicated weight) over those axes as it does for x @ w
    a3, b3, state, key, nums = boundary.match_varying((a3, b3, state, key, nums))
    out = qdot3_jit(recipe.with_numbers(None), kinds, a3, b3, state, key, nums)
    batch_shape = tuple(lhs.shape[d] for d in lb)
    return out.reshape(*batch_shape, *lfree, *rfree).astype(out_dtype)


def matmul(a: jax.Array, b: jax.Array, *, recipe: Recipe | str, **kwargs: Any) -> jax.Array:
    """``a @ b`` (2-D ``a`` with leading batch axes allowed, 2-D ``b``) through
    :func:`dot_general`.

    Example:
      FP8 E4M3 with a power-of-two scale per tensor: ``a``'s scale 256 (448 / 1.1 rounded down
      to a power of two) puts 1.1 at 281.6, which E4M3 (steps of 32 there) rounds to 288: 1.125.

      >>> import jax.numpy as jnp
      >>> from precisionlab.recipes import get_recipe, matmul
      >>> a, b = jnp.array([[1.0, 1.1]]), jnp.ones((2, 1))
      >>> matmul(a, b, recipe=get_recipe("current", pow2_scales=True)).tolist()
      [[2.125]]
    """
    a, b = jnp.asarray(a), jnp.asarray(b)
    if b.ndim != 2 or a.ndim < 1:
        raise ValueError(f"matmul takes a (..., K) @ (K, N); got {a.shape} @ {b.shape}")
    dims = (((a.ndim - 1,), (0,)), ((), ()))
    return dot_general(a, b, dims, recipe=recipe, **kwargs)
