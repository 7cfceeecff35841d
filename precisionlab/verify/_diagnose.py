"""Mechanism labels: each recomputes a differing tensor the ways a mechanism would have
produced it (another scale rule, key, rounding, accumulation model, format), first match
wins; the costly searches run for the first difference of a dump only."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from precisionlab import recipes
from precisionlab.quant import SCALE_RULES
from precisionlab.verify import _models as M
from precisionlab.verify._context import CheckContext
from precisionlab.verify._format import Tensor
from precisionlab.verify._report import TensorCheck, compare

#: named ways to recompute a tensor, each a call that returns it (or raises NotModelled)
_Candidates = Sequence[tuple[str, Callable[[], Any]]]

__all__ = [
    "OUT_BITS", "diagnose_codes", "diagnose_output", "diagnose_scale", "exact_sums", "labelled",
    "plain_exact", "zeroed_or_nonfinite",
]  # fmt: skip

_MAX_CANDIDATES_SHARE = 0.999


def zeroed_or_nonfinite(rec: np.ndarray, ref: np.ndarray) -> str | None:
    r = np.asarray(rec).astype(np.float32)
    f = np.asarray(ref).astype(np.float32)
    if r.size and not np.any(r) and np.any(f):
        return "all zero where the recipe's has nonzero values"
    bad = ~np.isfinite(r) & np.isfinite(f)
    if bad.any():
        return f"{int(bad.sum())} non-finite values where the recipe's are finite"
    return None


def labelled(c: TensorCheck, label: str | None, detail: str) -> TensorCheck:
    return dataclasses.replace(c, label=label, detail=detail)


def diagnose_codes(
    ctx: CheckContext, c: TensorCheck, rec: np.ndarray, ref: np.ndarray, fmt: str, stochastic: bool
) -> TensorCheck:
    z = zeroed_or_nonfinite(rec, ref)
    if z:
        ctx.full()
        return labelled(c, "zeroed-or-nonfinite", z)
    if c.max_ulp == 1:
        ctx.full()
        how = "stochastically rounded by the recipe" if stochastic else "rounded to nearest"
        return labelled(c, "sr-bits", (
            f"{c.elements - c.equal} codes one {fmt} code from the recipe's ({how}): other "
            "stochastic-rounding bits or another rounding direction"))  # fmt: skip
    if not ctx.full():
        return labelled(c, None, "not analysed (only the first difference is)")
    return labelled(c, "unknown", f"codes up to {c.max_ulp} codes apart")


def _scale_alternatives(recipe: recipes.Recipe) -> list[tuple[str, recipes.Recipe]]:
    out: list[tuple[str, recipes.Recipe]] = []
    if isinstance(recipe, recipes.MX):
        out += [(f"scale_rule={r!r}", dataclasses.replace(recipe, scale_rule=r))
                for r in SCALE_RULES if r != recipe.scale_rule]  # fmt: skip
    if isinstance(recipe, recipes.Current):
        out.append((f"pow2_scales={not recipe.pow2_scales}",
                    dataclasses.replace(recipe, pow2_scales=not recipe.pow2_scales)))  # fmt: skip
    return out


def diagnose_scale(
    ctx: CheckContext,
    c: TensorCheck,
    t: Tensor,
    role: str,
    ref: np.ndarray,
    recipe: recipes.Recipe,
    kind: str,
    layout: Any,
    x: np.ndarray,
    scale: Any,
    key: Any,
) -> TensorCheck:
    rec = ctx.arr(t)
    z = zeroed_or_nonfinite(rec, ref) if role != "block_exp" else None
    if z:
        ctx.full()
        return labelled(c, "zeroed-or-nonfinite", z)
    full = ctx.full()
    if full:
        for name, alt in _scale_alternatives(recipe):
            other = M.quantize(alt, kind, layout, x, scale, key).get(role)
            if other is not None and compare(rec, other, t.dtype)[1] == c.elements:
                return labelled(c, "scale-rule", f"equals the {role} of {name} (the recipe "
                                 f"has {_rule_of(recipe)})")  # fmt: skip
    diff = compare(rec, ref, t.dtype)[3]
    r = np.asarray(rec)[diff].astype(np.float64)
    f = np.asarray(ref)[diff].astype(np.float64)
    if role == "block_exp":
        binade = np.all(np.abs(r - f) == 1)
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = r / f
        binade = np.all((ratio == 2) | (ratio == 0.5))
    if binade:
        return labelled(c, "scale-rule", f"{int(diff.sum())} scales one binade (a factor 2) "
                         "from the recipe's rule, as another rounding of log2 gives")  # fmt: skip
    if not full:
        return labelled(c, None, "not analysed (only the first difference is)")
    return labelled(c, "unknown", f"scales differ, up to {c.max_ulp} ulp")


def _rule_of(recipe: recipes.Recipe) -> str:
    if isinstance(recipe, recipes.MX):
        return f"scale_rule={recipe.scale_rule!r}"
    if isinstance(recipe, recipes.Current):
        return f"pow2_scales={recipe.pow2_scales}"
    return recipe.name


def within_reordering(
    rec: np.ndarray, exact: np.ndarray, absum: np.ndarray, k: int, out_bits: int = 24
) -> bool:
    """Whether every output is within the error bound of summing the same exact products in
    float32 in some order: ``|out - sum| <= (k + 1) 2**-24 sum |a_k b_k|`` (the k - 1
    additions, the final scaling, float32's products being exact or rounded once), plus
    ``2**-out_bits |sum|`` for an output rounded to a narrower format."""
    bound = (k + 1) * 2.0**-24 * absum + 2.0**-out_bits * np.abs(exact)
    return bool(np.all(np.abs(rec.astype(np.float64) - exact) <= bound))


def diagnose_output(
    ctx: CheckContext,
    c: TensorCheck,
    rec: np.ndarray,
    ref: np.ndarray,
    alts: _Candidates,
    bf16: _Candidates,
    reorder: Callable[[], tuple[np.ndarray, np.ndarray, int]] | None = None,
    out_bits: int = 24,
) -> TensorCheck:
    """``reorder``: for a float32 model (XLA's order), ``() -> (exact sum, sum of |products|,
    K)`` in float64, so a difference of summation order is told apart."""
    z = zeroed_or_nonfinite(rec, ref)
    if z:
        ctx.full()
        return labelled(c, "zeroed-or-nonfinite", z)
    if not ctx.full():
        return labelled(c, None, "not analysed (only the first difference is)")
    for name, f in bf16:
        other = _try(f)
        if other is not None and compare(rec, other, "float32")[1] == c.elements:
            return labelled(
                c,
                "wrong-dtype",
                "equals the GEMM of the operands' inputs "
                f"rounded to bfloat16 ({name}), not of the recipe's codes",
            )
    best: tuple[float, str | None] = (c.share, None)
    for name, f in alts:
        other = _try(f)
        if other is None:
            continue
        n, eq, _, _ = compare(rec, other, "float32")
        if eq == n:
            return labelled(c, "accumulator", f"equals, bit for bit, the GEMM of the same "
                             f"codes by {name}")  # fmt: skip
        if eq / n > best[0]:
            best = (eq / n, name)
    if best[1] is not None and best[0] >= _MAX_CANDIDATES_SHARE:
        return labelled(
            c,
            "accumulator",
            f"{100 * best[0]:.3f}% bit-equal to the GEMM of "
            f"the same codes by {best[1]} ({100 * c.share:.3f}% to the named model)",
        )
    if reorder is not None:
        exact, absum, k = reorder()
        if within_reordering(np.asarray(rec), exact, absum, k, out_bits):
            what = f"{c.elements - c.equal} outputs differ (max {c.max_ulp} ulp)"
            return labelled(c, "accumulator", (
                f"float32 sums of the same products in another order: {what}, each within "
                f"float32's bound for summing {k} products in any order (XLA's order depends "
                "on the program)"))  # fmt: skip
    near = "" if best[1] is None else f"; closest model {best[1]} ({100 * best[0]:.3f}%)"
    return labelled(c, "unknown", f"{c.elements - c.equal} outputs differ, max "
                     f"{c.max_ulp} ulp{near}")  # fmt: skip


def _try(f: Callable[[], Any]) -> Any:
    try:
        return f()
    except (M.NotModelled, ValueError):
        return None


def exact_sums(
    operands: dict[str, Any], inputs: dict[str, Any], hp: bool, m: int, n: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The exact (float64) GEMM of the recorded operands, the sum of its |products| and K."""
    if hp:
        a, b, fa, fb = inputs["lhs"], inputs["rhs"], None, None
    else:
        qa, qb = operands["lhs"], operands["rhs"]
        a, b = (np.asarray(q.block_values(), np.float64) for q in (qa, qb))
        fa = None if qa.row_inv is None else np.asarray(qa.row_inv, np.float64)
        fb = None if qb.row_inv is None else np.swapaxes(np.asarray(qb.row_inv, np.float64), -1,
                                                         -2)  # fmt: skip
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    exact = np.einsum("bmk,bnk->bmn", a, b)[:, :m, :n]
    absum = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b))[:, :m, :n]
    for f in (fa, fb):
        if f is not None:
            exact, absum = exact * f, absum * np.abs(f)
    return exact, absum, a.shape[-1]


OUT_BITS = {"float32": 24, "bfloat16": 8, "float16": 11}


def plain_exact(lhs: ArrayLike, rhs: ArrayLike, g: dict) -> tuple[np.ndarray, np.ndarray, int]:
    """The exact (float64) dot_general of a plain site's operands, laid out as its output,
    the sum of its |products| and K."""
    (lc, rc), (lb, rb) = g["dimension_numbers"]

    def canon(
        x: ArrayLike, contract: Sequence[int], batch: Sequence[int]
    ) -> tuple[np.ndarray, list[int]]:
        x = np.asarray(x).astype(np.float64)
        free = [d for d in range(x.ndim) if d not in contract and d not in batch]
        xt = np.transpose(x, (*batch, *free, *contract))
        shape = [x.shape[d] for d in free]
        k = int(np.prod([x.shape[d] for d in contract], dtype=np.int64))
        bsz = int(np.prod([x.shape[d] for d in batch], dtype=np.int64))
        return xt.reshape(bsz, -1, k), shape

    a, lfree = canon(lhs, lc, lb)
    b, rfree = canon(rhs, rc, rb)
    bshape = [np.shape(lhs)[d] for d in lb]
    out = (*bshape, *lfree, *rfree)
    exact = np.einsum("bmk,bnk->bmn", a, b).reshape(out)
    absum = np.einsum("bmk,bnk->bmn", np.abs(a), np.abs(b)).reshape(out)
    return exact, absum, a.shape[-1]
