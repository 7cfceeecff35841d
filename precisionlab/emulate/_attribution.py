"""Which operation of a function makes two ways of computing it disagree, and by how much.

Two *sides* compute the same traced program (``fn`` on the same arguments): each is a rule of
:mod:`precisionlab.intercept` (an emulate rule, a recipe's matmul rule, or none: the program
as written) applied at chosen sites. :func:`attribute` runs both in one jitted program and
records, at every floating-point operation (program order, through ``scan``, ``cond`` and
``checkpoint``):

- ``rel``: the relative difference of the operation's result between the sides,
  ``||y_b - y_a|| / ||y_a||`` (inf where only ``y_b`` is non-finite, NaN where ``y_a`` is);
- ``local``: each side's *own* error at the operation, ``e = y - f(inputs)``: the side's
  result minus the program's operation in float32 arithmetic on the same (that side's)
  operands (16-bit operands widened exactly), so what flowed in from earlier operations is
  not counted again;
- ``contribution``: the first-order share of the final difference caused there,
  ``<dphi/dy, e_b - e_a>``, where ``phi(out) = <w, out>`` projects the function's output on
  the unit direction of its difference ``w = (out_b - out_a) / ||out_b - out_a||`` and the
  sensitivity ``dphi/dy`` is taken on the program as written (reverse mode, through a
  ``-0.0`` probe added to each result: the exact identity). To first order the contributions
  add up to ``||out_b - out_a||`` (:attr:`Attribution.explained` says how closely): this is
  the "gradient times local error" of jax-ml/jax#25785 and of classical forward error
  analysis, per operation;
- ``new_nonfinite``: elements the operation itself turned non-finite (its result is inf/NaN
  where the program's operation on the same operands is finite): where an overflow starts.

Operations inside a ``while_loop`` are recorded (the first ``while_capacity`` iterations) but
get no sensitivity (reverse mode does not run through one): their contribution is NaN.
Operations inside custom-derivative functions are re-evaluated from their primal programs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import recipes
from precisionlab.emulate._emulate import Emulated, collect, emulate
from precisionlab.intercept import Context, Emit, Intercepted, PerIteration, Site, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed import filter_jit
from precisionlab.mixed._policy import get_policy

__all__ = ["Attribution", "OpAttribution", "Side", "attribute", "float_primitives", "native"]


@dataclasses.dataclass(frozen=True)
class Side:
    """One way of computing a traced program: ``rule`` (an interception rule; None: the
    program as written) applied at the sites in ``sites`` (keyed by the site's ``path``; each
    value is the site as the rule's own interception names it, which keyed rules such as
    stochastic rounding read), called with ``key``; the operations at the paths in ``high``
    run as written with their results passed on unrounded. ``label``: how reports name it.
    Build one with :meth:`Side.of`."""

    label: str
    rule: Any = None
    sites: Mapping[tuple[int, ...], Site] = dataclasses.field(default_factory=dict)
    key: jax.Array | None = None
    high: frozenset = frozenset()

    @staticmethod
    def of(
        spec: Any,
        fn: Callable,
        args: tuple,
        kwargs: Mapping | None = None,
        *,
        weight: str = "rhs",
        key: jax.Array | None = None,
    ) -> Side:
        """The side ``spec`` names, for ``fn(*args, **kwargs)``:

        - ``None``, ``"fp32"``, ``"float32"`` or ``"native"``: ``fn`` as written (jit here);
        - a policy (a string such as ``"c=f16"``, ``"bf16"``, a
          :class:`~precisionlab.mixed.Policy`, a jmp policy or a dtype): every operation
          rounded to the policy's compute
          dtype as XLA's GPU backend computes it (:func:`~precisionlab.emulate.emulate` with
          ``hardware="float32"``: exact products, float32 sums);
        - an :class:`~precisionlab.emulate.Emulated` of ``fn`` (``emulate(fn, policy,
          hardware=..., keep=...)``): that model, e.g. the H100's tensor cores;
        - a recipe (a :class:`~precisionlab.recipes.Recipe`, a recipe name that is not a
          policy string such as ``"current"``, ``"mxfp8"``, ``"nvfp4"``, or
          ``recipes.apply(fn, ...)``): the recipe's matmuls (``weight``: which operand is the
          weight; ``key``: stochastic rounding's key).
        """
        kwargs = dict(kwargs or {})
        name = None
        if spec is None or (isinstance(spec, str) and spec.strip().lower() in _NATIVE):
            return Side("fp32" if spec is None else spec.strip(), key=key)
        if isinstance(spec, str):
            try:
                get_policy(spec)
            except (ValueError, TypeError):
                if spec.strip() not in recipes.RECIPE_NAMES:
                    raise ValueError(
                        f"unknown side {spec!r}: name a policy ('c=f16', 'bf16', ...), a recipe "
                        f"({', '.join(n for n in recipes.RECIPE_NAMES if n not in _POLICIES)}), "
                        "'fp32' (the function as written), or pass emulate(fn, ...) or a Recipe"
                    ) from None
                name = spec.strip()
                spec = recipes.apply(fn, name, weight=weight)
        if isinstance(spec, recipes.Recipe):
            name = spec.name
            spec = recipes.apply(fn, spec, weight=weight)
        if isinstance(spec, recipes.Applied):
            inter = spec.intercepted
            _same(inter.fn, fn, "recipes.apply")
            if spec.recipe.stateful:
                raise ValueError(
                    f"the {spec.recipe.name} recipe keeps a train state (delayed scaling): "
                    "compare a stateless recipe, such as 'current'"
                )
            picked = {s.path: s for s in inter.sites(*args, **kwargs) if s.selected}
            return Side(f"recipe {name or spec.recipe.name}", inter.rule, picked, key)
        label = None
        if not isinstance(spec, Emulated):
            try:
                pol = get_policy(spec)
            except (ValueError, TypeError) as err:
                raise TypeError(
                    "a side is None/'fp32', a policy, a recipe (name or Recipe), "
                    f"recipes.apply(fn, ...) or emulate(fn, ...); got {type(spec).__name__}: "
                    f"{err}"
                ) from None
            label = str(spec) if isinstance(spec, str) else str(pol)
            spec = emulate(fn, pol, hardware="float32")
        _same(spec.fn, fn, "emulate")
        inter, rule = spec._intercepted(args, kwargs)
        picked = {s.path: s for s in inter.sites(*args, **kwargs) if s.selected}
        if label is None:
            model = spec.matmul_model or "a custom matmul model"
            label = f"emulate c={np.dtype(spec.dtype).name}, {model}"
        return Side(label, rule, picked, key)

    def without(self, paths: Iterable[tuple[int, ...]]) -> Side:
        """This side with the operations at ``paths`` in high precision: computed as the
        program has them, on the operands they receive, and their results passed on as they
        are (an emulate rule does not round them again where they are used)."""
        drop = frozenset(paths)
        kept = {p: s for p, s in self.sites.items() if p not in drop}
        return dataclasses.replace(self, sites=kept, high=self.high | drop)

    def run(self, fn: Callable, args: tuple, kwargs: Mapping | None = None) -> Any:
        """``fn(*args, **kwargs)`` computed by this side (traceable: jit it)."""
        kwargs = dict(kwargs or {})
        prims = float_primitives(fn, args, kwargs)
        return run_side(fn, prims, self, args, kwargs)


_NATIVE = ("fp32", "float32", "native", "f32")
_POLICIES = ("bf16", "fp32")  # recipe names that are policy strings too (the policy wins)


def _same(wrapped: Callable, fn: Callable, what: str) -> None:
    if wrapped is not fn:
        raise ValueError(
            f"the {what}(...) side wraps another function than the one compared: pass "
            f"{what}(fn, ...) of the same fn"
        )


def native(label: str = "fp32") -> Side:
    """The program as written (jit on this machine)."""
    return Side(label)


def float_primitives(fn: Callable, args: tuple, kwargs: Mapping | None = None) -> tuple[str, ...]:
    """The first-order primitives of ``fn``'s program with a floating operand or result
    (recursively), plus ``dot_general``: the operations a comparison records."""
    closed = boundary.trace(fn, args, dict(kwargs or {}))[0]
    found: set[str] = {boundary.DOT_GENERAL}
    collect(closed.jaxpr, found)
    return tuple(sorted(found))


def _first_float(outs: list) -> int | None:
    for i, y in enumerate(outs):
        if jnp.issubdtype(jnp.result_type(y), jnp.floating):
            return i
    return None


class _Dispatch:
    """A rule that applies ``side.rule`` at the side's sites and leaves the others as written;
    with ``record`` it emits each operation's first floating result (``"y"``) and, at the
    side's sites, its local error and newly non-finite count; a probe in ``ctx.state`` is
    added to that result (``y + -0.0``, the identity) for its cotangent."""

    def __init__(self, primitives: tuple[str, ...], side: Side, record: bool) -> None:
        self.primitives, self.side, self.record = primitives, side, record

    def apply(self, ctx: Context, *operands: Any, **params: Any) -> list | Emit:
        own = self.side.sites.get(ctx.site.path)
        if own is not None:
            res = self.side.rule.apply(ctx._replace(site=own, state=None), *operands, **params)
            outs = list(res.outputs if isinstance(res, Emit) else res)
        else:
            outs = list(ctx.original(*operands))
            memo = getattr(self.side.rule, "rounded", None)
            if ctx.site.path in self.side.high and memo is not None:
                for y in outs:  # emulate's rule then leaves the result unrounded downstream
                    memo[id(y)] = y
        i = _first_float(outs)
        if i is None or not self.record:
            return outs
        y = outs[i]
        aux: dict[str, Any] = {"y": y}
        if own is not None:
            ref = _wide(ctx, operands, i)
            y32 = jnp.asarray(y).astype(jnp.float32)
            both = jnp.isfinite(y32) & jnp.isfinite(ref)
            new = ~jnp.isfinite(y32) & jnp.isfinite(ref)
            # a value that was already inf/NaN on the way in is not this operation's error
            aux["local"] = jnp.where(both, y32 - ref, jnp.where(new, jnp.inf, 0.0))
            aux["new"] = jnp.sum(new, dtype=jnp.int32)
        if ctx.state is not None and i == 0:  # probes are shaped like the first output
            outs[i] = y + jnp.asarray(ctx.state).astype(jnp.result_type(y))
        return Emit(outs, aux)


def _wide(ctx: Context, operands: tuple, i: int) -> jax.Array:
    """Output ``i`` of the program's operation in float32 arithmetic on the same operands
    (16-bit operands widened, exactly, where the primitive accepts that; as the program
    has it otherwise): the reference a local error is measured against."""
    narrow = [_is_narrow(x) for x in operands]
    if any(narrow):
        wide = [x.astype(jnp.float32) if n else x for x, n in zip(operands, narrow, strict=True)]
        try:
            return jnp.asarray(ctx.original(*wide)[i]).astype(jnp.float32)
        except (TypeError, ValueError):  # a primitive typed by its params (a dtype, a pet)
            pass
    return jnp.asarray(ctx.original(*operands)[i]).astype(jnp.float32)


def _is_narrow(x: Any) -> bool:
    dt = jnp.result_type(x)
    return jnp.issubdtype(dt, jnp.floating) and jnp.dtype(dt).itemsize < 4


def _fresh(side: Side) -> None:
    """Forget what a rule remembered of an earlier trace (emulate's rounded values, by id:
    an id may be reused by a new, unrounded value)."""
    for name in ("rounded", "folds", "bwd_folds"):
        memo = getattr(side.rule, name, None)
        if memo is not None:
            memo.clear()


def run_side(
    fn: Callable, primitives: tuple[str, ...], side: Side, args: tuple, kwargs: Mapping
) -> Any:
    """``fn(*args, **kwargs)`` computed by ``side`` (traceable; no recording)."""
    inter = intercept(fn, _Dispatch(primitives, side, record=False))
    _fresh(side)
    try:
        return inter.call_with_aux(None, *args, key=side.key, **kwargs)[0]
    finally:
        _fresh(side)


@dataclasses.dataclass(frozen=True)
class OpAttribution:
    """One recorded operation (see the module docstring). ``name``: numbered per primitive
    (``"dot_general[2]"``, ``"exp[0]"``: a recipe's and telemetry's matmul names); ``site``:
    the :class:`Site` (global numbering, scope, source line, shapes, path). ``rel``, ``local``
    (``||e_b - e_a|| / ||y_a||``), ``contribution`` (in units of the output difference's norm;
    NaN: no sensitivity, inside a while loop), ``new_nonfinite``, ``replaced``: whether either
    side's rule computes it (False: both compute it as written)."""

    name: str
    site: Site
    rel: float
    local: float
    contribution: float
    new_nonfinite: int
    replaced: bool

    @property
    def primitive(self) -> str:
        return self.site.primitive


@dataclasses.dataclass(frozen=True)
class Attribution:
    """The comparison of two sides: ``ops`` in program order, the output's difference
    (``output_norm`` = ``||out_b - out_a||``, ``output_rel`` relative to ``||out_a||``; inf
    where ``out_b`` is non-finite, NaN where ``out_a`` is) and ``contributions`` summed
    (``explained`` = their sum / ``output_norm``: near 1 where first order holds)."""

    a: str
    b: str
    ops: tuple[OpAttribution, ...]
    output_norm: float
    output_rel: float

    @property
    def explained(self) -> float:
        c = [o.contribution for o in self.ops if math.isfinite(o.contribution)]
        if not self.output_norm or not math.isfinite(self.output_norm):
            return math.nan
        return float(sum(c)) / self.output_norm

    def ranked(self) -> tuple[OpAttribution, ...]:
        """The operations most consequential first: those that turn finite values non-finite
        (in program order: the first is where an overflow starts), then by |contribution|
        (largest first), then by ``local`` (operations without a sensitivity); operations
        neither side changes are left out."""

        def key(o: OpAttribution) -> tuple:
            c = o.contribution
            return (
                0 if o.new_nonfinite else 1,
                o.site.index if o.new_nonfinite else 0,
                -abs(c) if math.isfinite(c) else 0.0,
                -o.local if math.isfinite(o.local) else -math.inf,
            )

        moved = [o for o in self.ops if o.replaced and (o.new_nonfinite or o.local > 0)]
        return tuple(sorted(moved, key=key))


def _norm(x: jax.Array) -> jax.Array:
    """||x||_2 of the finite elements in float32, scaled by the amax (no overflow)."""
    x = jnp.where(jnp.isfinite(x), x.astype(jnp.float32), 0.0)
    m = jnp.max(jnp.abs(x), initial=0.0)
    safe = jnp.where(m > 0, m, 1.0)
    return m * jnp.sqrt(jnp.sum(jnp.square(x / safe)))


def _rel(a: jax.Array, b: jax.Array) -> jax.Array:
    """As :func:`precisionlab.diagnose.relative_difference`, in-graph, float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    na, d = _norm(a), _norm(b - a)
    r = jnp.where(na > 0, d / jnp.where(na > 0, na, 1.0), jnp.where(d > 0, jnp.inf, 0.0))
    r = jnp.where(jnp.all(jnp.isfinite(b)), r, jnp.inf)
    return jnp.where(jnp.all(jnp.isfinite(a)), r, jnp.nan)


def _probe(site: Site) -> jax.Array | PerIteration:
    zero = jnp.full((*site.lengths, *site.out_shapes[0]), -0.0, jnp.float32)
    return PerIteration(zero) if site.lengths else zero


def _floats(tree: Any) -> list:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.floating)]


def _cotangent(out: Any, w_leaves: list) -> Any:
    """A cotangent for ``out``: ``w_leaves`` on its float leaves, float0 zeros elsewhere."""
    it = iter(w_leaves)

    def one(x: Any) -> Any:
        if jnp.issubdtype(jnp.result_type(x), jnp.floating):
            return next(it).astype(jnp.result_type(x))
        return np.zeros(np.shape(x), jax.dtypes.float0)

    return jax.tree.map(one, out)


# numpy, not jnp: a jnp array made at import would start the backend before a multi-process run
# can call jax.distributed.initialize (tests/project/test_import_time.py)
_EMPTY = np.zeros((0,), np.float32)


def _split(w: jax.Array, like: list) -> list:
    """The flat ``w`` cut into pieces shaped like ``like``'s leaves."""
    out, i = [], 0
    for x in like:
        out.append(w[i : i + x.size].reshape(x.shape))
        i += x.size
    return out


def _row(ab: Any, aa: Any, g: jax.Array | None, two: bool) -> tuple:
    """(rel, local, contribution, newly non-finite) of one site from its two sides'
    :class:`~precisionlab.intercept.Aux` (``two``: the reference has own errors too) and the
    output's sensitivity to it (None: none)."""
    ya, yb = aa.value["y"], ab.value["y"]
    ok = ab.valid & aa.valid

    def mask(v: jax.Array) -> jax.Array:  # the loop axes' flag broadcast over the value
        return v.reshape(v.shape + (1,) * (ya.ndim - v.ndim))

    ya = jnp.where(mask(ok), ya.astype(jnp.float32), 0.0)
    yb = jnp.where(mask(ok), yb.astype(jnp.float32), 0.0)
    rel = jnp.where(jnp.all(ab.valid == aa.valid), _rel(ya, yb), jnp.inf)
    zero = jnp.zeros(ya.shape, jnp.float32)
    eb = ab.value.get("local", zero)
    ea = aa.value.get("local", zero) if two else zero
    e = jnp.where(mask(ok), eb - ea, 0.0)
    fin = jnp.isfinite(e)
    if g is None:
        contrib = jnp.float32(jnp.nan)
    else:
        dot = jnp.sum(g.astype(jnp.float32) * jnp.where(fin, e, 0.0))
        contrib = jnp.where(jnp.all(fin), dot, jnp.nan)
    new = jnp.int32(0)
    for aux in (ab, aa) if two else (ab,):
        if "new" in aux.value:
            new = new + jnp.sum(jnp.where(aux.valid, aux.value["new"], 0))
    na, ne = _norm(ya), _norm(e)
    local = jnp.where(na > 0, ne / jnp.where(na > 0, na, 1.0), jnp.inf)
    local = jnp.where(jnp.all(fin), jnp.where(ne > 0, local, 0.0), jnp.inf)
    return rel, local, contrib, new


def attribute(
    fn: Callable,
    args: tuple,
    a: Side,
    b: Side,
    *,
    kwargs: Mapping | None = None,
    primitives: tuple[str, ...] | None = None,
    while_capacity: int = 16,
) -> Attribution:
    """Compare side ``b`` with side ``a`` on ``fn(*args, **kwargs)``, operation by operation
    (see the module docstring). ``primitives``: the operations recorded (default
    :func:`float_primitives`)."""
    kwargs = dict(kwargs or {})
    prims = primitives or float_primitives(fn, args, kwargs)
    nat = Side(a.label)

    def inter(side: Side) -> Intercepted:
        return intercept(fn, _Dispatch(prims, side, True), while_capacity=while_capacity)

    sites = inter(nat).sites(*args, **kwargs)
    probes = {s.name: _probe(s) for s in sites if boundary.WHILE not in s.within}

    def call(side: Side, args: tuple, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        _fresh(side)
        try:
            return inter(side).call_with_aux(None, *args, key=side.key, **kwargs)
        finally:
            _fresh(side)

    two = bool(a.sites or a.high)  # the reference is computed differently from native

    def program(args: tuple, kwargs: dict[str, Any]) -> tuple[dict[str, tuple], Any, Any, Any]:
        out_b, aux_b = call(b, args, kwargs)

        def probed(pr: Any) -> tuple[Any, dict[str, Any]]:
            return inter(nat).call_with_aux(pr, *args, **kwargs)

        out_n, pull, aux_n = jax.vjp(probed, probes, has_aux=True)
        out_a, aux_a = call(a, args, kwargs) if two else (out_n, aux_n)
        fa = jnp.concatenate([x.ravel().astype(jnp.float32) for x in _floats(out_a)] or [_EMPTY])
        fb = jnp.concatenate([x.ravel().astype(jnp.float32) for x in _floats(out_b)] or [_EMPTY])
        d = fb - fa
        dn = _norm(d)
        finite = jnp.all(jnp.isfinite(d))
        scale = jnp.where(finite & (dn > 0), 1.0 / jnp.where(dn > 0, dn, 1.0), 0.0)
        w = jnp.where(jnp.isfinite(d), d, 0.0) * scale
        sens = pull(_cotangent(out_n, _split(w, _floats(out_n))))[0]
        rows = {}
        for s in sites:
            if s.name in aux_b:
                g = sens.get(s.name)
                g = g.value if isinstance(g, PerIteration) else g
                rows[s.name] = _row(aux_b[s.name], aux_a[s.name], g, two)
        return rows, dn, _rel(fa, fb), finite

    # filter_jit: an Equinox model's functions among the arguments are closed over
    rows, dn, out_rel, finite = jax.device_get(filter_jit(program)(args, kwargs))
    numbered: dict[str, int] = {}
    ops = []
    for s in sites:
        k = numbered.get(s.primitive, 0)
        numbered[s.primitive] = k + 1
        if s.name not in rows:
            continue
        rel, local, contrib, new = rows[s.name]
        replaced = s.path in a.sites or s.path in b.sites
        ops.append(
            OpAttribution(
                f"{s.primitive}[{k}]",
                s,
                float(rel),
                float(local),
                float(contrib) if finite else math.nan,
                int(new),
                replaced,
            )
        )
    norm = float(dn) if bool(finite) else math.inf
    return Attribution(a.label, b.label, tuple(ops), norm, float(out_rel))
