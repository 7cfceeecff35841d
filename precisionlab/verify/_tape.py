"""The recorder's taps: a recipe's GEMM steps with their records passed out of ``jit``.

The forward GEMM's record leaves the interception layer as auxiliary output
(:class:`~precisionlab.intercept.Emit`); the backward GEMMs' records leave the backward pass
as the cotangent of a zero "tape" handed to the site, bit for bit: each 32-bit word travels as
two 16-bit halves held exactly by float32, so no addition of a zero cotangent can change a
sign of zero or a NaN payload. Also: what a recipe's operands look like in a dump (element
formats, block layouts) and the interception rules of both recording modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import wraps
from typing import Any, Generic, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab import recipes
from precisionlab.hardware._conv import from_params as conv_plan
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS
from precisionlab.intercept import Context, Emit
from precisionlab.intercept import _boundary as boundary
from precisionlab.recipes import _scaling as S
from precisionlab.recipes._conv import conv_site
from precisionlab.verify._format import storage_dtype

__all__ = [
    "FLOATS", "PlainRule", "RecipeRule", "TapedVJP", "block_layout", "compact", "element_format",
    "expand", "from_halves", "gemm_kinds", "key_data", "native_gemm", "pinned_gemm",
]  # fmt: skip

P = ParamSpec("P")
R = TypeVar("R")

#: dtypes of the matmul operands the recorders take (others, e.g. integer matmuls, run as
#: they are, unrecorded)
FLOATS = ("float16", "bfloat16", "float32", "float64")


def gemm_kinds(weight: str, what: str) -> tuple[str, str]:
    """The operand kinds of a GEMM of a matmul whose weight is ``weight``."""
    x0, x1 = recipes.WEIGHT_OPERANDS[weight]
    return {"fprop": (x0, x1), "dgrad": ("g", x1), "wgrad": ("g", x0)}[what]


# --- what a recipe's operand looks like ------------------------------------------------
def element_format(recipe: recipes.Recipe, kind: str) -> str:
    """The dtype name of ``recipe``'s elements for an operand of ``kind`` (``"float32"``
    when the recipe is not one this module knows: its elements are then kept as float32)."""
    if isinstance(recipe, recipes.Reference):
        return recipe.dtype
    if isinstance(recipe, recipes.NVFP4):
        return "float4_e2m1fn"
    if isinstance(recipe, (recipes.Rowwise, recipes.Blockwise)):
        return "float8_e4m3fn"
    fmt = getattr(recipe, "fmt", None)
    if callable(fmt):
        try:
            name = fmt(kind).name
            storage_dtype(name)
            return name
        except (ValueError, KeyError, AttributeError):
            pass
    return "float32"


def block_layout(recipe: recipes.Recipe, kind: str) -> tuple[int, bool] | None:
    """(block, two_d) of an operand of ``kind``, or None for a recipe without blocks."""
    sizes = recipe.block_sizes(kind)
    if not sizes:
        return None
    return int(sizes[0]), bool(recipe.two_d(kind))


def compact(x: jax.Array, layout: tuple[int, bool] | None) -> jax.Array:
    """A per-element block factor (B, R, K) kept once per block: (B, R, K/b) for 1 x b
    blocks, (B, R/b, K/b) for b x b tiles."""
    if layout is None:
        return x
    b, two_d = layout
    bb, r, k = x.shape
    if two_d:
        return x.reshape(bb, r // b, b, k // b, b)[:, :, 0, :, 0]
    return x.reshape(bb, r, k // b, b)[..., 0]


def expand(x: np.ndarray, layout: tuple[int, bool] | None) -> np.ndarray:
    """Inverse of :func:`compact`."""
    if layout is None:
        return x
    b, two_d = layout
    x = np.repeat(x, b, axis=-1)
    return np.repeat(x, b, axis=-2) if two_d else x


def key_data(k: jax.Array) -> tuple[jax.Array, str]:
    """(raw uint32 key data, ``"raw"`` or ``"typed:<impl>"``)."""
    if jnp.issubdtype(k.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(k), f"typed:{jax.random.key_impl(k)}"
    return k, "raw"


def _pack(rec: recipes.GemmRecord, recipe: recipes.Recipe) -> dict[str, jax.Array]:
    """A GEMM's record as a flat dict of arrays (block factors kept once per block)."""
    out: dict[str, jax.Array] = {"out": rec.out}
    ops = rec.operands or (None, None)
    for side, x, q, s, k, kind in zip(
        ("lhs", "rhs"), rec.inputs, ops, rec.scales, rec.keys, rec.kinds, strict=True
    ):
        out[f"{side}/input"] = x
        if s is not None:
            out[f"{side}/given_scale"] = jnp.asarray(s, jnp.float32).reshape(())
        if k is not None:
            out[f"{side}/key"] = key_data(k)[0]
        if q is None:
            continue
        out[f"{side}/codes"] = q.elems
        if q.row_inv is not None:
            out[f"{side}/row_scale"] = jnp.asarray(q.row_inv, jnp.float32)
        layout = block_layout(recipe, kind)
        if q.block_inv is not None:
            out[f"{side}/block_scale"] = compact(jnp.broadcast_to(q.block_inv, x.shape), layout)
        if q.block_exp is not None:
            e = jnp.broadcast_to(q.block_exp, x.shape).astype(jnp.int32)
            out[f"{side}/block_exp"] = compact(e, layout)
    return out


# --- the tape: records leaving the backward pass as a cotangent, bit for bit ------------
def _to_halves(x: jax.Array) -> jax.Array:
    """A 32-bit array as float32 (2, ...): its high and low 16-bit halves (exact)."""
    u = lax.bitcast_convert_type(x, jnp.uint32) if x.dtype != jnp.uint32 else x
    return jnp.stack([(u >> 16).astype(jnp.float32), (u & 0xFFFF).astype(jnp.float32)])


def from_halves(h: np.ndarray, dtype: np.dtype, axis: int = 0) -> np.ndarray:
    """Inverse of :func:`_to_halves` (the halves on ``axis``: after the loop axes)."""
    hi = np.take(np.asarray(h, np.float64), 0, axis).astype(np.uint32)
    lo = np.take(np.asarray(h, np.float64), 1, axis).astype(np.uint32)
    return ((hi << 16) | lo).view(dtype)


def to_tape(tree: dict[str, jax.Array]) -> dict[str, jax.Array]:
    out = {}
    for k, v in tree.items():
        if jnp.dtype(v.dtype).itemsize != 4:
            v = v.astype(jnp.float32)  # narrower floats widen exactly
        out[k] = _to_halves(v)
    return out


class TapedVJP(Generic[P, R]):
    """A ``jax.custom_vjp`` function built from its two rules, whose last argument is the
    tape: its primal is ``fwd``'s output without the residuals (so it has ``fwd``'s
    signature); ``bwd(*static, residuals, cotangents)`` returns the cotangents of the other
    differentiated arguments followed by the records, which leave as the tape's cotangent
    (in 16-bit halves, :func:`to_tape`).

    Args:
      fwd: the forward rule, ``(output, residuals)``; ``output`` is ``(array, records)``.
      bwd: the backward rule described above.
      n_static: the leading arguments that are static (not differentiated).
    """

    def __init__(
        self,
        fwd: Callable[P, tuple[R, tuple[Any, ...]]],
        bwd: Callable[..., tuple[Any, ...]],
        n_static: int,
    ) -> None:
        self.n_static = n_static
        self.fwd: Callable[..., Any] = fwd  # its output: ((array, records), residuals)
        self.bwd = bwd

        @wraps(fwd)
        def primal(*args: P.args, **kwargs: P.kwargs) -> R:
            return fwd(*args, **kwargs)[0]

        def taped_bwd(*args: Any) -> tuple[Any, ...]:
            *cts, records = bwd(*args)
            return (*cts, to_tape(records))

        self._f = jax.custom_vjp(primal, nondiff_argnums=tuple(range(n_static)))
        self._f.defvjp(fwd, taped_bwd)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._f(*args, **kwargs)

    def record_shapes(self, *args: P.args, **kwargs: P.kwargs) -> dict[str, Any]:
        """Shapes and dtypes of the records the backward rule leaves on the tape (before
        halving), for a float32 cotangent of the output (traced, nothing computed)."""
        static = args[: self.n_static]

        def run(*dynamic: Any) -> dict[str, jax.Array]:
            (out, _), res = self.fwd(*static, *dynamic, **kwargs)
            g = jnp.zeros(out.shape, jnp.float32)
            return self.bwd(*static, res, (g, None))[-1]

        return jax.eval_shape(run, *args[self.n_static :])


def _bwd_records(taps: list, recipe: recipes.Recipe) -> dict[str, jax.Array]:
    out = {}
    for rec in taps:
        for k, v in _pack(rec, recipe).items():
            out[f"{rec.what}/{k}"] = v
    return out


def _tdot_fwd(
    recipe: recipes.Recipe,
    kinds: tuple[str, str],
    gemm: Callable | None,
    a3: jax.Array,
    b3: jax.Array,
    state: Any,
    key: jax.Array | None,
    nums: Any,
    tape: Any,
) -> tuple[tuple[jax.Array, dict[str, jax.Array]], tuple[Any, ...]]:
    taps: list = []
    rec = recipe.with_numbers(nums)
    out = recipes.fprop_gemm(rec, kinds, a3, b3, state, tap=taps.append, gemm=gemm)
    return (out, _pack(taps[0], rec)), (a3, b3, state, key, nums)


def _tdot_bwd(
    recipe: recipes.Recipe,
    kinds: tuple[str, str],
    gemm: Callable | None,
    res: tuple[Any, ...],
    cts: tuple[jax.Array, Any],
) -> tuple[Any, ...]:
    g, _ = cts
    a3, b3, state, key, nums = res
    rec = recipe.with_numbers(nums)
    taps: list = []
    da, db, ct_state = recipes.vjp_gemms(
        rec, kinds, a3, b3, state, key, g, tap=taps.append, gemm=gemm
    )
    return da, db, ct_state, None, None, _bwd_records(taps, rec)


#: the forward GEMM with its record, whose cotangent on ``tape`` is the backward's records
_tdot = TapedVJP(_tdot_fwd, _tdot_bwd, n_static=3)


def pinned_gemm(
    recipe: recipes.Recipe, qa: S.QOperand, qb: S.QOperand, kinds: tuple[str, str]
) -> jax.Array:
    """The recipe's own GEMM on operands materialized first (an optimization barrier): XLA
    then sums a float32 GEMM as it does in a program of that GEMM alone, the check's."""
    qa, qb = lax.optimization_barrier((qa, qb))
    return recipes.operand_gemm(recipe, qa, qb, kinds)


def native_gemm(
    recipe: recipes.Recipe, qa: S.QOperand, qb: S.QOperand, kinds: tuple[str, str]
) -> jax.Array:
    """The GEMM of two quantized operands as the backend's own ``dot_general`` computes it:
    elements in their dtype (FP8, bfloat16), float32 output, then the per-row factors."""
    if qa.block_inv is not None or qb.block_inv is not None:
        raise ValueError(
            f"gemm='native': the {recipe.name} recipe scales blocks inside the contraction; "
            "no backend dot_general takes block scales: use gemm='recipe'"
        )
    da = element_format(recipe, kinds[0])
    db = element_format(recipe, kinds[1])
    a = qa.elems.astype(jnp.dtype(da))
    b = qb.elems.astype(jnp.dtype(db))
    acc = lax.dot_general(a, b, BATCHED_GEMM_DIMS, preferred_element_type=jnp.float32)
    factor = qa.output_factor(qb)
    return acc if factor is None else acc * factor


# --- the interception rules --------------------------------------------------------------
@dataclasses.dataclass
class RecipeRule:
    """The recipe's dot_general and convolution (the GEMM over its patches, as
    :func:`precisionlab.recipes.conv_general_dilated` computes it), recording the sites in
    ``recorded``."""

    recipe: recipes.Recipe
    weight: str
    recorded: frozenset[str]
    gemm: Callable | None
    shapes: dict[str, Any] | None = None  # filled by a discovery pass: backward records
    primitives: tuple[str, ...] = boundary.PRODUCTS
    # what a recipe could quantize but the recorder has no rule for: it runs as written,
    # listed in the dump (skipped_sites) and warned about, never silently
    candidates: tuple[str, ...] = boundary.RAGGED_PRODUCTS
    label: str = "verify.record"

    def apply(
        self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any
    ) -> list[jax.Array] | Emit:
        pet = params.get("preferred_element_type")
        if str(lhs.dtype) not in FLOATS or str(rhs.dtype) not in FLOATS:
            return ctx.original(lhs, rhs)
        entry = ctx.state or {}
        rstate = entry.get("recipe") if isinstance(entry, dict) else None
        conv = ctx.site.primitive == boundary.CONV
        if ctx.site.name not in self.recorded:
            if conv:
                key = ctx.site_key()
                return [conv_site(lhs, rhs, params, self.recipe, self.weight, rstate, key)]
            out = recipes.dot_general(
                lhs, rhs, params["dimension_numbers"], preferred_element_type=pet,
                recipe=self.recipe, state=rstate, key=ctx.site_key(), weight=self.weight,
            )  # fmt: skip
            return [out]
        recipe = self.recipe
        if conv:  # the GEMM over the patches, float32 as recipes.conv_general_dilated has it
            plan = conv_plan(lhs.shape, rhs.shape, params)
            a3, b3 = (
                plan.patches(lhs.astype(jnp.float32)),
                plan.kernel_rows(rhs.astype(jnp.float32)),
            )
            restore: Callable[[jax.Array], jax.Array] = plan.output
        else:
            (lc, rc), (lb, rb) = params["dimension_numbers"]
            lc, rc, lb, rb = (tuple(int(d) for d in t) for t in (lc, rc, lb, rb))
            a3, lfree = recipes.canonical_operand(lhs, lc, lb)
            b3, rfree = recipes.canonical_operand(rhs, rc, rb)
            bshape = tuple(lhs.shape[d] for d in lb)

            def restore(o: jax.Array) -> jax.Array:
                return o.reshape(*bshape, *lfree, *rfree)

        out_dtype = pet or jnp.result_type(lhs.dtype, rhs.dtype)
        kinds = recipes.WEIGHT_OPERANDS[self.weight]
        state = rstate if isinstance(recipe, recipes.Delayed) else None
        nums = recipe.given_numbers
        static = recipe.with_numbers(None)
        key = ctx.site_key()
        if self.shapes is not None:  # discovery: the backward records' shapes
            self.shapes[ctx.site.name] = _tdot.record_shapes(
                static, kinds, self.gemm, a3, b3, state, key, nums, None
            )
            tape = None
        else:
            tape = entry["tape"]
        if tape is None:
            out3, fwd = _tdot_fwd(static, kinds, self.gemm, a3, b3, state, key, nums, None)[0]
        else:
            out3, fwd = _tdot(static, kinds, self.gemm, a3, b3, state, key, nums, tape)
        return Emit([restore(out3).astype(out_dtype)], fwd)


@dataclasses.dataclass
class PlainRule:
    """Any dot_general as the program has it, recording operands and output."""

    recorded: frozenset[str]
    params: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    primitives: tuple[str, ...] = (boundary.DOT_GENERAL,)
    candidates: tuple[str, ...] = (boundary.CONV, *boundary.RAGGED_PRODUCTS)
    label: str = "verify.record"

    def apply(
        self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any
    ) -> list[jax.Array] | Emit:
        (out,) = ctx.original(lhs, rhs)
        if ctx.site.name not in self.recorded or str(lhs.dtype) not in FLOATS:
            return [out]
        self.params[ctx.site.name] = _plain_params(params)
        return Emit([out], {"lhs": lhs, "rhs": rhs, "out": out})


def _plain_params(params: dict) -> dict[str, Any]:
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    prec = params.get("precision")
    if prec is not None and not isinstance(prec, (tuple, list)):
        prec = (prec, prec)
    pet = params.get("preferred_element_type")
    return {
        "dimension_numbers": [
            [list(map(int, lc)), list(map(int, rc))],
            [list(map(int, lb)), list(map(int, rb))],
        ],
        "precision": None if prec is None else [None if p is None else str(p) for p in prec],
        "preferred_element_type": None if pet is None else jnp.dtype(pet).name,
    }
