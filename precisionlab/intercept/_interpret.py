"""A jaxpr interpreter that replaces matched primitives.

``fn`` is traced once per call with :func:`jax.make_jaxpr` (on abstract values, so the
caller's tracers never leak into the trace), then re-evaluated equation by equation. A
matched equation calls the rule; an equation whose sub-programs hold a matched one is
re-evaluated through the matching ``lax`` function (``jit`` and calls inline, ``scan``,
``while_loop``, ``cond``/``switch``, ``checkpoint``); every other equation is bound as it
was. Because the re-evaluation emits ordinary JAX operations, the result composes with
``jit``, ``grad``, ``vmap`` and ``remat`` like any JAX function.

Other higher-order primitives (``shard_map``, ``custom_linear_solve``, ...) are bound as
they are when nothing selected sits inside them; their operations are listed (``within``
names the primitive), and a selected one raises
:class:`~precisionlab.intercept._boundary.UnsupportedPrimitive` naming the site, the primitive
and the JAX version, rather than running unreplaced.

Plain replacement: a rule whose ``emits`` attribute is False, called without state or key,
is applied by type: every sub-program of an equation that holds a selected site is rewritten
and the primitive bound again with its own parameters (:func:`boundary.rebind`), without
reading what ``scan`` or ``while`` mean; the per-primitive adapters below serve the stateful
paths (state, :class:`PerIteration`, :class:`Emit`/:class:`Aux`, per-iteration keys).

Auxiliary outputs: a rule may return :class:`Emit` (the outputs plus an ``aux`` pytree, e.g.
statistics). :meth:`Intercepted.call_with_aux` threads every site's ``aux`` out of the
constructs it re-evaluates, as an :class:`Aux` (``value``, ``valid``): a site inside a ``scan``
gives its per-iteration values stacked (leading axis: the iteration, ``xs`` order also for
``reverse=True``; nested scans add one axis each, outermost first); inside a ``while_loop``
the first ``while_capacity`` iterations, stacked the same way (later iterations are not
recorded; ``valid`` marks the filled slots); inside a ``cond``/``switch`` branch the value of
the branch that ran and zeros for the others (``valid`` False); ``checkpoint`` regions and
calls pass it out as extra outputs. Rules that never emit leave the program as it was.

Per-iteration state: a state entry wrapped in :class:`PerIteration` holds one value per
iteration of the site's enclosing loops (leading axes as for ``aux``) and is sliced, so each
iteration sees its own value and its gradient comes back stacked (not max-combined as a plain
entry's does): the output cotangent of a matmul inside a scan, iteration by iteration.

Custom derivatives: a ``custom_jvp``/``custom_vjp`` function that *contains* a matched
operation is re-evaluated from its primal program, so its custom rule is dropped there (the
replaced operation brings its own derivative); functions without matched operations keep
their rules.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeAlias

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.intercept import _boundary as boundary
from precisionlab.intercept import _dataflow
from precisionlab.intercept._dataflow import Promotion
from precisionlab.intercept._sites import Site, bit_width, numbered, select

# what this module exports is listed once, by the package (precisionlab.intercept.__all__)

Path = boundary.Path
#: Per-site state (site name -> the pytree its rule reads) and the enclosing loops' counters.
_State: TypeAlias = Mapping[str, Any]
_Loops: TypeAlias = tuple[jax.Array, ...]
#: A value the interpreter holds for a program variable: an array, a tracer, or a literal's or
#: captured constant's value (a numpy array or scalar).
Value: TypeAlias = jax.typing.ArrayLike

#: Which sites ``include``/``exclude`` name: positions, names or patterns (see :func:`select`).
_Items: TypeAlias = Sequence[int | str | re.Pattern] | int | str

#: How sites may be numbered (see ``precisionlab.intercept._sites.numbered``).
NUMBERINGS = ("program", "primitive")


class SkippedOperationWarning(UserWarning):
    """An operation a rule could act on (a matmul, a convolution) that it leaves as it was:
    an integer matmul, a primitive it has no rule for (``ragged_dot``). Issued once per
    rule, primitive and reason; :meth:`Intercepted.report` lists every such operation."""


_WARNED: set[tuple[str, str, str]] = set()


def _warn_skipped(rule: Rule, sites: list[Site]) -> None:
    """One :class:`SkippedOperationWarning` per (rule, primitive, reason) not yet warned."""
    by_key: dict[tuple[str, str, str], list[str]] = {}
    for s in sites:
        by_key.setdefault((type(rule).__name__, s.primitive, s.skipped), []).append(s.name)
    for key, names in by_key.items():
        if key in _WARNED:
            continue
        _WARNED.add(key)
        what = getattr(rule, "label", type(rule).__name__)
        warnings.warn(
            f"{what} leaves {len(names)} {key[1]} operation(s) as they were "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): {key[2]}; "
            ".report(...) lists them (this warning is given once)",
            SkippedOperationWarning,
            stacklevel=4,
        )


class Emit(NamedTuple):
    """What a rule returns to pass values out besides the primitive's ``outputs`` (a list,
    as :meth:`Rule.apply` returns): ``aux``, any pytree of arrays (the same structure and
    shapes on every call of the site), collected by :meth:`Intercepted.call_with_aux`."""

    outputs: list[jax.Array]
    aux: Any


class Aux(NamedTuple):
    """A site's auxiliary output (see the module docstring). ``value``: the pytree the rule
    emitted, each leaf with one leading axis per enclosing loop (scan length, or the
    ``while_capacity`` of a while loop), outermost first; ``valid``: bool, the loop axes'
    shape: whether that entry was emitted (False: an untaken ``cond`` branch or an unused
    while slot, whose ``value`` is zeros)."""

    value: Any
    valid: jax.Array


#: A program as a function of its inputs: (outputs, the :class:`Aux` of the sites that emitted).
_Evaluated: TypeAlias = tuple[list[Value], dict[str, Aux]]


class PerIteration(NamedTuple):
    """A state entry holding one value per iteration of the site's enclosing loops (leading
    axes: the scan lengths, outermost first), sliced per iteration; its gradient is stacked
    the same way (a plain entry is broadcast, with a max-combined gradient)."""

    value: Any


class Context(NamedTuple):
    """What a rule sees besides the operands.

    ``site``: the matched :class:`Site`; ``eqn``: the matched equation (``original(...)``
    re-applies it); ``state``: this site's entry of the state mapping
    passed to :meth:`Intercepted.call_with_state` (None if absent). Inside a ``scan`` each
    iteration sees its own slice of a broadcast copy whose gradient is the **max** over
    iterations (not the sum), so statistics returned through the state's cotangent (the
    delayed-scaling amax) combine correctly; a :class:`PerIteration` entry arrives sliced
    (its ``value`` for this iteration, unwrapped). ``loop_indices``: int32 iteration counters of the
    enclosing loops (outermost first), for per-iteration randomness. ``key``: the PRNG key
    passed to the call (or None).
    """

    site: Site
    state: Any
    loop_indices: tuple[jax.Array, ...]
    key: jax.Array | None
    eqn: boundary.Eqn | None = None  # the matched equation (its primitive and params)

    def original(self, *operands: jax.Array) -> list[jax.Array]:
        """The matched primitive applied to ``operands`` as the program had it (a rule that
        post-processes the result, e.g. rounds it to a format, starts from this)."""
        if self.eqn is None:
            raise ValueError(f"the context of {self.site.name} holds no equation to re-apply")
        return boundary.bind(self.eqn.primitive, self.eqn.params, *operands)

    def site_key(self) -> jax.Array | None:
        """A key distinct per site and per loop iteration (None without a key)."""
        if self.key is None:
            return None
        k = jax.random.fold_in(self.key, self.site.index)
        if self.site.primitive != boundary.DOT_GENERAL:  # indices may count per primitive
            k = jax.random.fold_in(k, zlib.crc32(self.site.primitive.encode()) & 0x7FFFFFFF)
        for i in self.loop_indices:
            k = jax.random.fold_in(k, i)
        return k


class Rule(Protocol):
    """What :func:`intercept` needs from a rule.

    ``primitives``: names of the primitives it replaces (``("dot_general",)``).
    ``candidates`` (optional): primitives it could act on but has no rule for
    (``("ragged_dot",)``): each is listed as a skipped site and warned about once.
    ``declines(site)`` (optional): why a matched site is left as it was (``"integer
    operands"``), or None; such a site is skipped (``Site.skipped``), never selected.
    ``label`` (optional): how warnings name the rule (``"recipe mxfp8"``).
    ``apply(ctx, *operands, **params)``: the replacement's outputs as a list (one per output
    of the primitive), with the primitive's avals, or an :class:`Emit` of that list and
    auxiliary values.
    ``emits`` (optional, default True): False promises the rule never returns an
    :class:`Emit`; a call without state or key is then rewritten by type (see the module
    docstring), and ``ctx.loop_indices`` is empty there.
    """

    # read-only members, so that a rule may declare them as it likes: ``primitives`` as a class
    # constant, ``apply`` with the primitive's own operands and parameters as named arguments
    @property
    def primitives(self) -> tuple[str, ...]: ...

    @property
    def apply(self) -> Callable[..., list[jax.Array] | Emit]: ...


# --- static walk ---------------------------------------------------------------------------
def _walk(
    jaxpr: boundary.Jaxpr,
    path: Path,
    scope: str,
    loops: tuple[str, ...],
    prims: tuple[str, ...],
    out: list[Site],
    within: tuple[str, ...] = (),
    lengths: tuple[int | None, ...] = (),
    unknown: dict[Path, str] | None = None,
) -> None:
    """Append a :class:`Site` per matched equation under ``jaxpr`` (depth first); ``unknown``
    collects the paths of higher-order primitives the interpreter does not know."""
    for i, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        stack = boundary.name_stack(eqn)
        here = "/".join(p for p in (scope, stack) if p)
        if name in prims:
            ins = [boundary.aval(v) for v in eqn.invars]
            outs = [boundary.aval(v) for v in eqn.outvars]
            out.append(
                Site(
                    index=len(out),
                    primitive=name,
                    scope=here,
                    where=boundary.where(eqn),
                    loops=loops,
                    in_shapes=tuple(tuple(a.shape) for a in ins),
                    out_shapes=tuple(tuple(a.shape) for a in outs),
                    dtype=str(ins[0].dtype),
                    path=(*path, i),
                    within=within,
                    lengths=lengths,
                    in_dtypes=tuple(str(a.dtype) for a in ins),
                    flops=boundary.product_flops(eqn),
                    out_dtype=str(outs[0].dtype) if outs else "",
                )
            )
            continue
        subs = boundary.subprograms(eqn)
        if not subs:
            continue
        kind = boundary.kind(eqn.primitive)
        if kind is None and unknown is not None:
            unknown[(*path, i)] = name
        inner = "/".join(p for p in (here, boundary.call_name(eqn)) if p)
        inner_loops = loops + ((kind,) if kind in boundary.LOOPS else ())
        inner_lengths = lengths + ((boundary.loop_length(eqn),) if kind in boundary.LOOPS else ())
        # custom derivatives are named too: a rule may leave their insides alone
        inner_within = within + (() if kind in (boundary.JIT, boundary.CALL) else (kind or name,))
        for k, sub in enumerate(subs):
            _walk(
                boundary.open_jaxpr(sub)[0], (*path, i, k), inner, inner_loops, prims, out,
                inner_within, inner_lengths, unknown,
            )  # fmt: skip


# --- evaluation ----------------------------------------------------------------------------
@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _broadcast_max(x: jax.Array, n: int) -> jax.Array:
    return jnp.broadcast_to(x, (n, *x.shape))


def _bmax_fwd(x: jax.Array, n: int) -> tuple[jax.Array, None]:
    return _broadcast_max(x, n), None


def _bmax_bwd(n: int, _: None, ct: jax.Array) -> tuple[jax.Array]:
    return (jnp.max(ct, axis=0),)


_broadcast_max.defvjp(_bmax_fwd, _bmax_bwd)


def _broadcast_state(state: Any, n: int) -> Any:
    def one(x: jax.typing.ArrayLike) -> jax.Array:
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return _broadcast_max(x, n)
        return jnp.broadcast_to(x, (n, *x.shape))

    return jax.tree.map(one, state)


def _slice_state(state: _State, keys: set[str], index: jax.Array) -> dict[str, Any]:
    """``state`` with the :class:`PerIteration` entries in ``keys`` sliced at ``index``."""
    return {
        k: PerIteration(jax.tree.map(lambda a: a[index], v.value))
        if k in keys and isinstance(v, PerIteration)
        else v
        for k, v in state.items()
    }


def _zeros(shape: tuple[int, ...], like: boundary.ArrayAval) -> jax.Array:
    """Zeros varying over the manual axes ``like`` (an aval) varies over inside
    ``shard_map``, so a branch or loop carry holding them has the type the computed values
    have."""
    return boundary.pvary(jnp.zeros(shape, like.dtype), boundary.varying_axes(like))


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(lambda a: _zeros(a.shape, a), tree)


@dataclasses.dataclass
class _Run:
    rule: Rule
    sites: dict[tuple[int, ...], Site]  # selected sites by path
    prefixes: frozenset[Path]  # paths of sub-programs that hold a selected site
    key: jax.Array | None
    while_capacity: int = 16
    plain: bool = False  # rewrite sub-programs by type (no state, aux or key to thread)

    def eval(
        self,
        jaxpr: boundary.Jaxpr,
        consts: Sequence[Value],
        args: Sequence[Value],
        path: Path,
        state: _State,
        loops: _Loops,
    ) -> _Evaluated:
        """The program's outputs and the :class:`Aux` of every site under it that emitted."""
        env = boundary.environment(jaxpr, consts, args)
        aux: dict[str, Aux] = {}

        def read(v: boundary.Atom) -> Value:
            return v.val if isinstance(v, boundary.Literal) else env[v]

        for i, eqn in enumerate(jaxpr.eqns):
            invals = [read(v) for v in eqn.invars]
            here = (*path, i)
            outs: Sequence[Value]
            if here in self.sites:
                site = self.sites[here]
                st = state.get(site.name)
                if isinstance(st, PerIteration):
                    st = st.value
                ctx = Context(site, st, loops, self.key, eqn)
                with boundary.source_context(eqn):
                    res = self.rule.apply(ctx, *invals, **eqn.params)
                if isinstance(res, Emit):
                    aux[site.name] = Aux(res.aux, jnp.bool_(True))
                    res = res.outputs
                outs = list(res)
            elif here in self.prefixes:
                with boundary.source_context(eqn):
                    outs, sub_aux = self.higher_order(eqn, invals, here, state, loops)
                aux.update(sub_aux)
            else:
                with boundary.source_context(eqn):
                    outs = boundary.bind(eqn.primitive, eqn.params, *invals)
            for v, o in zip(eqn.outvars, outs, strict=True):
                env[v] = o  # a dropped output's variable is never read
        return [read(v) for v in jaxpr.outvars], aux

    def _sub(
        self, closed: boundary.Program, path: Path, state: _State, loops: _Loops
    ) -> Callable[..., _Evaluated]:
        jaxpr, consts = boundary.open_jaxpr(closed)
        return lambda *a: self.eval(jaxpr, consts, list(a), path, state, loops)

    def _inner(self, path: Path) -> set[str]:
        return {s.name for p, s in self.sites.items() if p[: len(path)] == path}

    def _loop_state(self, path: Path, state: _State, n: int) -> dict[str, Any]:
        """Broadcast (gradient: max) the plain states of sites under ``path`` along a scan;
        :class:`PerIteration` states go in as they are (the scan slices them)."""
        inner = self._inner(path)
        out = {}
        for k, v in state.items():
            if k not in inner:
                continue
            if isinstance(v, PerIteration):
                for a in jax.tree.leaves(v.value):
                    if not a.shape or a.shape[0] != n:
                        raise ValueError(
                            f"PerIteration state of {k}: leading axis {a.shape[:1]} does not "
                            f"match the scan's {n} iterations"
                        )
                out[k] = v
            else:
                out[k] = _broadcast_state(v, n)
        return out

    def higher_order(
        self, eqn: boundary.Eqn, invals: list[Value], path: Path, state: _State, loops: _Loops
    ) -> _Evaluated:
        kind = boundary.kind(eqn.primitive)
        if kind is None:
            inside = sorted(s.name for p, s in self.sites.items() if p[: len(path)] == path)
            raise boundary.unsupported(inside, eqn)
        if kind in boundary.CALLS:
            # inlined: a custom_jvp/vjp holding a replaced operation loses its custom rule
            return self._sub(boundary.call_program(eqn), (*path, 0), state, loops)(*invals)
        if self.plain:
            outs = self._rewrite(eqn, invals, path, loops)
            if outs is not None:
                return outs, {}
        p = eqn.params
        if kind == boundary.CHECKPOINT:
            prog, prevent_cse, policy = boundary.checkpoint_parts(p)
            f = self._sub(prog, (*path, 0), state, loops)
            outs, aux = jax.checkpoint(f, prevent_cse=prevent_cse, policy=policy)(*invals)
            return list(outs), aux
        if kind == boundary.COND:
            return self._cond(p, invals, path, state, loops)
        if kind == boundary.SCAN:
            return self._scan(p, invals, path, state, loops)
        return self._while(p, invals, path, state, loops)

    def _rewrite(
        self, eqn: boundary.Eqn, invals: list[Value], path: Path, loops: _Loops
    ) -> list[Value] | None:
        """``eqn`` bound again with every sub-program holding a selected site re-traced through
        the rule (None when a program cannot be re-expressed: the adapter then runs it)."""

        class _Retry(Exception):
            pass

        def transform(prog: boundary.Program, k: int) -> boundary.Program:
            sub = (*path, k)
            if sub not in self.prefixes:
                return prog
            jaxpr, consts = boundary.open_jaxpr(prog)

            def run(*a: Value) -> list[Value]:
                return self.eval(jaxpr, consts, list(a), sub, {}, loops)[0]

            new = boundary.retrace(run, prog)
            if new is None:
                raise _Retry
            return new

        try:
            return boundary.rebind(eqn, invals, transform)
        except _Retry:
            return None

    def _cond(
        self, p: dict[str, Any], invals: list[Value], path: Path, state: _State, loops: _Loops
    ) -> _Evaluated:
        branches = boundary.cond_branches(p)
        subs = [self._sub(b, (*path, k), state, loops) for k, b in enumerate(branches)]
        ops = invals[1:]
        if len(subs) == 1:
            return subs[0](*ops)
        # every branch returns every branch's aux: its own, and zeros (valid False) for others
        shapes = [boundary.eval_shape(f, *ops)[1] for f in subs]

        def branch(k: int) -> Callable[..., _Evaluated]:
            def run(*a: Value) -> _Evaluated:
                outs, aux = subs[k](*a)
                full: dict[str, Aux] = {}
                for j, sh in enumerate(shapes):
                    for site, x in sh.items():
                        full[site] = aux[site] if j == k else _zeros_like(x)
                return outs, full

            return run

        outs, aux = lax.switch(invals[0], [branch(k) for k in range(len(subs))], *ops)
        return list(outs), aux

    def _scan(
        self, p: dict[str, Any], invals: list[Value], path: Path, state: _State, loops: _Loops
    ) -> _Evaluated:
        split = boundary.scan_split(p)
        nc, ncarry, n = split.n_consts, split.n_carry, split.length
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        jaxpr, jconsts = boundary.open_jaxpr(split.jaxpr)
        loop_state = self._loop_state(path, state, n)

        def body(
            carry: tuple[jax.Array, list[Value]], x: tuple[list[Value], dict[str, Any]]
        ) -> tuple[tuple[jax.Array, list[Value]], tuple[list[Value], dict[str, Aux]]]:
            i, c = carry
            xs_i, st_i = x
            st = {**state, **st_i}
            outs, aux = self.eval(jaxpr, jconsts, [*consts, *c, *xs_i], (*path, 0), st, (*loops, i))
            return (i + 1, outs[:ncarry]), (outs[ncarry:], aux)

        (_, carry), (ys, aux) = lax.scan(
            body, (jnp.int32(0), list(init)), (list(xs), loop_state), length=n,
            reverse=split.reverse, unroll=split.unroll,
        )  # fmt: skip
        return [*carry, *ys], aux

    def _while(
        self, p: dict[str, Any], invals: list[Value], path: Path, state: _State, loops: _Loops
    ) -> _Evaluated:
        parts = boundary.while_parts(p)
        cn, bn = parts.cond_nconsts, parts.body_nconsts
        cconsts, bconsts, init = invals[:cn], invals[cn : cn + bn], invals[cn + bn :]
        cond_j, cond_c = boundary.open_jaxpr(parts.cond_jaxpr)
        body_j, body_c = boundary.open_jaxpr(parts.body_jaxpr)
        body_path = (*path, boundary.while_body_index(p))
        cond_path = (*path, boundary.while_cond_index(p))
        in_cond = sorted(s.name for q, s in self.sites.items() if q[: len(cond_path)] == cond_path)
        if in_cond:  # the condition runs as it is here: its operations would not be replaced
            raise NotImplementedError(
                f"{', '.join(in_cond)} sits in a while_loop's condition, where state and "
                f"auxiliary outputs cannot be threaded: exclude it (exclude={in_cond!r}) or "
                "compute it in the loop body"
            )
        cap = self.while_capacity
        inner = self._inner(path)

        def run_body(i: jax.Array, c: list[Value]) -> _Evaluated:
            st = _slice_state(state, inner, jnp.minimum(i, cap - 1))
            return self.eval(body_j, body_c, [*bconsts, *c], body_path, st, (*loops, i))

        shapes = boundary.eval_shape(run_body, jnp.int32(0), list(init))[1]
        buf0 = jax.tree.map(lambda a: _zeros((cap, *a.shape), a), shapes)

        def cond(carry: tuple[jax.Array, list[Value], dict[str, Aux]]) -> Value:
            _, c, _ = carry
            return boundary.jaxpr_as_fun(cond_j, cond_c)(*cconsts, *c)[0]

        def body(
            carry: tuple[jax.Array, list[Value], dict[str, Aux]],
        ) -> tuple[jax.Array, list[Value], dict[str, Aux]]:
            i, c, buf = carry
            outs, aux = run_body(i, c)
            # iterations past the capacity are dropped (mode="drop": an out-of-range write)
            buf = jax.tree.map(lambda b, a: b.at[i].set(a, mode="drop"), buf, aux)
            return i + 1, outs, buf

        _, out, buf = lax.while_loop(cond, body, (jnp.int32(0), list(init), buf0))
        return list(out), buf


def _prefixes(paths: Iterable[Path]) -> frozenset[Path]:
    out: set[Path] = set()
    for p in paths:
        for k in range(1, len(p)):
            out.add(p[:k])
    return frozenset(out)


class _Traced(NamedTuple):
    closed: boundary.ClosedJaxpr
    out_shape: Any  # the output pytree, ShapeDtypeStruct leaves
    dyn: list[Value]  # the traced leaves' values
    leaves: list[_dataflow.Flow]  # a Flow per traced leaf (parameter or data)
    consts: list[_dataflow.Flow]  # a Flow per captured constant


def _labelled(site: Site, flows: tuple[_dataflow.Flow, ...]) -> Site:
    """``site`` with its operands' labels and, for a matmul or convolution, their roles."""
    if not flows:
        return site
    roles = tuple("w" if f.weight else "x" for f in flows[:2])
    return dataclasses.replace(
        site, operands=tuple(f.label() for f in flows),
        roles=roles if site.primitive in boundary.PRODUCTS else (),
    )  # fmt: skip


class Intercepted:
    """``fn`` with the rule's primitives replaced; see :func:`intercept`."""

    def __init__(
        self, fn: Callable[..., Any], rule: Rule, include: _Items | None, exclude: _Items,
        while_capacity: int = 16, numbering: str = "program",
        params: int | Sequence[int] | None = None, default: Callable[[Site], bool] | None = None,
    ) -> None:  # fmt: skip
        if not callable(fn):
            raise TypeError(f"intercept needs a callable, got {type(fn).__name__}")
        prims = getattr(rule, "primitives", None)
        if not prims or not all(isinstance(q, str) for q in prims):
            raise TypeError("the rule needs a non-empty tuple of primitive names: .primitives")
        if include is not None and isinstance(include, (str, int)):
            include = (include,)
        if isinstance(exclude, (str, int)):
            exclude = (exclude,)
        self.fn, self.rule = fn, rule
        self.include = None if include is None else tuple(include)
        self.exclude = tuple(exclude)
        if isinstance(while_capacity, bool) or not isinstance(while_capacity, int):
            raise TypeError(f"while_capacity must be an int >= 1, got {while_capacity!r}")
        if while_capacity < 1:
            raise ValueError(f"while_capacity must be an int >= 1, got {while_capacity!r}")
        self.while_capacity = while_capacity
        if numbering not in NUMBERINGS:
            raise ValueError(f"unknown numbering {numbering!r}; allowed: {', '.join(NUMBERINGS)}")
        self.numbering = numbering
        self.params, self.default = params, default
        self.__wrapped__ = fn

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Traced:
        closed, out_shape, dyn = boundary.trace(self.fn, args, kwargs)
        nums = _dataflow.param_args(args, self.params)
        leaves, consts = _dataflow.input_flows(self.fn, args, kwargs, nums, closed.consts)
        return _Traced(closed, out_shape, dyn, leaves, consts)

    def _found(self, t: _Traced) -> tuple[list[Site], list[Site], dict[Path, str]]:
        """(matched sites, numbered, labelled, skipped ones marked; candidate sites the rule
        has no rule for; paths of unknown higher-order primitives)."""
        prims = tuple(self.rule.primitives)
        extra = tuple(p for p in getattr(self.rule, "candidates", ()) if p not in prims)
        found: list[Site] = []
        unknown: dict[Path, str] = {}
        _walk(t.closed.jaxpr, (), "", (), prims + extra, found, unknown=unknown)
        flows = _dataflow.label(t.closed, t.leaves, t.consts, prims + extra).flows
        found = [_labelled(s, flows.get(s.path, ())) for s in found]
        matched = numbered([s for s in found if s.primitive in prims], self.numbering)
        declines = getattr(self.rule, "declines", None)
        if declines is not None:
            matched = [dataclasses.replace(s, skipped=declines(s) or "") for s in matched]
        others = numbered([s for s in found if s.primitive in extra], "primitive")
        others = [
            dataclasses.replace(s, selected=False, skipped=f"no rule for {s.primitive}")
            for s in others
        ]
        skipped = [s for s in matched if s.skipped] + others
        if skipped:
            _warn_skipped(self.rule, skipped)
        return matched, others, unknown

    def _walk(self, t: _Traced) -> tuple[list[Site], dict[Path, str]]:
        matched, _, unknown = self._found(t)
        return select(matched, self.include, self.exclude, self.default), unknown

    def sites(self, *args: Any, **kwargs: Any) -> list[Site]:
        """Every matched operation of ``fn`` on these arguments, in program order, with
        ``selected`` telling which the call replaces (arguments may be ShapeDtypeStructs)."""
        return self._walk(self._trace(args, kwargs))[0]

    def skipped(self, *args: Any, **kwargs: Any) -> list[Site]:
        """The operations the rule could act on but leaves as they were (``Site.skipped``
        says why): matched ones it declines, then those of its ``candidates``."""
        matched, others, _ = self._found(self._trace(args, kwargs))
        return [s for s in matched if s.skipped] + others

    def promotions(self, *args: Any, **kwargs: Any) -> list[tuple[Site, Promotion | None, str]]:
        """For every matmul or convolution that multiplies in 32 bits or more, in program
        order: the earliest operation that turned a 16-bit value into what its operands
        carry (:class:`Promotion`, with its reason) and ``""``; or None and why its
        operands never were 16-bit (a float32 input or parameter that nothing cast)."""
        t = self._trace(args, kwargs)
        sites = self._walk(t)[0]
        prims = tuple(self.rule.primitives)
        labels = _dataflow.label(t.closed, t.leaves, t.consts, prims)
        out: list[tuple[Site, Promotion | None, str]] = []
        for s in sites:
            if s.primitive not in boundary.PRODUCTS or bit_width(s.compute_dtype) < 32:
                continue
            flows = labels.flows.get(s.path, ())
            paths = [f.promoted for f in flows if f.promoted is not None]
            if paths:
                out.append((s, labels.promotions.get(min(paths)), ""))
            else:
                out.append((s, None, _dataflow.unpromoted(flows, s.in_dtypes)))
        return out

    def report(self, *args: Any, **kwargs: Any) -> str:
        """The matched operations, one line each (see :meth:`Site.describe`), then the
        operations the rule leaves as they were although it could act on them."""
        t = self._trace(args, kwargs)
        sites = self._walk(t)[0]
        _, others, _ = self._found(t)
        n = sum(s.selected for s in sites)
        # per primitive, so that "3 matched" does not read as if every covered kind was found
        counts = collections.Counter(s.primitive for s in sites)
        kinds = ", ".join(f"{counts[p]} {p}" for p in self.rule.primitives if counts[p])
        kinds = kinds or "no " + " or ".join(self.rule.primitives)
        head = f"{len(sites)} matched ({kinds}), {n} replaced"
        lines = [head, *(s.describe() for s in sites)]
        skipped = [s for s in sites if s.skipped] + others
        if skipped:
            lines.append(f"{len(skipped)} left as they were (not covered): " + ", ".join(
                f"{s.name} ({s.skipped})" for s in skipped))  # fmt: skip
        lines.extend(s.describe() for s in others)
        return "\n".join(lines)

    def call_with_aux(
        self,
        state: Mapping[str, Any] | None,
        *args: Any,
        key: jax.Array | None = None,
        **kwargs: Any,
    ) -> tuple[Any, dict[str, Aux]]:
        """``(fn(*args, **kwargs), aux)`` with the replacements: ``aux`` maps the name of
        each site whose rule returned an :class:`Emit` to its :class:`Aux` (see the module
        docstring); ``state`` and ``key`` as in :meth:`call_with_state`."""
        t = self._trace(args, kwargs)
        closed, out_shape, dyn = t.closed, t.out_shape, t.dyn
        sites, foreign = self._walk(t)
        state = dict(state or {})
        unknown = set(state) - {s.name for s in sites}
        if unknown:
            raise ValueError(
                f"state for unknown operations {sorted(unknown)}; "
                f"matched: {', '.join(s.name for s in sites) or 'none'}"
            )
        chosen = {s.path: s for s in sites if s.selected}
        for path, name in foreign.items():
            inside = [s.name for p, s in chosen.items() if p[: len(path)] == path]
            if inside:
                raise boundary.unsupported(inside, name)
        plain = getattr(self.rule, "emits", True) is False and key is None and not state
        run = _Run(self.rule, chosen, _prefixes(chosen), key, self.while_capacity, plain)
        outs, aux = run.eval(closed.jaxpr, closed.consts, dyn, (), state, ())
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs), aux

    def call_with_state(
        self,
        state: Mapping[str, Any] | None,
        *args: Any,
        key: jax.Array | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` with the replacements; ``state`` maps site names to
        the pytrees the rule reads (``ctx.state``; a :class:`PerIteration` entry is sliced
        per loop iteration); ``key`` seeds ``ctx.site_key()``."""
        return self.call_with_aux(state, *args, key=key, **kwargs)[0]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_with_state(None, *args, **kwargs)


def intercept(
    fn: Callable[..., Any],
    rule: Rule,
    *,
    include: _Items | None = None,
    exclude: _Items = (),
    while_capacity: int = 16,
    numbering: str = "program",
    params: int | Sequence[int] | None = None,
    default: Callable[[Site], bool] | None = None,
) -> Intercepted:
    """``fn`` with every matched primitive replaced by ``rule.apply``.

    Args:
      fn: any JAX-traceable function (a Flax/Equinox/plain model's apply, a loss).
        Array arguments (jax/numpy arrays) are traced; other leaves of the arguments are
        static (closed over), as in ``jax.jit`` with static arguments.
      rule: a :class:`Rule` (``primitives`` and ``apply``).
      include: positions, names or glob patterns of the matched operations to replace
        (default: all); see :func:`precisionlab.intercept.select`.
      exclude: the same, left as they are (``exclude=(0, -1)`` keeps the first and last).
      while_capacity: how many iterations of a ``while_loop`` the auxiliary outputs of
        :meth:`Intercepted.call_with_aux` keep (static int >= 1; later ones are dropped).
      numbering: ``"program"`` (default): a site's index is its position among all matched
        operations (``"exp[0]"``, ``"div[2]"``); ``"primitive"``: among those of its primitive
        (``"dot_general[0]"``, ``"conv_general_dilated[0]"``), so adding a primitive to a rule
        renames no matmul. Positions in ``include``/``exclude`` count all of them either way.
      params: the positions of the arguments holding the parameters, for the sites' labels
        and roles (``Site.operands``, ``Site.roles``); None: the first argument
        when there are two or more, or when the only one holds several arrays (see
        ``precisionlab.intercept._dataflow.param_args``). Captured constants always count
        as parameters.
      default: which sites are selected when ``include`` is None (a predicate; None: all).

    Returns:
      An :class:`Intercepted`: call it like ``fn``; ``.sites(...)`` / ``.report(...)`` list
      the matched operations; ``.call_with_state(state, ...)`` passes per-site state;
      ``.call_with_aux(state, ...)`` also returns the rule's auxiliary outputs.
    """
    return Intercepted(fn, rule, include, exclude, while_capacity, numbering, params, default)
