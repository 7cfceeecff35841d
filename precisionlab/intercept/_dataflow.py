"""Which parameter each matched operation multiplies: labels from the program's dataflow.

One forward pass over the traced program (sub-programs included, as the interpreter walks
them) gives every value a :class:`Flow`: whether it depends on a *data* input (an input leaf
that is not a parameter), the parameter leaves it depends on, and the one parameter leaf it
is a *view* of, when it is that leaf moved through layout and dtype changes only
(``convert_element_type``, ``reshape``, ``transpose``, ``broadcast_in_dim``, slices, a
``scan``'s per-iteration slice of stacked layers, calls ...). An operand of a matched
matmul or convolution is then:

- a **weight** (role ``"w"``) when it depends on parameters and constants only, labelled by the
  leaf it is a view of (``"layers/0/attn/q_proj/kernel"``) or by the leaves it is computed
  from (``"lora_a+lora_b"``);
- an **activation** (role ``"x"``) when it depends on data (its label is ``""``).

So attention's ``QK^T`` and ``PV`` have two activation operands: their K and V are never
weights, whatever side they sit on. A loop carry takes the join of its initial value and
every iteration's (a fixed point); a ``cond`` output the join of its branches.

Which inputs are parameters is the caller's choice (:func:`param_args`); captured constants
(arrays the function closes over: a bound Equinox or NNX module's weights) always count as
parameters, named by their path when the function is itself a pytree holding them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax

from precisionlab.intercept import _boundary as boundary

__all__ = ["Flow", "Labels", "Promotion", "label", "leaf_label", "param_args", "unpromoted"]

_MAX_LABELS = 3

Path = boundary.Path
#: The equation that computed each variable of a program (for messages).
_Producers = dict[boundary.Atom, boundary.Eqn]


@dataclasses.dataclass(frozen=True)
class Flow:
    """What a value depends on: ``data`` (a non-parameter input), ``params`` (parameter leaf
    labels), ``view`` (the one input leaf it is a copy of, or None), ``promoted`` (for a
    value of 32 bits or more: the path of the earliest equation that turned a 16-bit value
    into it, or None when it never was 16-bit)."""

    data: bool = False
    params: frozenset[str] = frozenset()
    view: str | None = None
    promoted: tuple[int, ...] | None = None

    @property
    def weight(self) -> bool:
        """A weight: parameters and constants only, no data."""
        return not self.data and bool(self.params)

    def label(self) -> str:
        """The weight's label (``""`` for an activation or a value of nothing)."""
        if not self.weight:
            return ""
        if self.view is not None:
            return self.view
        names = sorted(self.params)
        more = "+..." if len(names) > _MAX_LABELS else ""
        return "+".join(names[:_MAX_LABELS]) + more


_NOTHING = Flow()


def _earliest(flows: Sequence[Flow]) -> tuple[int, ...] | None:
    paths = [f.promoted for f in flows if f.promoted is not None]
    return min(paths) if paths else None


def _join(flows: Sequence[Flow], keep_view: bool = False) -> Flow:
    if not flows:
        return _NOTHING
    views = {f.view for f in flows}
    view = next(iter(views)) if keep_view and len(views) == 1 else None
    return Flow(
        any(f.data for f in flows), frozenset().union(*(f.params for f in flows)), view,
        _earliest(flows),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Promotion:
    """An equation that turned a 16-bit floating value into a 32-bit one.

    ``primitive``; ``where`` (source line); ``scope``; ``value`` (what was promoted: a
    parameter's path, ``"an input"`` or the operation that made it); ``src`` / ``dst``
    (dtype names); ``reason`` (why, in words).
    """

    primitive: str
    where: str
    scope: str
    value: str
    src: str
    dst: str
    reason: str

    def describe(self) -> str:
        """One line: what was promoted where, and why."""
        at = f" at {self.where}" if self.where else ""
        return (
            f"{self.primitive}{at} turned {self.value} ({self.src}) into {self.dst}: {self.reason}"
        )


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_label(path: Sequence[Any]) -> str:
    """``"layers/0/attn/kernel"`` for a pytree key path (dict keys, attributes, indices);
    a trailing ``.value`` (an NNX ``Variable``'s array) is dropped."""
    names = [_key_name(k) for k in path]
    if len(path) > 1 and names[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":
        names = names[:-1]
    return "/".join(names)


def param_args(args: tuple[Any, ...], params: int | Sequence[int] | None) -> tuple[int, ...]:
    """The positions of the arguments holding parameters. ``params`` None: the first argument
    when there are two or more (``apply(params, x)``, ``loss(params, batch)``,
    ``f(model, x)``) or when the only one is a pytree of several arrays; none when the only
    argument is one array (``model(x)``: the parameters are captured constants)."""
    if params is not None:
        nums = (params,) if isinstance(params, int) else tuple(params)
        for n in nums:
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < len(args):
                raise ValueError(
                    f"params={params!r}: argument positions in 0..{len(args) - 1} (the call has "
                    f"{len(args)} positional arguments)"
                )
        return nums
    if len(args) >= 2:
        return (0,)
    if len(args) == 1 and sum(boundary.is_array(x) for x in jax.tree.leaves(args[0])) > 1:
        return (0,)
    return ()


def input_flows(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    params: tuple[int, ...],
    consts: Sequence[Any],
) -> tuple[list[Flow], list[Flow]]:
    """(flows of the traced leaves in ``boundary.trace`` order, flows of the constants)."""
    leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    out = []
    several = len(params) > 1
    for path, leaf in leaves:
        if not boundary.is_array(leaf):
            continue
        in_args = len(path) >= 2 and _key_name(path[0]) == "0"
        argnum = int(_key_name(path[1])) if in_args else -1
        if argnum in params:
            rest = leaf_label(path[2:]) or f"arg{argnum}"
            name = f"arg{argnum}/{rest}" if several and path[2:] else rest
            out.append(Flow(False, frozenset({name}), name))
        else:  # data: named for the dtype audit's messages only
            rest = leaf_label(path[2:] if in_args else path[1:])
            head = f"arg{argnum}" if in_args else "kwargs"
            out.append(Flow(data=True, view=f"{head}/{rest}" if rest else head))
    # captured constants: parameters; named by their path in fn when fn is a pytree of them
    known: dict[int, str] = {}
    try:
        for path, leaf in jax.tree_util.tree_flatten_with_path(fn)[0]:
            known[id(leaf)] = leaf_label(path)
    except Exception:
        known = {}
    cflows = []
    for i, c in enumerate(consts):
        name = known.get(id(c)) or f"const{i}"
        cflows.append(Flow(False, frozenset({name}), name))
    return out, cflows


def _bits(aval: object) -> int:
    """The width of a floating aval or dtype (0 for other dtypes)."""
    dt = aval if isinstance(aval, jax.numpy.dtype) else getattr(aval, "dtype", None)
    try:
        if dt is None or not jax.numpy.issubdtype(dt, jax.numpy.floating):
            return 0
        return jax.numpy.dtype(dt).itemsize * 8
    except TypeError:
        return 0


class _Labeller:
    def __init__(self, prims: frozenset[str]) -> None:
        self.prims = prims
        self.seen: dict[tuple[int, ...], tuple[Flow, ...]] = {}
        self.promotions: dict[tuple[int, ...], Promotion] = {}
        self.why: dict[tuple[int, ...], str] = {}

    def _describe(self, v: boundary.Atom, f: Flow, producers: _Producers) -> str:
        """A genuine 32-bit operand, in words."""
        dtype = boundary.aval(v).dtype
        if f.view is not None:
            kind = "input" if f.data else "parameter"
            return f"`{f.view}`, a {dtype} {kind}"
        if f.weight:
            return f"{dtype} parameters ({f.label()})"
        eqn = producers.get(v)
        if eqn is None:
            return f"a {dtype} constant"
        where = boundary.where(eqn)
        return f"the {dtype} result of {eqn.primitive.name}" + (f" at {where}" if where else "")

    def _promote(
        self, eqn: boundary.Eqn, flows: list[Flow], here: Path, producers: _Producers
    ) -> Path | None:
        """The promoted path of ``eqn``'s outputs (a new promotion here, or the inputs')."""
        outs = [_bits(v.aval) for v in eqn.outvars]
        if not outs or max(outs) < 32:
            return None
        narrow = [
            (v, f) for v, f in zip(eqn.invars, flows, strict=False) if 0 < _bits(v.aval) <= 16
        ]
        if narrow and not boundary.subprograms(eqn):
            v, f = narrow[0]
            name = eqn.primitive.name
            made = producers.get(v)
            value = (
                f"`{f.view}`" if f.view is not None
                else f"the {made.primitive.name if made is not None else 'constant'} result"
            )  # fmt: skip
            if name in boundary.PRODUCTS:  # the products' operands get roles
                self.why[here] = (
                    f"it returns {boundary.aval(eqn.outvars[0]).dtype} (preferred_element_type) "
                    "and nothing casts the result back"
                )
            self.promotions[here] = Promotion(
                name, boundary.where(eqn), boundary.name_stack(eqn), value,
                str(boundary.aval(v).dtype), str(boundary.aval(eqn.outvars[0]).dtype), "",
            )  # fmt: skip
            return here
        return _earliest(flows)

    def _explain(self, eqn: boundary.Eqn, flows: list[Flow], producers: _Producers) -> None:
        """Explain the promotions this equation mixes with a genuine 32-bit operand."""
        genuine = [  # 32-bit values from inputs or parameters, never 16-bit (not constants)
            (v, f) for v, f in zip(eqn.invars, flows, strict=False)
            if _bits(getattr(v, "aval", None)) >= 32 and f.promoted is None
            and not boundary.is_literal(v) and (f.data or f.params)
        ]  # fmt: skip
        if not genuine:
            return
        for f in flows:
            if f.promoted is not None and f.promoted not in self.why:
                v, g = genuine[0]
                at = boundary.where(eqn)
                self.why[f.promoted] = (
                    f"mixed with {self._describe(v, g, producers)} in {eqn.primitive.name}"
                    + (f" at {at}" if at else "")
                )

    def run(
        self, jaxpr: boundary.Jaxpr, consts: Sequence[Flow], ins: Sequence[Flow], path: Path
    ) -> list[Flow]:
        env = boundary.environment(jaxpr, consts, ins)
        producers: _Producers = {}

        def read(v: boundary.Atom) -> Flow:
            return _NOTHING if isinstance(v, boundary.Literal) else env.get(v, _NOTHING)

        for i, eqn in enumerate(jaxpr.eqns):
            flows = [read(v) for v in eqn.invars]
            here = (*path, i)
            if eqn.primitive.name in self.prims:
                self.seen[here] = tuple(flows)
            self._explain(eqn, flows, producers)
            subs = boundary.subprograms(eqn)
            if subs:
                outs = self.higher(eqn, flows, subs, here)
            else:
                promoted = self._promote(eqn, flows, here, producers)
                one = dataclasses.replace(self.first_order(eqn, flows), promoted=promoted)
                outs = [one] * len(eqn.outvars)
            for v, f in zip(eqn.outvars, outs, strict=False):
                if _bits(v.aval) < 32 and f.promoted is not None:
                    f = dataclasses.replace(f, promoted=None)
                env[v] = f
                producers[v] = eqn
        return [read(v) for v in jaxpr.outvars]

    @staticmethod
    def first_order(eqn: boundary.Eqn, flows: list[Flow]) -> Flow:
        if not flows:
            return _NOTHING
        if eqn.primitive.name in boundary.VIEWS and not any(f.data for f in flows[1:]):
            head = flows[0]
            rest = _join(flows[1:])
            return Flow(head.data, head.params | rest.params, head.view)
        return _join(flows)

    def _sub(self, prog: boundary.Program, ins: Sequence[Flow], path: Path) -> list[Flow]:
        jaxpr, consts = boundary.open_jaxpr(prog)
        cflows = [Flow(False, frozenset({"const"}), "const") for _ in consts]
        return self.run(jaxpr, cflows, ins, path)

    def higher(
        self, eqn: boundary.Eqn, flows: list[Flow], subs: list[boundary.Program], path: Path
    ) -> list[Flow]:
        try:
            return self._known(eqn, flows, subs, path)
        except Exception:
            return self._generic(eqn, flows, subs, path)

    def _known(
        self, eqn: boundary.Eqn, flows: list[Flow], subs: list[boundary.Program], path: Path
    ) -> list[Flow]:
        kind = boundary.kind(eqn.primitive)
        if kind in boundary.CALLS or kind == boundary.CHECKPOINT:
            return self._sub(subs[0], flows, (*path, 0))
        if kind == boundary.COND:
            branches = [self._sub(b, flows[1:], (*path, k)) for k, b in enumerate(subs)]
            return [_join(list(col), keep_view=True) for col in zip(*branches, strict=True)]
        if kind == boundary.SCAN:
            split = boundary.scan_split(eqn.params)
            nc, ncar = split.n_consts, split.n_carry
            consts, carry, xs = flows[:nc], flows[nc : nc + ncar], flows[nc + ncar :]
            for _ in range(4):  # the carries' fixed point (flows only grow)
                outs = self._sub(subs[0], [*consts, *carry, *xs], (*path, 0))
                new = [_join([a, b], keep_view=True) for a, b in
                       zip(carry, outs[:ncar], strict=True)]  # fmt: skip
                if new == carry:
                    break
                carry = new
            return [*carry, *outs[ncar:]]
        if kind == boundary.WHILE:
            parts = boundary.while_parts(eqn.params)
            cn, bn = parts.cond_nconsts, parts.body_nconsts
            cconsts, bconsts, carry = flows[:cn], flows[cn : cn + bn], flows[cn + bn :]
            body_k = boundary.while_body_index(eqn.params)
            cond_k = boundary.while_cond_index(eqn.params)
            for _ in range(4):
                outs = self._sub(parts.body_jaxpr, [*bconsts, *carry], (*path, body_k))
                new = [_join([a, b], keep_view=True) for a, b in
                       zip(carry, outs, strict=True)]  # fmt: skip
                if new == carry:
                    break
                carry = new
            self._sub(parts.cond_jaxpr, [*cconsts, *carry], (*path, cond_k))
            return carry
        return self._generic(eqn, flows, subs, path)

    def _generic(
        self, eqn: boundary.Eqn, flows: list[Flow], subs: list[boundary.Program], path: Path
    ) -> list[Flow]:
        """A construct read by type only: positional where the arities agree (a loop's carry
        taken once, not to its fixed point), else everything joined."""
        n_out = len(eqn.outvars)
        everything = _join(flows)
        results: list[list[Flow]] = []
        for k, sub in enumerate(subs):
            jaxpr, _ = boundary.open_jaxpr(sub)
            ins = flows if len(jaxpr.invars) == len(flows) else [everything] * len(jaxpr.invars)
            results.append(self._sub(sub, ins, (*path, k)))
        cols = [r for r in results if len(r) == n_out]
        if cols:
            return [_join(list(col)) for col in zip(*cols, strict=True)]
        return [_join([f for r in results for f in r] or [everything])] * n_out


def unpromoted(flows: Sequence[Flow], dtypes: Sequence[str]) -> str:
    """Why a 32-bit product none of whose operands descends from a promotion multiplies in
    32 bits: the operands that never were 16-bit, described."""

    def one(f: Flow, dtype: str) -> str:
        if f.view is not None:
            return f"`{f.view}` ({dtype} {'input' if f.data else 'parameter'})"
        if f.weight:
            return f"{dtype} parameters ({f.label()})"
        return f"a {dtype} activation computed from {'inputs' if f.data else 'constants'}"

    pairs = list(zip(flows, dtypes, strict=False))
    narrow = [one(f, d) for f, d in pairs if "float" in d and _bits(jax.numpy.dtype(d)) <= 16]
    wide = [one(f, d) for f, d in pairs if "float" in d and _bits(jax.numpy.dtype(d)) >= 32]
    if narrow and wide:
        return (
            f"it multiplies {' and '.join(narrow)} with {' and '.join(wide)}, which never was "
            "16-bit: mixed operands multiply in the wider dtype (cast it with the policy too)"
        )
    return (
        f"its operands were never 16-bit: {' and '.join(wide)}; nothing cast them to the "
        "compute dtype (cast the parameters and inputs with the policy)"
    )


class Labels(NamedTuple):
    """What :func:`label` finds: ``flows`` (the operands' flows of every equation of the
    primitives asked for, by path) and ``promotions`` (every equation that turned a 16-bit
    value into a 32-bit one, by path, its reason filled in)."""

    flows: dict[tuple[int, ...], tuple[Flow, ...]]
    promotions: dict[tuple[int, ...], Promotion]


def label(
    closed: boundary.ClosedJaxpr,
    leaf_flows: Sequence[Flow],
    const_flows: Sequence[Flow],
    prims: Sequence[str],
) -> Labels:
    """The dataflow of the traced program ``closed`` whose inputs have ``leaf_flows`` and
    whose captured constants ``const_flows`` (:class:`Labels`); paths as the interpreter gives
    them (``Site.path``)."""
    lab = _Labeller(frozenset(prims))
    lab.run(closed.jaxpr, list(const_flows), list(leaf_flows), ())
    explicit = (
        "an explicit cast, not an operation mixing dtypes: the code computes in a fixed "
        "32-bit dtype here (a Flax NNX module's `dtype`, fixed at construction when left "
        "None: nnx.Embed takes its parameter's float32; pass dtype=...)"
    )
    proms = {
        p: dataclasses.replace(pr, reason=lab.why.get(p, explicit))
        for p, pr in lab.promotions.items()
    }
    return Labels(lab.seen, proms)
