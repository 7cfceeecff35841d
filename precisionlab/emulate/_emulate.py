"""``emulate(fn, policy)``: every floating-point operation of ``fn`` computed as XLA's GPU
backend computes it.

How it works: ``fn`` is traced to a jaxpr and re-evaluated by :mod:`precisionlab.intercept`
with one rule matched on every first-order primitive of the program. The rule computes the
operation as :mod:`precisionlab.emulate._model` says XLA:GPU does (correctly rounded
transcendentals, ``integer_pow`` as rounded multiplies, true division; matmuls through the
``hardware=`` model of :mod:`precisionlab.emulate._matmul`), applies XLA's constant folding
(:mod:`precisionlab.emulate._simplify`), and rounds each floating result to its target dtype
(:func:`precisionlab.mixed._numerics.enforce`: ``lax.reduce_precision``, which XLA never
elides, with float16's subnormals kept, or the project's codec for float8_e4m3fn). The target
is the value's own dtype where that is 16 bits or narrower; a float32 value keeps float32 in
a program that computes in the compute dtype itself (its deliberate upcasts, e.g.
``jnp.mean``'s float32 sum), and is rounded to the compute dtype in a float32 program emulated
under a 16-bit policy. Operands are rounded to their targets too (once: a value an earlier
operation already rounded is not rounded again).

Arrays keep the dtypes the program gives them: a float32 program emulated under ``c=bf16``
computes on float32 arrays that hold bfloat16 values. Forward reductions in float32 stay
float32 (rounded once where the result is rounded) while the policy keeps ``reduce`` in
float32 (its default), else every partial sum is rounded.

The backward pass: every operation with a floating operand and result is a ``custom_vjp``
whose backward pass is the primitive's own VJP run under the same rule (``tanh``'s as jax 0.11
writes it; a multiply by a literal folds its constant as XLA does), so each backward
operation is rounded too; a backward reduction (the transpose of a broadcast, e.g. a bias
gradient) typed in a 16-bit format rounds every partial sum. The contributions of a value's
several uses are summed by JAX and rounded once, where the next backward operation takes
them. Forward-mode autodiff is therefore refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from precisionlab.emulate import _matmul, _model, _simplify, _subnormal
from precisionlab.emulate._simplify import Folds
from precisionlab.intercept import Context, Intercepted, Site, compute_line, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed._numerics import enforce
from precisionlab.mixed._policy import Policy, get_policy
from precisionlab.recipes import accumulate, canonical_operand

__all__ = ["Emulated", "emulate"]

# the arithmetic primitives, by the names the constant folding below is written in
ADD, SUB, MUL, DIV = boundary.ADD, boundary.SUB, boundary.MUL, boundary.DIV


def _exact(eqn: boundary.Eqn) -> bool:
    name = eqn.primitive.name
    if name == boundary.CONVERT:  # float to an equal or wider float keeps the value
        src, dst = _float_dtype(eqn.invars[0].aval), _float_dtype(eqn.outvars[0].aval)
        return (
            src is not None
            and dst is not None
            and (
                jnp.finfo(dst).maxexp >= jnp.finfo(src).maxexp
                and jnp.finfo(dst).minexp <= jnp.finfo(src).minexp
                and jnp.finfo(dst).nmant >= jnp.finfo(src).nmant
            )
        )
    return name in boundary.EXACT


def _float_dtype(x: object) -> np.dtype | None:
    """The dtype of an array or abstract value when it is floating, else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        return None
    return np.dtype(dtype)


def _is_float(x: object) -> bool:
    return _float_dtype(x) is not None


def _has_float(eqn: boundary.Eqn) -> bool:
    avals = [v.aval for v in (*eqn.invars, *eqn.outvars)]
    return any(_is_float(a) for a in avals)


def collect(jaxpr: boundary.Jaxpr, found: set[str]) -> None:
    """Names of the first-order primitives with a floating operand or result, recursively
    (every first-order primitive: one emulate has no special rule for, such as jax 0.11's
    ``one_minus_square``, is rounded by the generic rule for its output dtype). Those inside
    a higher-order primitive the interceptor cannot enter (``shard_map``) are collected too:
    the interceptor then names them in its error, so that ``keep=`` can leave them be."""
    for eqn in jaxpr.eqns:
        subs = boundary.subprograms(eqn)
        for sub in subs:
            collect(boundary.open_jaxpr(sub)[0], found)
        if not subs and _has_float(eqn):
            found.add(eqn.primitive.name)


def _computes_in(jaxpr: boundary.Jaxpr, dtype: np.dtype) -> bool:
    """Whether any floating value of ``jaxpr`` (or its sub-programs) has ``dtype``: the
    program is then typed in the compute dtype itself, and its float32 values are deliberate."""
    for eqn in jaxpr.eqns:
        for v in (*eqn.invars, *eqn.outvars):
            if _float_dtype(v.aval) == dtype:
                return True
        for sub in boundary.subprograms(eqn):
            if _computes_in(boundary.open_jaxpr(sub)[0], dtype):
                return True
    return any(_float_dtype(v.aval) == dtype for v in jaxpr.invars)


def _narrow_dot(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: lax.DotDimensionNumbers, bits: int
) -> jax.Array:
    """``dot_general`` of float32 operands with an m-bit accumulator (recipes.accumulate)."""
    (lc, rc), (lb, rb) = dimension_numbers
    a, lfree = canonical_operand(lhs, lc, lb)
    b, rfree = canonical_operand(rhs, rc, rb)
    out = accumulate(a.astype(jnp.float32), b.astype(jnp.float32), bits)
    return out.reshape((*(lhs.shape[d] for d in lb), *lfree, *rfree))


def _reduce_rounded(x: jax.Array, axes: Sequence[int], dtype: np.dtype) -> jax.Array:
    """``reduce_sum`` with every partial sum rounded to ``dtype``: what XLA computes for a
    reduction typed in a 16-bit format (its CPU backend rewrites a bfloat16 one into this very
    reducer). The order of the additions is XLA's (sequential along the reduced axes when the
    reduction is not fused into other work; a fused float16 reduction may be reordered)."""
    zero = jnp.zeros((), x.dtype)
    return lax.reduce(x, zero, lambda a, b: enforce(a + b, dtype), tuple(axes))


@dataclasses.dataclass
class _RoundRule:
    """The interceptor rule: each operation computed as XLA's GPU backend would
    (:mod:`precisionlab.emulate._model`), its result rounded to its target dtype.

    The target of a floating value: its own dtype where that is narrower than float32; for a
    float32 (or wider) value, the compute ``dtype`` unless ``program_typed`` (the program
    itself computes in the compute dtype, so its float32 operations are deliberate upcasts,
    kept). Forward operations with a floating operand and result become ``custom_vjp``
    functions whose backward pass (the primitive's own VJP) is run through this rule again,
    with ``backward=True``.
    """

    dtype: np.dtype
    primitives: tuple[str, ...]
    accumulate_bits: int | None
    emits = False  # never an Emit: without state or key, sub-programs are rewritten by type
    reduce_fp32: bool
    backward: bool = False
    program_typed: bool = False
    # Values already rounded in this trace, by id (the reference keeps the id unique).
    rounded: dict[int, Any] = dataclasses.field(default_factory=dict)
    folds: Folds = dataclasses.field(default_factory=Folds)
    # Cotangents known to be ``ct * c`` (by the backward of a multiply by a literal), for the
    # backward passes of this trace's operations to fold as XLA does.
    bwd_folds: Folds = dataclasses.field(default_factory=Folds)
    matmul: _matmul.MatmulModel = _matmul.float32_once

    def target(self, aval: object) -> np.dtype | None:
        """The dtype a value of ``aval`` is rounded to (None: left as computed)."""
        own = _float_dtype(aval)
        if own is None:
            return None
        if own.itemsize < 4:
            return own
        return None if self.program_typed else np.dtype(self.dtype)

    def _rnd(self, x: jax.typing.ArrayLike, own: np.dtype) -> jax.Array:
        """``x`` rounded to its own dtype ``own`` where that is narrow, then (policy mode) to
        the compute dtype; returned in ``own``."""
        y = jnp.asarray(x)
        if own.itemsize < 4:
            y = enforce(y.astype(jnp.promote_types(own, jnp.float32)), own)
        if not self.program_typed:
            y = enforce(y, self.dtype)
        return y.astype(own)

    def _narrowed(self, x: jax.Array, aval: object) -> jax.Array:
        """``x`` (already rounded to its target) in its target dtype where that is narrower."""
        tgt, own = self.target(aval), _float_dtype(aval)
        if tgt is None or own is None or np.dtype(tgt).itemsize >= own.itemsize:
            return x
        return jnp.asarray(x).astype(tgt)

    def _round(self, x: jax.Array, aval: object) -> jax.Array:
        own = _float_dtype(aval)
        if own is None or self.target(aval) is None or id(x) in self.rounded:
            return x
        y = self._rnd(x, own)
        self.rounded[id(y)] = y
        return y

    def _model(self, eqn: boundary.Eqn, ins: list[jax.Array]) -> list[jax.Array] | None:
        """The operation as XLA:GPU computes it, where that differs from binding the primitive
        on CPU and rounding (None: bind and round)."""
        name, params = eqn.primitive.name, eqn.params
        out_aval = eqn.outvars[0].aval if eqn.outvars else None
        tgt, out = self.target(out_aval), _float_dtype(out_aval)
        if tgt is None or out is None:
            return None
        if name in boundary.TRANSCENDENTAL and _model.is_narrow(tgt):
            return [_model.tabled_unary(name, ins[0], tgt)]
        if name == boundary.LOGISTIC and _model.is_narrow(tgt):
            return [_model.logistic(ins[0], tgt, lambda v: self._rnd(v, out))]
        if name == boundary.INTEGER_POW:
            return [_model.integer_power(ins[0], params["y"], lambda v: self._rnd(v, out))]
        if name == boundary.DIV and _is_float(out_aval):
            plain = self._rnd(_model.divide(ins[0], ins[1]), out)
        elif name in boundary.ARITHMETIC and _is_float(out_aval):
            plain = self._rnd(boundary.bind(eqn.primitive, params, *ins)[0], out)
        else:
            return None
        if np.dtype(tgt) != np.dtype(jnp.bfloat16) or not all(
            _is_float(v.aval) for v in eqn.invars
        ):
            return [plain]
        # bfloat16's subnormals are float32's, which this CPU flushes: computed exactly
        return [_subnormal.arithmetic(name, ins[0], ins[1], plain).astype(out)]

    def _compute(self, eqn: boundary.Eqn, ins: list[jax.Array]) -> list[jax.Array]:
        """The primitive on rounded operands, results rounded."""
        name, params = eqn.primitive.name, eqn.params
        modelled = self._model(eqn, ins)
        outs: list[jax.Array]
        if modelled is not None:
            outs = modelled
        elif self.accumulate_bits is not None and name == boundary.DOT_GENERAL:
            out = _narrow_dot(ins[0], ins[1], params["dimension_numbers"], self.accumulate_bits)
            outs = [out.astype(boundary.aval(eqn.outvars[0]).dtype)]
        elif name == boundary.DOT_GENERAL and _is_float(eqn.outvars[0].aval):
            # operands in their target format (exact: they hold its values), so that a
            # tensor-core model sees 16-bit inputs in a float32 program under a 16-bit policy
            lhs, rhs = [self._narrowed(x, v.aval) for x, v in zip(ins, eqn.invars, strict=True)]
            outs = [self.matmul(lhs, rhs, params, boundary.aval(eqn.outvars[0]).dtype)]
        elif name == boundary.CONV and _is_float(eqn.outvars[0].aval):
            # the implicit GEMM over the patches, through the same matmul model
            lhs, rhs = [self._narrowed(x, v.aval) for x, v in zip(ins, eqn.invars, strict=True)]
            out_dtype = boundary.aval(eqn.outvars[0]).dtype
            if self.accumulate_bits is not None:
                bits = self.accumulate_bits
                model: _matmul.MatmulModel = lambda a, b, p, dt: _narrow_dot(  # noqa: E731
                    a, b, p["dimension_numbers"], bits
                )
            else:
                model = self.matmul
            outs = [_matmul.implicit_gemm(model, lhs, rhs, params, out_dtype).astype(out_dtype)]
        elif (
            name == boundary.REDUCE_SUM
            and (self.backward or not self.reduce_fp32)
            and (tgt := self.target(eqn.outvars[0].aval)) is not None
        ):
            outs = [_reduce_rounded(ins[0], params["axes"], tgt)]
        else:
            outs = boundary.bind(eqn.primitive, params, *ins)
            if _exact(eqn):
                for y in outs:
                    self.rounded[id(y)] = y
                return outs
        return [self._round(y, v.aval) for y, v in zip(outs, eqn.outvars, strict=True)]

    def _simplified(
        self, eqn: boundary.Eqn, operands: tuple[jax.Array, ...]
    ) -> list[jax.Array] | None:
        """XLA's constant folding (:mod:`precisionlab.emulate._simplify`) of a forward
        ``mul``/``div``/``add``/``sub`` with a literal operand; None where none applies."""
        name = eqn.primitive.name
        if self.backward or name not in boundary.ARITHMETIC or len(eqn.invars) != 2:
            return None
        aval = eqn.outvars[0].aval
        tgt, own = self.target(aval), _float_dtype(aval)
        if tgt is None or own is None or not _model.is_narrow(tgt):
            return None
        lits = [boundary.is_literal(v) for v in eqn.invars]
        if lits[0] == lits[1] or (name in (DIV, SUB) and lits[0]):
            return None
        c = _simplify.constant(operands[lits.index(True)])
        if c is None:
            return None
        a = operands[lits.index(False)]
        a_aval = boundary.aval(eqn.invars[lits.index(False)])
        if tuple(a_aval.shape) != tuple(boundary.aval(eqn.outvars[0]).shape):
            return None
        if name in (MUL, DIV):
            kind, c = MUL, (c if name == MUL else _simplify.reciprocal(c, tgt))
        else:
            kind, c = ADD, (c if name == ADD else -c)
        made = self.folds.of(a)
        if made is not None and made[0] == kind:
            a, c = made[1], _simplify.fold(kind, made[2], c, tgt)
        elif name in (MUL, ADD):
            return None  # nothing to fold: the operation as written
        identity = 1.0 if kind == MUL else 0.0
        if c == identity:
            out = a
        else:
            k = jnp.asarray(c, jnp.float32)
            wide = jnp.asarray(a).astype(jnp.float32)
            out = self._rnd(wide * k if kind == MUL else wide + k, own)
            self.rounded[id(out)] = out
        self.folds.note(out, kind, a, c)
        return [out]

    def _note_fold(
        self,
        eqn: boundary.Eqn,
        operands: tuple[jax.Array, ...],
        ins: list[jax.Array],
        outs: list[jax.Array],
    ) -> None:
        name = eqn.primitive.name
        if self.backward or name not in (MUL, ADD) or len(eqn.invars) != 2:
            return
        lits = [boundary.is_literal(v) for v in eqn.invars]
        if lits[0] == lits[1]:
            return
        c = _simplify.constant(operands[lits.index(True)])
        a_aval = boundary.aval(eqn.invars[lits.index(False)])
        if c is not None and tuple(a_aval.shape) == tuple(boundary.aval(eqn.outvars[0]).shape):
            self.folds.note(outs[0], name, ins[lits.index(False)], c)

    def apply(self, ctx: Context, *operands: jax.Array, **params: Any) -> list[jax.Array]:
        eqn = ctx.eqn
        if eqn is None:  # the interceptor passes every matched equation
            raise ValueError(f"emulate's rule needs the traced equation of {ctx.site.name}")
        simplified = self._simplified(eqn, operands)
        if simplified is not None:
            return simplified
        ins = [self._round(x, v.aval) for x, v in zip(operands, eqn.invars, strict=True)]
        differentiable = any(_is_float(v.aval) for v in eqn.invars) and any(
            _is_float(v.aval) for v in eqn.outvars
        )
        if self.backward or not differentiable:
            return self._compute(eqn, ins)
        outs = _with_rounded_vjp(self, eqn)(*ins)
        for y in outs:
            self.rounded[id(y)] = y
        self._note_fold(eqn, operands, ins, list(outs))
        return list(outs)


def _with_rounded_vjp(rule: _RoundRule, eqn: boundary.Eqn) -> Callable[..., tuple[jax.Array, ...]]:
    """``eqn``'s primitive (operands already rounded) as a custom_vjp function whose backward
    pass is the primitive's VJP emulated by a backward copy of ``rule``."""
    prim = eqn.primitive
    floats_in = [_is_float(v.aval) for v in eqn.invars]

    def bare(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(boundary.bind(prim, eqn.params, *xs))

    @jax.custom_vjp
    def op(*xs: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(rule._compute(eqn, list(xs)))

    def fwd(*xs: jax.Array) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        return op(*xs), xs

    def bwd(xs: tuple[jax.Array, ...], cts: tuple[jax.Array, ...]) -> tuple[jax.Array | None, ...]:
        scaled = _scaled_cotangent(rule, eqn, xs, cts)
        if scaled is not None:
            return scaled

        def back(xs: tuple[jax.Array, ...], cts: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            if prim.name == boundary.TANH:
                # jax >= 0.11's VJP: ct * one_minus_square(tanh x), which XLA computes as
                # (1 - t) * (1 + t)
                t = lax.tanh(xs[0])
                return (cts[0] * ((1 - t) * (1 + t)),)
            return jax.vjp(bare, *xs)[1](cts)

        em = Emulated(
            back, rule.dtype, (), rule.accumulate_bits, rule.reduce_fp32, True,
            program_typed=rule.program_typed, matmul=rule.matmul,
        )  # fmt: skip
        grads = em._call(xs, (xs, tuple(cts)), {})  # the residuals were rounded in the forward
        return tuple(g if f else None for g, f in zip(grads, floats_in, strict=True))

    op.defvjp(fwd, bwd)
    return op


def _scaled_cotangent(
    rule: _RoundRule, eqn: boundary.Eqn, xs: tuple[jax.Array, ...], cts: tuple[jax.Array, ...]
) -> tuple[jax.Array | None, ...] | None:
    """The backward pass of ``a * c`` or ``a / c`` (c a scalar literal) as XLA:GPU computes
    it: ``ct * c`` (``ct * (1/c)`` for a division, the reciprocal rounded), with the constant
    folded into the one that made ``ct`` where ``ct`` is itself ``b * c1`` (the GPU gradient
    of gelu's ``0.0447 * (0.798 * ...)`` multiplies once, by the folded constant). None for
    any other operation."""
    name = eqn.primitive.name
    if name not in (MUL, DIV) or len(eqn.invars) != 2 or len(cts) != 1:
        return None
    lits = [boundary.is_literal(v) for v in eqn.invars]
    if lits[0] == lits[1] or (name == DIV and lits[0]):
        return None
    i = lits.index(False)
    aval, lit = eqn.invars[i].aval, eqn.invars[1 - i]
    tgt, own = rule.target(aval), _float_dtype(aval)
    c = _simplify.constant(lit.val) if isinstance(lit, boundary.Literal) else None
    if (
        c is None or tgt is None or own is None or not _model.is_narrow(tgt)
        or tuple(boundary.aval(eqn.invars[i]).shape) != tuple(boundary.aval(eqn.outvars[0]).shape)
    ):  # fmt: skip
        return None
    if name == DIV:
        c = _simplify.reciprocal(c, tgt)
    ct = cts[0]
    made = rule.bwd_folds.of(ct)
    base = ct
    if made is not None and made[0] == MUL:
        base, c = made[1], _simplify.fold(MUL, made[2], c, tgt)
    wide = jnp.asarray(base).astype(jnp.float32) * jnp.asarray(c, jnp.float32)
    g = rule._rnd(wide, own)
    rule.bwd_folds.note(g, MUL, base, c)
    grads: list[jax.Array | None] = [None, None]
    grads[i] = g
    grads[1 - i] = jnp.zeros_like(xs[1 - i])
    return tuple(grads)


class Emulated:
    """``fn`` with every floating-point operation rounded to a compute format; see
    :func:`emulate`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        dtype: np.dtype,
        keep: tuple[int | str, ...],
        accumulate_bits: int | None,
        reduce_fp32: bool = True,
        backward: bool = False,
        program_typed: bool | None = None,
        matmul: _matmul.MatmulModel = _matmul.float32_once,
    ) -> None:
        self.program_typed, self.matmul = program_typed, matmul
        self.matmul_model: str | None = None  # the hardware= name (emulate sets it)
        self.fn, self.dtype, self.keep = fn, dtype, keep
        self.accumulate_bits, self.reduce_fp32, self.backward = (
            accumulate_bits, reduce_fp32, backward,
        )  # fmt: skip
        self.__wrapped__ = fn

    def _intercepted(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Intercepted, _RoundRule]:
        closed = boundary.trace(self.fn, args, kwargs)[0]
        found: set[str] = set()
        collect(closed.jaxpr, found)
        typed = self.program_typed
        if typed is None:
            typed = _computes_in(closed.jaxpr, np.dtype(self.dtype))
        rule = _RoundRule(
            self.dtype, tuple(sorted(found)) or (ADD,), self.accumulate_bits,
            self.reduce_fp32, self.backward, typed, matmul=self.matmul,
        )  # fmt: skip
        return intercept(self.fn, rule, exclude=self.keep), rule

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """The floating-point operations of ``fn`` on these arguments, in program order
        (``selected`` False: kept unrounded by ``keep``)."""
        with _keep_hint():
            return self._intercepted(args, kwargs)[0].sites(*args, **kwargs)

    def report(self, *args: Any, **kwargs: Any) -> str:
        """One line per floating-point operation (see :meth:`Site.describe`), then the
        compute-dtype line of the program's matmuls and convolutions
        (:func:`precisionlab.intercept.compute_line`) and what emulate rounds them to."""
        inter, rule = self._intercepted(args, kwargs)
        with _keep_hint():
            text = inter.report(*args, **kwargs)
        line = compute_line(inter.sites(*args, **kwargs))
        how = (
            "the program's own dtypes are kept" if rule.program_typed
            else f"emulate rounds every float32 result to {np.dtype(self.dtype).name}"
        )  # fmt: skip
        return f"{text}\n{line} ({how})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call((), args, kwargs)

    def _call(self, rounded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``__call__`` with the leaves of ``rounded`` known to be rounded already."""
        fn, rule = self._intercepted(args, kwargs)
        for x in jax.tree.leaves(rounded):
            rule.rounded[id(x)] = x
        try:
            with _keep_hint():
                return fn(*args, **kwargs)
        finally:
            rule.rounded.clear()
            rule.folds.clear()


@contextlib.contextmanager
def _keep_hint() -> Iterator[None]:
    """The interceptor's error for operations inside a higher-order primitive it cannot
    enter suggests its own option, ``exclude=[...]``; emulate's is ``keep=``: the same list,
    passed as it is, leaves those operations unrounded and the rest runs."""
    try:
        yield
    except boundary.UnsupportedPrimitive as err:
        text = str(err).replace(
            "would not be replaced: exclude it (exclude=",
            "would not be rounded: keep it unrounded (keep=",
        )
        raise boundary.UnsupportedPrimitive(text) from None


def emulate(
    fn: Callable[..., Any],
    policy: Policy | str | Any,
    *,
    keep: Sequence[int | str] | str = (),
    accumulate_bits: int | None = None,
    hardware: str | _matmul.MatmulModel = "h100-xla",
) -> Emulated:
    """``fn`` computed as XLA's GPU backend computes it, on any machine: each floating-point
    operation's result rounded to the dtype the program gives it (a 16-bit program's float32
    upcasts kept; a float32 program's results rounded to the policy's compute format),
    transcendental functions correctly rounded, XLA's constant folding applied
    (docs/guides/emulate.md states the model and its measured agreement with an H100).

    Args:
      fn: any JAX-traceable function: a Flax linen ``model.apply``, an NNX or Equinox module's
        call, a loss over a plain pytree. Array arguments are traced, other leaves are static.
        The result composes with ``jax.jit``, ``jax.vmap`` and reverse-mode autodiff
        (``jax.grad``, ``jax.vjp``); forward mode (``jax.jvp``, ``jacfwd``, ``hessian``) is
        refused by JAX, because each operation's rounded backward pass is a ``custom_vjp``.
      policy: a :class:`~precisionlab.mixed.Policy`, a policy string (``"c=f16"``), a jmp
        policy or a dtype; its ``compute_dtype`` is the format every result is rounded to.
      keep: operations left unrounded (computed in the program's own dtype, float32 for a
        float32 program): positions, names (``"exp[3]"``) or glob patterns over names and
        ``jax.named_scope`` scopes (``"*softmax*"``), as :func:`precisionlab.intercept.select`.
      accumulate_bits: None (default): matmuls follow ``hardware``; an int m in 1..23:
        ``dot_general`` partial sums are rounded to m mantissa bits after every product
        (:func:`precisionlab.recipes.accumulate`, a study model; a sequential scan, slow).
      hardware: the matmul model: ``"h100-xla"`` (default: the H100's tensor-core arithmetic
        with XLA's Triton split-K schedule, the :mod:`precisionlab.hardware` preset of that
        name), ``"float32"`` (products exact, float32 accumulation, rounded once to the
        result dtype; faster), any other preset or alias of ``precisionlab.hardware``
        (``"h100-cublaslt"``, ``"h100-fast"``, ``"a100"``, ...; ``"h100"`` is refused as
        ambiguous, naming the choices) or a callable ``(lhs, rhs, dot_general params,
        result dtype) -> result``. Only 8- and 16-bit operands take a tensor-core model;
        float32 ones are summed in float32.

    Returns:
      An :class:`Emulated`: call it like ``fn``; ``.report(...)`` lists the operations.
      Under ``recipes.apply`` pass ``hardware="float32"`` (the recipe's ``accumulate=`` then
      picks the hardware GEMM): a tensor-core model computes with integer operations, which
      leave no ``dot_general`` for the recipe to quantize (and no gradient once the recipe
      replaces emulate's backward rules); ``recipes.apply`` refuses that combination.
    """
    if not callable(fn):
        raise TypeError(f"emulate needs a callable, got {type(fn).__name__}")
    pol = get_policy(policy)
    if accumulate_bits is not None and (
        isinstance(accumulate_bits, bool)
        or not isinstance(accumulate_bits, int)
        or not 1 <= accumulate_bits <= 23
    ):
        raise ValueError(
            f"accumulate_bits must be None or an int in 1..23, got {accumulate_bits!r}"
        )
    if isinstance(keep, (str, int)):
        keep = (keep,)
    em = Emulated(
        fn, pol.compute_dtype, tuple(keep), accumulate_bits, "reduce" in pol.fp32_ops,
        matmul=_matmul.resolve(hardware),
    )  # fmt: skip
    # read by recipes.apply: a tensor-core model leaves no dot_general for a recipe to replace
    em.matmul_model = hardware if isinstance(hardware, str) and accumulate_bits is None else None
    return em
