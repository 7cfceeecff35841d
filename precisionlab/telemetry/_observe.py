"""Statistics of every matmul of any JAX function, through the interception layer.

:func:`observe` runs ``fn`` with :func:`precisionlab.intercept.intercept` and a rule that
leaves every ``dot_general`` as it was but records :func:`tensor_stats` of its operands and
output; under :meth:`Observed.value_and_grad` each matched output also gets a ``-0.0``
"probe" added (the exact identity: ``x + -0.0 == x`` for every x, signed zeros included),
whose gradient is the output's cotangent, whose statistics are recorded as ``"grad"``.

Operands are laid out as the recipes quantize them: ``(rows, K)`` with the contraction axis
last (batch and free axes flattened into rows), so row, block and MX targets scale along the
contraction axis as a recipe's forward GEMM does; the output and its cotangent keep their
last axis (``N``: the contraction axis of the data-gradient GEMM).

Sites inside ``scan``/``while`` bodies, ``cond`` branches and ``checkpoint`` regions are
observed too: the rule returns its statistics through the interception layer's output channel
(:class:`precisionlab.intercept.Emit`), which threads them out of every construct. A site inside
a ``scan`` gives one entry per iteration (each statistic's leaves get a leading axis per
enclosing loop, outermost first: a scanned stack of layers gives one entry per layer), and its
cotangent is observed per iteration too (a :class:`~precisionlab.intercept.PerIteration`
probe). Inside a ``while_loop`` the first ``while_capacity`` iterations are kept, without
``"grad"`` (reverse-mode differentiation does not run through a while loop). A site under a
``cond`` or ``while`` also gets ``"valid"`` (bool, the loop axes' shape): False where its
branch did not run or the while slot is unused (its statistics are then of zeros).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.hardware._conv import from_params as conv_plan
from precisionlab.intercept import (
    Aux,
    Context,
    Emit,
    Intercepted,
    PerIteration,
    Site,
    intercept,
    numbered,
    select,
)
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed import filter_value_and_grad
from precisionlab.telemetry._stats import TensorStats, stacked_stats, tensor_stats
from precisionlab.telemetry._targets import Target, parse_targets

__all__ = ["OPS", "Observed", "ObservedGrad", "StatsTable", "every", "observe", "tree_stats"]

#: What the rule records of a tensor: its :class:`TensorStats`, or the tensor itself (the
#: statistics of all of them are then taken at once).
_Stat: TypeAlias = Callable[[jax.Array, tuple[Target, ...]], TensorStats | jax.Array]
#: The tensors of the observed sites: site name -> role (``"lhs"``, ``"grad"``, ``"valid"``)
#: -> tensor, with one leading axis per enclosing loop.
Tensors: TypeAlias = dict[str, dict[str, jax.Array]]
#: Where a tensor's statistics sit in a :class:`StatsTable`: (key, role or None, first
#: entry, loop axes' shape).
_Entry: TypeAlias = tuple[str, str | None, int, tuple[int, ...]]

#: The floating-point operations whose outputs can overflow or underflow (besides the
#: matmuls): powers, exponentials and logarithms (GELU's x**3, softmax's exponent), products,
#: quotients and sums (normalization statistics, the loss and its weighting, bias adds), the
#: squashing functions (whose outputs underflow in their tails) and casts (a float32 value
#: rounded to float16 overflows or flushes there).
OPS: tuple[str, ...] = (
    *boundary.POWERS, *boundary.ROOTS, *boundary.EXPONENTIALS, *boundary.LOGARITHMS,
    boundary.MUL, boundary.DIV, boundary.ADD, boundary.SUB, boundary.REDUCE_SUM,
    boundary.TANH, boundary.LOGISTIC, boundary.ERF, boundary.CONVERT,
)  # fmt: skip


#: The products observed with their operands (the others: their output only).
_PRODUCTS = boundary.PRODUCTS
#: Products telemetry has no rule for: listed by ``Observed.skipped`` and warned about once.
NOT_OBSERVED = boundary.RAGGED_PRODUCTS


def _check_ops(ops: Sequence[str]) -> tuple[str, ...]:
    """``ops`` as a tuple; ValueError naming any entry that is no JAX primitive."""
    if isinstance(ops, str):
        ops = (ops,)
    known = boundary.primitive_names()
    bad = [o for o in ops if not isinstance(o, str) or o not in known]
    if bad:
        raise ValueError(
            f"ops: {', '.join(map(repr, bad))} {'is' if len(bad) == 1 else 'are'} not a JAX "
            f"primitive; telemetry.OPS lists those that can overflow or underflow: "
            f"{', '.join(OPS)} (any primitive name of this jax {jax.__version__} is accepted)"
        )
    return tuple(ops)


def _contraction_last(x: jax.Array, contract: Sequence[int], batch: Sequence[int]) -> jax.Array:
    """(rows, K): batch and free axes flattened into rows, the contraction axes into K."""
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    k = math.prod(x.shape[d] for d in contract)
    return jnp.transpose(x, (*batch, *free, *contract)).reshape(-1, k)


def _is_float(x: object) -> bool:
    """A floating array (or Python float); not a function or other static leaf of a model."""
    if isinstance(x, float):
        return True
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not isinstance(x, type) and jnp.issubdtype(dtype, jnp.floating)


class _StatsRule:
    label = "telemetry"
    candidates = NOT_OBSERVED

    def __init__(
        self,
        targets: tuple[Target, ...],
        record: frozenset[str],
        stat: _Stat = tensor_stats,
        ops: tuple[str, ...] = (),
        axes: dict[str, int] | None = None,
    ) -> None:
        self.targets, self.record, self.stat = targets, record, stat
        self.primitives = (*_PRODUCTS, *(o for o in ops if o not in _PRODUCTS))
        self.axes = {} if axes is None else axes  # conv site -> its output's feature axis

    def apply(self, ctx: Context, *operands: jax.Array, **params: Any) -> list[jax.Array] | Emit:
        if ctx.site.primitive == boundary.CONV:
            return self._conv(ctx, *operands, **params)
        if ctx.site.primitive != boundary.DOT_GENERAL:
            return self._output(ctx, operands)
        return self._matmul(ctx, *operands, **params)

    def _conv(
        self, ctx: Context, lhs: jax.Array, rhs: jax.Array, **params: Any
    ) -> list[jax.Array] | Emit:
        """A convolution: its operands as the GEMM over the patches (rows, K), K = kernel
        taps then input channels fastest, as the recipes quantize them; the output (and
        its cotangent) with the features last."""
        out = ctx.original(lhs, rhs)[0]
        name = ctx.site.name
        if name not in self.record or not (_is_float(lhs) and _is_float(rhs) and _is_float(out)):
            return [out]
        plan = conv_plan(lhs.shape, rhs.shape, params)
        self.axes[name] = plan.out_spec[1]
        stats = {
            "lhs": self.stat(plan.patches(lhs).reshape(-1, plan.k), self.targets),
            "rhs": self.stat(plan.kernel_rows(rhs).reshape(-1, plan.k), self.targets),
            "out": self.stat(jnp.moveaxis(out, plan.out_spec[1], -1), self.targets),
        }
        if ctx.state is not None:
            out = out + ctx.state.astype(out.dtype)
        return Emit([out], stats)

    def _output(self, ctx: Context, operands: tuple[jax.Array, ...]) -> list[jax.Array] | Emit:
        """Any other operation: the statistics of its (first) output, as it was computed."""
        outs = ctx.original(*operands)
        out = outs[0]
        if ctx.site.name not in self.record or not _is_float(out) or len(outs) != 1:
            return outs
        stats = {"out": self.stat(out, self.targets)}
        if ctx.state is not None:
            out = out + ctx.state.astype(out.dtype)
        return Emit([out], stats)

    def _matmul(
        self,
        ctx: Context,
        lhs: jax.Array,
        rhs: jax.Array,
        *,
        dimension_numbers: lax.DotDimensionNumbers,
        **params: Any,
    ) -> list[jax.Array] | Emit:
        out = ctx.original(lhs, rhs)[0]
        name = ctx.site.name
        if name in self.record and _is_float(lhs) and _is_float(rhs) and _is_float(out):
            (lc, rc), (lb, rb) = dimension_numbers
            stats = {
                "lhs": self.stat(_contraction_last(lhs, lc, lb), self.targets),
                "rhs": self.stat(_contraction_last(rhs, rc, rb), self.targets),
                "out": self.stat(out, self.targets),
            }
            if ctx.state is not None:
                out = out + ctx.state.astype(out.dtype)
            return Emit([out], stats)
        return [out]


def _probed(site: Site) -> bool:
    """Whether the site's output cotangent can be observed: not inside a while loop (JAX
    does not differentiate through one in reverse mode)."""
    return boundary.WHILE not in site.within


def _probe(site: Site) -> jax.Array | PerIteration:
    """The ``-0.0`` probe of a site's output: one per iteration of its enclosing scans."""
    zero = jnp.full((*site.lengths, *site.out_shapes[0]), -0.0, jnp.float32)
    return PerIteration(zero) if site.lengths else zero


@jax.tree_util.register_pytree_node_class
class StatsTable(Mapping[str, Any]):
    """Statistics of many tensors, computed together (:func:`stacked_stats`) and read like a
    dict: ``table[site][role]`` (``observe``: ``{"lhs", "rhs", "out"[, "grad"][, "valid"]}``
    per site) or ``table[key]`` (``tree_stats``: a :class:`TensorStats` per leaf path), each
    sliced from the stacked arrays when read (with the site's loop axes in front).

    A pytree whose leaves are the stacked arrays and the ``"valid"`` flags: returned from
    ``jit`` it is a few outputs, not one per tensor and statistic (hundreds of small outputs
    made XLA compile several times slower); ``jax.device_get`` it, then read it on the host.
    """

    def __init__(
        self,
        stacked: TensorStats | None,
        index: tuple[_Entry, ...],
        valid: dict[str, jax.Array] | None = None,
    ) -> None:
        self.stacked = stacked  # fields with a leading axis: one entry per tensor
        self.index = index  # (key, role or None, first entry, loop axes' shape) per tensor
        self.valid = valid or {}  # key -> bool flags over its loop axes (cond / while)

    def tree_flatten(
        self,
    ) -> tuple[tuple[TensorStats | None, dict[str, jax.Array]], tuple[_Entry, ...]]:
        return (self.stacked, self.valid), self.index

    @classmethod
    def tree_unflatten(cls, index: tuple[_Entry, ...], children: Sequence[Any]) -> StatsTable:
        return cls(children[0], index, children[1])

    def _entry(self, start: int, loops: tuple[int, ...]) -> TensorStats:
        if self.stacked is None:  # an empty table: no index entry leads here
            raise KeyError(start)
        n = math.prod(loops)

        def take(v: Any) -> Any:
            if isinstance(v, jax.ShapeDtypeStruct):  # under jax.eval_shape: the entry's shape
                return jax.ShapeDtypeStruct((*loops, *v.shape[1:]), v.dtype)
            if not loops:
                return v[start]
            return v[start : start + n].reshape(*loops, *v.shape[1:])

        return TensorStats(*(take(v) for v in self.stacked))

    def __contains__(self, key: object) -> bool:
        return any(e[0] == key for e in self.index)

    def __getitem__(self, key: str) -> Any:
        entries = [e for e in self.index if e[0] == key]
        if not entries:
            raise KeyError(key)
        if entries[0][1] is None:
            return self._entry(entries[0][2], entries[0][3])
        out: dict[str, Any] = {
            role: self._entry(start, loops) for _, role, start, loops in entries if role is not None
        }
        if key in self.valid:
            out["valid"] = self.valid[key]
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(e[0] for e in self.index))

    def __len__(self) -> int:
        return len(dict.fromkeys(e[0] for e in self.index))

    def __repr__(self) -> str:
        return f"StatsTable({list(self)})"


def _identity(x: jax.Array, _targets: Any) -> jax.Array:
    """The "statistic" that keeps the tensor (statistics are taken afterwards, all at once)."""
    return x


def _batched_stats(
    found: Tensors, plan: dict[str, Site], targets: tuple[Target, ...]
) -> StatsTable:
    """:func:`tensor_stats` of every observed tensor (``found``: site -> role -> tensor, with
    one leading axis per enclosing loop, and ``"valid"``), computed together in one program
    by :func:`~precisionlab.telemetry.stacked_stats` and handed out as a
    :class:`StatsTable` (per-tensor statistics of a model's dozens of tensors, or per-tensor
    outputs of one program, made XLA compile for minutes). Counts, extremes and ``k`` are
    :func:`tensor_stats`'s exactly; the float sums (mean, variance, power, quantization
    noise) are added in another order. As before, an untaken ``cond`` branch's or an unused
    while slot's forward entries are zeros (their cotangents' statistics are of zeros)."""
    by_name = {s.name: s for s in plan.values()}
    pieces: list[jax.Array] = []
    index: list[_Entry] = []
    masks: list[jax.Array] = []
    valid = {name: roles["valid"] for name, roles in found.items() if "valid" in roles}
    for name, roles in found.items():
        n_axes = len(by_name[name].lengths)
        for role, x in roles.items():
            if role == "valid":
                continue
            loops = tuple(x.shape[:n_axes])
            flat = x.reshape(-1, *x.shape[n_axes:]) if n_axes else x[None]
            index.append((name, role, len(pieces), loops))
            pieces += list(flat)
            ok = valid.get(name) if role != "grad" else None  # cotangents were never masked
            masks.append(jnp.ones((flat.shape[0],), bool) if ok is None else ok.reshape(-1))
    if not pieces:
        return StatsTable(None, tuple(index), valid)
    st = stacked_stats(pieces, targets)
    if valid:
        keep = jnp.concatenate(masks)
        st = jax.tree.map(lambda v: _where(keep, v), st)
    return StatsTable(st, tuple(index), valid)


def _where(ok: jax.Array, v: jax.Array) -> jax.Array:
    """``v`` where ``ok`` (the loop axes' flags, broadcast over ``v``'s other axes), else 0."""
    return jnp.where(ok.reshape(ok.shape + (1,) * (v.ndim - ok.ndim)), v, jnp.zeros_like(v))


def _collect(aux: dict[str, Aux], sites: dict[str, Site]) -> Tensors:
    """Each emitting site's statistics under its public name (``sites``: internal name ->
    public :class:`Site`), with ``"valid"`` under a cond or while loop."""
    out: Tensors = {}
    for name, a in aux.items():
        site = sites[name]
        out[site.name] = dict(a.value)
        if boundary.CONDITIONAL & set(site.within):
            out[site.name]["valid"] = a.valid
    return out


def _kept(site: Site) -> bool:
    """Whether an observed site is kept: every matmul; another operation unless it is inside
    a ``custom_vjp`` function (observing it would evaluate that function's primal program and
    drop its backward rule: a straight-through or rounding rule's cotangents would change)."""
    return site.primitive in _PRODUCTS or boundary.CUSTOM_VJP not in site.within


class Observed:
    """``fn`` with its matmuls (and ``ops``) observed; see :func:`observe`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        targets: Sequence[str] | str,
        include: Sequence[int | str] | int | str | None,
        exclude: Sequence[int | str] | int | str,
        while_capacity: int = 16,
        ops: Sequence[str] = (),
    ) -> None:
        self.fn, self.targets = fn, parse_targets(targets)
        if include is not None and isinstance(include, (str, int)):
            include = (include,)
        if isinstance(exclude, (str, int)):
            exclude = (exclude,)
        self.include = None if include is None else tuple(include)
        self.exclude = tuple(exclude)
        self.while_capacity = while_capacity
        self.ops = _check_ops(ops)
        self._axes: dict[str, int] = {}
        self.__wrapped__ = fn

    def _intercepted(
        self, record: frozenset[str] = frozenset(), stat: _Stat = tensor_stats
    ) -> Intercepted:
        rule = _StatsRule(self.targets, record, stat, self.ops, self._axes)
        # only the recorded sites go through the rule: an excluded one inside a construct the
        # interception layer cannot enter (a shard_map in fn) is left to run as it is
        include = tuple(sorted(record))
        return intercept(self.fn, rule, include=include, while_capacity=self.while_capacity)

    def _plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Site]:
        """Internal site name -> the public (per-primitive numbered) selected site."""
        found = self._intercepted().sites(*args, **kwargs)
        # numbered per primitive (dot_general[0..], exp[0..]): the matmuls keep the names
        # they have without the other operations (as diagnose and the recipes name them)
        public = select(numbered(found, "primitive"), self.include, self.exclude)
        # every construct the interception layer finds is observed; none is skipped today
        return {s.name: p for s, p in zip(found, public, strict=True) if p.selected and _kept(p)}

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """The observed operations (selected, numbered per primitive: ``dot_general[2]``,
        ``exp[0]``), inside loops, conds and checkpoints too, in program order."""
        return list(self._plan(args, kwargs).values())

    def skipped(self, *args: Any, **kwargs: Any) -> list[Site]:
        """Operations telemetry could observe but does not (``ragged_dot``; ``Site.skipped``
        says why), warned about once when traced."""
        return self._intercepted().skipped(*args, **kwargs)

    def report(self, *args: Any, **kwargs: Any) -> str:
        """One line per observed operation (the parameter it multiplies, its shapes and
        source line), then those telemetry could observe but does not (:meth:`skipped`)."""
        sites = self.sites(*args, **kwargs)
        lines = [f"{len(sites)} observed", *(s.describe() for s in sites)]
        skipped = self.skipped(*args, **kwargs)
        if skipped:
            lines.append(f"{len(skipped)} not observed: " + ", ".join(
                f"{s.name} ({s.skipped})" for s in skipped))  # fmt: skip
        return "\n".join(lines)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, StatsTable]:
        """``(fn(*args, **kwargs), {site: {"lhs", "rhs", "out": TensorStats[, "valid"]}})``
        (other operations: ``"out"`` only; per-iteration statistics of sites inside loops:
        see the module docstring)."""
        plan = self._plan(args, kwargs)
        inter = self._intercepted(frozenset(plan), _identity)
        out, aux = inter.call_with_aux(None, *args, **kwargs)
        tensors = _collect(aux, plan)
        return out, _batched_stats(tensors, plan, self.targets)

    def value_and_grad(
        self, argnums: int | Sequence[int] = 0, has_aux: bool = False, *, tensors: bool = False
    ) -> ObservedGrad:
        """``f(*args, **kwargs) -> (value, grads, stats)``: ``jax.value_and_grad(fn,
        argnums, has_aux)``'s value and gradients (unchanged) plus per-site statistics with
        ``"grad"``: the output cotangent's (per iteration inside a scan; none inside a while
        loop). ``tensors=True`` gives the tensors themselves (float, laid out as their
        statistics would be: operands ``(rows, K)``, with the loop axes in front) instead of
        their statistics, for a caller that batches the statistics of many tensors.
        ``f.sites``: the observed :class:`Site` list of the last call (set when it traces;
        see :class:`ObservedGrad`).

        The differentiated arguments may hold non-array leaves (an Equinox module's activation
        function): only floating arrays are differentiated, the others pass through with
        gradient None (:func:`precisionlab.mixed.filter_value_and_grad`). Inside a user's
        ``shard_map`` the statistics are each device's (reduce them with
        :func:`~precisionlab.telemetry.reduce_over`); the gradients are JAX's (a replicated
        argument's summed over the devices)."""
        return ObservedGrad(self, argnums, has_aux, tensors)


class ObservedGrad:
    """What :meth:`Observed.value_and_grad` returns: called like ``fn``, it gives ``(value,
    grads, stats)``; ``sites`` lists the observed :class:`~precisionlab.intercept.Site`
    of the last call (set when it traces)."""

    def __init__(
        self, observed: Observed, argnums: int | Sequence[int], has_aux: bool, tensors: bool
    ) -> None:
        self.observed, self.argnums, self.has_aux, self.tensors = (
            observed, argnums, has_aux, tensors,
        )  # fmt: skip
        #: The observed sites of the last call, in program order.
        self.sites: list[Site] = []

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Any, StatsTable | Tensors]:
        """``(value, grads, stats)``: see :meth:`Observed.value_and_grad`."""
        obs, argnums, has_aux = self.observed, self.argnums, self.has_aux
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        plan = obs._plan(args, kwargs)
        self.sites = list(plan.values())
        probes = {k: _probe(s) for k, s in plan.items() if _probed(s)}
        # inside shard_map the probes vary as the data does: each device's own cotangent
        probes = boundary.match_varying(probes, boundary.tree_varying_axes((args, kwargs)))

        def run(pr: dict[str, Any], *a: Any) -> tuple[Any, tuple[Any, dict[str, Aux]]]:
            inter = obs._intercepted(frozenset(plan), _identity)
            out, aux = inter.call_with_aux(pr, *a, **kwargs)
            if has_aux:
                return out[0], (out[1], aux)
            return out, (None, aux)

        # filtered: an Equinox model's non-array leaves pass through (gradient None)
        vg = filter_value_and_grad(run, argnums=(0, *(n + 1 for n in nums)), has_aux=True)
        (value, (aux, fwd)), grads = vg(probes, *args)
        found = _collect(fwd, plan)
        for key, ct in grads[0].items():
            name = plan[key].name
            if name in found:
                ct = ct.value if isinstance(ct, PerIteration) else ct
                axis = obs._axes.get(key)  # a convolution's: the features last
                if axis is not None:
                    ct = jnp.moveaxis(ct, len(plan[key].lengths) + axis, -1)
                found[name]["grad"] = ct
        stats = found if self.tensors else _batched_stats(found, plan, obs.targets)
        g = grads[1] if isinstance(argnums, int) else tuple(grads[1:])
        return ((value, aux) if has_aux else value), g, stats


def observe(
    fn: Callable[..., Any],
    targets: Sequence[str] | str = (),
    *,
    include: Sequence[int | str] | int | str | None = None,
    exclude: Sequence[int | str] | int | str = (),
    while_capacity: int = 16,
    ops: Sequence[str] = (),
) -> Observed:
    """``fn`` with statistics of every matched ``dot_general`` (matmul, einsum, dense layer)
    and of every operation named in ``ops``.

    Args:
      fn: any JAX function (a Flax ``apply``, a loss); traced by the interception layer.
      targets: static target names for the per-format counts (see :func:`tensor_stats`).
      include / exclude: which operations to observe (positions over all observed
        operations in program order, names ``"dot_general[3]"`` / ``"exp[0]"``, or glob
        patterns on the scope), as in :func:`precisionlab.intercept.select`.
      while_capacity: iterations of a ``while_loop`` observed (the first ones; static).
      ops: primitive names whose float output (and its cotangent) is observed too (:data:`OPS`:
        every operation that can overflow or underflow). Sites are numbered per primitive,
        so the matmuls keep their names. Operations inside a ``custom_vjp`` function are not
        observed (its backward rule is kept); inside a ``custom_jvp`` function (JAX's
        softmax, relu) they are, and the observed pass differentiates its primal program
        (the same derivative for those; not for a straight-through estimator).

    Returns:
      An :class:`Observed`: ``obs(*args)`` gives ``(out, stats)``;
      ``obs.value_and_grad(argnums)(*args)`` gives ``(value, grads, stats)`` with the output
      cotangents' statistics too. ``stats`` maps site names to ``{"lhs", "rhs", "out"[,
      "grad"]}`` :class:`TensorStats` (other operations: ``{"out"[, "grad"]}``; ``"valid"``
      too under a cond or while loop), with one leading axis per enclosing loop.
      Computations are unchanged (bit for bit).
    """
    return Observed(fn, targets, include, exclude, while_capacity, ops)


def tree_stats(tree: Any, targets: Sequence[str] | str = ()) -> StatsTable:
    """Statistics of every float leaf of a pytree (params, grads, optimizer state), keyed by
    the leaf's path (``jax.tree_util.keystr``); integer arrays and other leaves (functions,
    Python numbers, an Equinox model's) are left out. Computed together
    (:func:`stacked_stats`: counts and extremes exactly :func:`tensor_stats`'s, the float
    sums in another order) and read like a dict (a :class:`StatsTable`)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    floats = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in leaves
        if hasattr(leaf, "shape") and _is_float(leaf)
    }
    index = tuple((k, None, i, ()) for i, k in enumerate(floats))
    if not floats:
        return StatsTable(None, index)
    return StatsTable(stacked_stats(list(floats.values()), targets), index)


def every(n: int, step: jax.Array, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` when ``step % n == 0``, else zeros of the same structure, behind a
    ``lax.cond`` (only the taken branch runs). ``n`` is a static int >= 1; ``step`` an
    integer (traced or not)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every: n must be an int >= 1, got {n!r}")
    # array leaves go through the cond; the others (an Equinox model's functions) are static
    call, values = boundary.split_leaves(fn, args, {})
    shapes = boundary.eval_shape(call, *values)

    def skip(*_: Any) -> Any:
        # inside shard_map: each as varying as the statistic the other branch computes
        return jax.tree.map(
            lambda s: boundary.pvary(jnp.zeros(s.shape, s.dtype), boundary.varying_axes(s)),
            shapes,
        )

    return lax.cond(jnp.asarray(step) % n == 0, call, skip, *values)
