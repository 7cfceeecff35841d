"""Diagnose any JAX function: where a policy, an emulate model or a recipe departs from the
function as written, which operations matter most, and which to keep in high precision.

- :func:`compare_function` (``diagnose.compare(fn, args, reference=, candidate=)``) runs both
  sides on the same arguments in one jitted program and reports the first operation, in
  program order, whose result differs by more than ``threshold`` (relative L2), and ranks the
  operations by their contribution to the output's difference: each operation's own rounding
  weighted by the output's sensitivity to it (:func:`precisionlab.emulate.attribute`).
- :func:`bisect_function` (``diagnose.bisect(fn, args, ...)``): the smallest set of the
  candidate's operations whose return to high precision brings the output within
  ``tolerance`` of the reference (the search of :func:`precisionlab.diagnose.bisect`).
- :func:`autoswitch_function` (``diagnose.autoswitch(fn, args, recipe=...)``): which of a
  recipe's matmuls Transformer Engine's precision-debug thresholds would switch to high
  precision on these arguments (``fn`` returns a scalar loss: the output cotangent's
  quantization is measured too).

A side is ``"fp32"`` (the function as written), a policy (``"c=f16"``, ``"bf16"``: every
operation rounded as XLA's GPU backend computes it), ``emulate(fn, ...)`` (an emulate model,
e.g. the H100's tensor cores), or a recipe (``"current"``, ``"mxfp8"``, a
:class:`~precisionlab.recipes.Recipe`, ``recipes.apply(fn, ...)``); see
:meth:`precisionlab.emulate.Side.of`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from precisionlab import recipes
from precisionlab.diagnose._autoswitch import STAT_NAMES, AutoSwitchRecipe, SwitchResult
from precisionlab.diagnose._autoswitch import autoswitch as _autoswitch_unit
from precisionlab.diagnose._bisect import BisectRun, SearchRuns, search
from precisionlab.diagnose._bisect import bisect as _bisect_units
from precisionlab.diagnose._compare import compare as _compare_units
from precisionlab.diagnose._compare import relative_difference
from precisionlab.emulate import Attribution, OpAttribution, Side, attribute
from precisionlab.experiments._config import Unit
from precisionlab.mixed import filter_jit
from precisionlab.recipes._dot import as_recipe

__all__ = [
    "FunctionBisect",
    "FunctionComparison",
    "autoswitch",
    "autoswitch_function",
    "bisect",
    "bisect_function",
    "compare",
    "compare_function",
]


def compare(ref: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
    """``compare(REF, OTHER, options, say=, dump=)``: two experiment variants in lockstep
    (:func:`precisionlab.diagnose._compare.compare`, a
    :class:`~precisionlab.diagnose.CompareResult`); ``compare(fn, args, reference="fp32",
    candidate=..., threshold=)``: any JAX function, operation by operation, with the
    operations ranked by their contribution to the output's difference
    (:func:`compare_function`, a :class:`FunctionComparison`)."""
    if isinstance(ref, Unit):
        return _compare_units(ref, other, *args, **kwargs)
    return compare_function(ref, other, *args, **kwargs)


def bisect(fail: Any, passing: Any, *args: Any, **kwargs: Any) -> Any:
    """``bisect(FAIL, PASS, options, say=)``: the layers of an experiment variant to return
    to high precision (:func:`precisionlab.diagnose._bisect.bisect`); ``bisect(fn, args,
    reference=, candidate=, tolerance=, ops=)``: the operations of any JAX function
    (:func:`bisect_function`, a :class:`FunctionBisect`)."""
    if isinstance(fail, Unit):
        return _bisect_units(fail, passing, *args, **kwargs)
    return bisect_function(fail, passing, *args, **kwargs)


def autoswitch(unit: Any, *args: Any, **kwargs: Any) -> SwitchResult:
    """``autoswitch(VARIANT, options, say=)``: train an experiment variant with switching
    matmuls (:func:`precisionlab.diagnose._autoswitch.autoswitch`); ``autoswitch(fn, args,
    recipe=, underflow=, mse=)``: which matmuls of any JAX loss would switch
    (:func:`autoswitch_function`)."""
    if isinstance(unit, Unit):
        return _autoswitch_unit(unit, *args, **kwargs)
    return autoswitch_function(unit, *args, **kwargs)


def _args(args: Any) -> tuple:
    return args if isinstance(args, tuple) else (args,)


def _positive(name: str, v: Any, low: float = 0.0, strict: bool = True) -> float:
    bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    if bad or (v <= low if strict else v < low):
        what = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"{name} must be a number {what}, got {v!r}")
    return float(v)


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


@dataclasses.dataclass(frozen=True)
class FunctionComparison:
    """What :func:`compare_function` found. ``first``: the first operation in program order
    whose result differs from the reference's by more than ``threshold`` (None: none does);
    ``attribution``: every operation's difference, own error and contribution
    (:class:`precisionlab.emulate.Attribution`)."""

    function: str
    reference: str
    candidate: str
    threshold: float
    first: OpAttribution | None
    attribution: Attribution

    @property
    def output_rel(self) -> float:
        """The relative difference of the function's output (all float leaves)."""
        return self.attribution.output_rel

    def ranked(self) -> tuple[OpAttribution, ...]:
        """The operations most consequential for the output's difference first."""
        return self.attribution.ranked()

    def share(self, op: OpAttribution) -> float:
        """``op``'s contribution as a fraction of the output's difference (NaN if none)."""
        n = self.attribution.output_norm
        if not n or not math.isfinite(n) or not math.isfinite(op.contribution):
            return math.nan
        return op.contribution / n

    def summary(self, top: int = 3) -> str:
        """One line: the output's difference, where it first crosses the threshold and the
        operations most responsible."""
        at = self.attribution
        head = (
            f"{self.candidate} vs {self.reference}: output differs by {_num(at.output_rel)} "
            "(relative)"
        )
        if self.first is not None:
            head += f"; first over {self.threshold:g}: {self.first.name} ({_num(self.first.rel)})"
        else:
            head += f"; no operation differs by more than {self.threshold:g}"
        ranked = self.ranked()[:top]
        if ranked:
            head += "; most consequential: " + ", ".join(self._label(o) for o in ranked)
        return head

    def _label(self, o: OpAttribution) -> str:
        if o.new_nonfinite:
            return f"{o.name} (turns {o.new_nonfinite} values inf/NaN)"
        s = self.share(o)
        return f"{o.name} ({_pct(s)})" if math.isfinite(s) else o.name

    def text(self, top: int = 10) -> str:
        """The ``top`` most consequential operations as a table, then the summary line."""
        at = self.attribution
        lines = [
            f"compare {self.candidate} with {self.reference} on {self.function}: "
            f"{len(at.ops)} operations, {sum(o.replaced for o in at.ops)} computed differently",
        ]
        if math.isfinite(at.explained):
            lines.append(
                f"output difference {_num(at.output_norm)} (L2), {_num(at.output_rel)} relative; "
                f"the first-order contributions add up to {at.explained:.1%} of it"
            )
        if self.first is not None:
            f = self.first
            lines.append(
                f"first operation over {self.threshold:g}: {f.name} (relative difference "
                f"{_num(f.rel)}) at {f.site.where or f.site.scope or '-'}"
            )
        rows = self.ranked()[:top]
        if rows:
            lines += ["", f"{'rank':>4}  {'operation':<24} {'share':>8} {'own err':>9} "
                      f"{'rel diff':>9}  where"]  # fmt: skip
            for i, o in enumerate(rows, 1):
                share = "inf/NaN" if o.new_nonfinite else _pct(self.share(o))
                where = o.site.where or o.site.scope or "-"
                lines.append(
                    f"{i:>4}  {o.name:<24} {share:>8} {_num(o.local):>9} {_num(o.rel):>9}  {where}"
                )
        return "\n".join([*lines, "", self.summary()])


def _pct(s: float) -> str:
    """A share as a percentage, 0.0% for anything under 0.05% either way (no "-0.0%")."""
    if not math.isfinite(s):
        return "-"
    return "0.0%" if abs(s) < 5e-4 else f"{s:.1%}"


def _num(x: float) -> str:
    return "inf" if x == math.inf else "nan" if math.isnan(x) else f"{x:.3g}"


def compare_function(
    fn: Callable,
    args: Any,
    *,
    reference: Any = "fp32",
    candidate: Any,
    threshold: float = 0.1,
    kwargs: Mapping | None = None,
    weight: str = "rhs",
    key: jax.Array | None = None,
) -> FunctionComparison:
    """Run ``fn(*args, **kwargs)`` as ``reference`` and as ``candidate`` (see the module
    docstring for what a side may be) and compare them operation by operation.

    Args:
      fn: any JAX function (a Flax NNX or linen model's call, an Equinox model, a loss).
      args: its arguments (a tuple; a single array is one argument).
      reference / candidate: the two sides; ``reference`` defaults to ``fn`` as written.
      threshold: the relative difference (> 0) that counts as a break (``first``).
      weight: for a recipe side: which matmul operand is the weight (``"lhs"`` for
        Equinox's ``w @ x``).
      key: for a recipe with stochastic rounding (NVFP4).

    Returns:
      A :class:`FunctionComparison` (``.text()``, ``.summary()``, ``.ranked()``).
    """
    threshold = _positive("threshold", threshold)
    args, kwargs = _args(args), dict(kwargs or {})
    a = Side.of(reference, fn, args, kwargs, weight=weight, key=key)
    b = Side.of(candidate, fn, args, kwargs, weight=weight, key=key)
    at = attribute(fn, args, a, b, kwargs=kwargs)
    first = next((o for o in at.ops if o.rel > threshold), None)
    return FunctionComparison(_fn_name(fn), a.label, b.label, threshold, first, at)


@dataclasses.dataclass
class FunctionBisect(SearchRuns):
    """The search of :func:`bisect_function`: the sides, the output's relative difference
    without help (``base``), the tolerance, the candidate operations (names), every run
    (label ``"reference"`` for the candidate as it is, ``"search"`` after; ``loss`` holds the
    output's relative difference), the answer (the operations to keep in high precision;
    ``()``: none needed; None: no set of the candidates passes) and ``budget``."""

    function: str
    reference: str
    candidate: str
    base: float
    tolerance: float

    def text(self) -> str:
        """The runs and the answer."""
        lines = [
            f"bisect {self.candidate} against {self.reference} on {self.function}: pass when the "
            f"output's relative difference <= {self.tolerance:g} ({_num(self.base)} as it is)"
        ]
        for r in self.runs:
            hp = ", ".join(r.layers) if r.layers else "none"
            if len(r.layers) > 6:
                hp = f"{', '.join(r.layers[:3])}, ... ({len(r.layers)} operations)"
            lines.append(
                f"{r.label:<9} high precision: {hp} -> {_num(r.loss)}: "
                f"{'pass' if r.passed else 'fail'}"
            )
        if self.answer is None:
            lines.append("answer: no set of the candidate operations passes")
        elif not self.answer:
            lines.append(f"answer: {self.candidate} passes as it is")
        else:
            lines.append(f"answer: keep {', '.join(self.answer)} in high precision")
        lines.append(
            f"{self.search_runs} search run(s) for {len(self.candidates)} candidate operations "
            f"(one culprit needs at most {self.budget})"
        )
        return "\n".join(lines)


def _floats(tree: Any) -> np.ndarray:
    leaves = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)
              if np.issubdtype(np.asarray(x).dtype, np.floating)
              or str(np.asarray(x).dtype) == "bfloat16"]  # fmt: skip
    return np.concatenate(leaves) if leaves else np.zeros(0)


def _matches(op: OpAttribution, pattern: str) -> bool:
    s = op.site
    full = f"{s.scope}/{op.name}" if s.scope else op.name
    targets = (op.name, s.name, s.scope, full)
    return pattern in targets or any(fnmatch.fnmatchcase(t, pattern) for t in targets)


def bisect_function(
    fn: Callable,
    args: Any,
    *,
    reference: Any = "fp32",
    candidate: Any,
    tolerance: float = 0.01,
    ops: Sequence[str] = (),
    kwargs: Mapping | None = None,
    weight: str = "rhs",
    key: jax.Array | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> FunctionBisect:
    """The smallest set of ``candidate``'s operations whose return to high precision (each
    computed as written, its result passed on unrounded: :meth:`Side.without`) brings the
    output within ``tolerance`` (relative L2 difference) of ``reference``'s.

    The search is :func:`precisionlab.diagnose.bisect`'s over the operations the candidate
    changes (a non-zero own error), in program order (``ops``: glob patterns on the names
    ``"exp[0]"``, the scopes or ``scope/name``, to restrict them): halving as if one
    operation were the culprit (ceil(log2 N) + 1 runs), then, when several interact, a
    1-minimal set. Each run compiles the function once more."""
    tol = _positive("tolerance", tolerance, strict=False)
    args, kwargs = _args(args), dict(kwargs or {})
    a = Side.of(reference, fn, args, kwargs, weight=weight, key=key)
    b = Side.of(candidate, fn, args, kwargs, weight=weight, key=key)
    ref = _floats(jax.device_get(filter_jit(lambda *x: a.run(fn, x, kwargs))(*args)))
    # the operations the candidate changes (not those it computes exactly: a reshape), in
    # program order, from a comparison
    at = attribute(fn, args, a, b, kwargs=kwargs)
    moved = {o.site.path for o in at.ranked()}
    cands = [o for o in at.ops if o.site.path in b.sites and o.site.path in moved]
    for p in ops:
        if not any(_matches(o, p) for o in cands):
            some = ", ".join(o.name for o in cands[:20]) or "none"
            raise ValueError(f"ops pattern {p!r} matches no operation of {b.label}; e.g. {some}")
    if ops:
        cands = [o for o in cands if any(_matches(o, p) for p in ops)]
    by_name = {o.name: o.site.path for o in cands}
    names = tuple(by_name)
    runs: list[BisectRun] = []

    def measure(kept: Sequence[str]) -> float:
        side = b.without(by_name[n] for n in kept)
        out = jax.device_get(filter_jit(lambda *x: side.run(fn, x, kwargs))(*args))
        return relative_difference(ref, _floats(out))

    def passes(rel: float) -> bool:
        return math.isfinite(rel) and rel <= tol

    base = measure(())
    runs.append(BisectRun("reference", b.label, (), base, passes(base)))
    say(f"{b.label} as it is: output differs by {_num(base)}")

    def test(kept: Sequence[str]) -> bool:
        rel = measure(kept)
        runs.append(BisectRun("search", b.label, tuple(kept), rel, passes(rel)))
        say(f"{len(kept)} operation(s) in high precision -> {_num(rel)}")
        return passes(rel)

    answer = () if passes(base) else search(names, test)
    return FunctionBisect(
        _fn_name(fn), a.label, b.label, base, tol, candidates=names, runs=runs, answer=answer
    )


def autoswitch_function(
    fn: Callable,
    args: Any,
    *,
    recipe: Any,
    underflow: float = 0.05,
    mse: float = 1e-4,
    include: Sequence[int | str] | None = None,
    exclude: Sequence[int | str] = (),
    kwargs: Mapping | None = None,
    weight: str = "rhs",
) -> SwitchResult:
    """Which matmuls and convolutions of ``recipe`` (a name pads as ``recipes.apply`` does)
    applied to ``fn`` (a scalar loss of its first argument) switch to high precision on these
    arguments under :class:`AutoSwitchRecipe`'s rule: an operand (``x``, ``w``) or the output
    cotangent (``g``) whose quantization underflows in more than ``underflow`` of its nonzero
    elements, or whose MSE exceeds ``mse``. One forward and backward pass (``weight``: which
    operand is the weight, ``"lhs"`` for Equinox's ``w @ x``); the result's ``sites`` give every
    matmul's statistics and :attr:`SwitchResult.switched_sites` the names to pass to
    ``recipes.apply(..., exclude=...)``."""
    underflow = _positive("underflow", underflow, strict=False)
    mse = _positive("mse", mse, strict=False)
    if underflow > 1:
        raise ValueError(f"underflow must be a fraction in [0, 1], got {underflow!r}")
    # a name pads a block recipe's contractions, as recipes.apply does
    rec = as_recipe(recipe) if isinstance(recipe, str) else recipe
    if not isinstance(rec, recipes.Recipe):
        raise TypeError(f"recipe must be a recipe name or a Recipe, got {type(recipe).__name__}")
    if weight not in recipes.WEIGHT_OPERANDS:
        raise ValueError(
            f"unknown weight {weight!r}; allowed: {', '.join(recipes.WEIGHT_OPERANDS)}"
        )
    spec = AutoSwitchRecipe(
        rec,
        None if include is None else tuple(include),
        tuple(exclude),
        underflow=underflow,
        mse=mse,
        weight=weight,
    )
    args, kwargs = _args(args), dict(kwargs or {})
    applied = spec.apply(fn)
    state = applied.init_state(*args, **kwargs)
    vg = applied.value_and_grad()

    def step(st: Any, *a: Any) -> tuple[Any, Any]:
        value, _, observed = vg(st, *a, **kwargs)
        return value, applied.update_state(st, observed)

    value, new = jax.device_get(filter_jit(step)(state, *args))
    if np.ndim(value):
        raise ValueError(
            f"autoswitch needs fn to return a scalar loss, got shape {np.shape(value)}"
        )
    sites = {s.name: s for s in applied.sites(*args, **kwargs)}
    rows = []
    for name, st in new.items():
        s = sites[name]
        switched = bool(st["switched"] > 0)
        rows.append(
            {
                "site": name,
                "layer": s.scope or "-",
                "shape": " x ".join(str(list(x)) for x in s.in_shapes),
                "switched": switched,
                "step": 1 if switched else None,
                "stats": dict(zip(STAT_NAMES, map(float, np.asarray(st["last"])), strict=True)),
                "trip": dict(zip(STAT_NAMES, map(float, np.asarray(st["trip"])), strict=True))
                if switched
                else None,
            }
        )
    return SwitchResult(
        variant=_fn_name(fn),
        recipe=rec.name,
        underflow=underflow,
        mse=mse,
        steps_done=1,
        final_loss=float(value),
        sites=rows,
        losses=[float(value)],
    )
