"""The one place precisionlab reads JAX's internals (jaxprs, primitives and their parameters).

Everything else (the interpreter in :mod:`precisionlab.intercept`, emulate, recipes, telemetry,
diagnose, train) goes through these functions, so a JAX release that renames a primitive or a
parameter is met here, once.

What it owns:

- the supported versions (:data:`LOWEST`, :data:`HIGHEST_CHECKED`) and :func:`check_version`;
- the primitive vocabulary: the names of the primitives other modules reason about, as
  constants and groups (:data:`DOT_GENERAL`, :data:`PRODUCTS`, :data:`ARITHMETIC`,
  :data:`TRANSCENDENTAL`, :data:`VIEWS`, :data:`EXACT`, the kinds :data:`SCAN`,
  :data:`WHILE`, ...): no other module spells a primitive's name;
- primitive identities: :func:`kind` maps a primitive to one of :data:`KINDS` by the object
  JAX exports (``jax.extend.core.primitives``, ``jax.lax``); a name is used only for the
  primitives a JAX version does not export (``pjit`` before 0.7, ``core_call``);
- parameter keys: :func:`scan_split` (``ft_in`` since jax 0.11, ``num_consts``/``num_carry``
  before), :func:`while_parts`, :func:`cond_branches`, :func:`checkpoint_parts`,
  :func:`call_program`, :func:`call_name`, :func:`loop_length`;
- sub-programs by type: :func:`subprograms` (every ClosedJaxpr/Jaxpr valued parameter, tuples
  of them included) and :func:`rebind` (the primitive bound again with those replaced);
- the bind-parameter protocol (:func:`bind`: ``get_bind_params`` returns the parameters since
  jax 0.9.2, a ``(subfuns, params)`` tuple before);
- source information (:func:`where`, :func:`source_context`, :func:`name_stack`): optional,
  guarded (a JAX without ``source_info_util`` loses line numbers, nothing else);
- tracing: :func:`trace` (a function with array leaves abstract, other leaves static);
- the program types, named for annotations (:data:`Jaxpr`, :data:`Program`, :data:`Eqn`,
  :data:`Var`, :data:`Atom`, ...) and :func:`environment`, an interpreter's starting state.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias, TypeVar, cast

import jax
import jax.extend as jex
import numpy as np

__all__ = [
    "ADD",
    "ARITHMETIC",
    "CALL",
    "CALLS",
    "CHECKPOINT",
    "COND",
    "CONDITIONAL",
    "CONV",
    "CONVERT",
    "CUSTOM_JVP",
    "CUSTOM_VJP",
    "DIV",
    "DOT_GENERAL",
    "ERF",
    "EXACT",
    "EXP",
    "EXPONENTIALS",
    "HIGHEST_CHECKED",
    "INTEGER_POW",
    "JIT",
    "KINDS",
    "LOGARITHMS",
    "LOGISTIC",
    "LOOPS",
    "LOWEST",
    "MUL",
    "POWERS",
    "PRODUCTS",
    "RAGGED_PRODUCTS",
    "REDUCE_SUM",
    "ROOTS",
    "SCAN",
    "SUB",
    "TANH",
    "TRANSCENDENTAL",
    "VIEWS",
    "WHILE",
    "ArrayAval",
    "Atom",
    "ClosedJaxpr",
    "Eqn",
    "Jaxpr",
    "Literal",
    "Path",
    "Primitive",
    "Program",
    "ScanSplit",
    "UnsupportedPrimitive",
    "Var",
    "WhileParts",
    "aval",
    "bind",
    "call_name",
    "call_program",
    "check_version",
    "checkpoint_parts",
    "cond_branches",
    "environment",
    "eval_shape",
    "is_combiner",
    "is_literal",
    "kind",
    "loop_length",
    "match_varying",
    "name_stack",
    "open_jaxpr",
    "primitive_names",
    "product_flops",
    "pvary",
    "rebind",
    "retrace",
    "scan_split",
    "source_context",
    "split_leaves",
    "subprograms",
    "trace",
    "tree_varying_axes",
    "unsupported",
    "varying_axes",
    "where",
    "while_body_index",
    "while_cond_index",
    "while_parts",
]

#: The lowest JAX this project works on (CI runs the interception, recipes, emulate and
#: telemetry tests on it) and the highest it has been checked against (the whole default suite
#: ran on 0.10.2; the recorded parameters of jax 0.11.2 are replayed by the tests).
LOWEST = "0.6.2"
HIGHEST_CHECKED = "0.11.2"

# --- the program types ----------------------------------------------------------------------
# JAX's own classes (``jax.extend.core`` exports them from the lowest JAX on), named here so
# that the interpreter's annotations say what they walk without importing JAX's internals.

#: An open program: ``constvars``, ``invars``, ``eqns``, ``outvars``.
Jaxpr: TypeAlias = jex.core.Jaxpr
#: A program with its constants' values (``.jaxpr``, ``.consts``).
ClosedJaxpr: TypeAlias = jex.core.ClosedJaxpr
#: A sub-program as an equation's parameters hold it (:func:`subprograms`).
Program: TypeAlias = jex.core.ClosedJaxpr | jex.core.Jaxpr
#: One equation: ``primitive``, ``params``, ``invars``, ``outvars``, ``source_info``.
Eqn: TypeAlias = jex.core.JaxprEqn
#: A primitive (``.name``, ``.bind``).
Primitive: TypeAlias = jex.core.Primitive
#: A variable of a program (``.aval``) and a literal operand (``.val``, ``.aval``).
Var: TypeAlias = jex.core.Var
Literal: TypeAlias = jex.core.Literal
#: An equation's operand: a variable or a literal.
Atom: TypeAlias = jex.core.Var | jex.core.Literal
#: Where an equation sits: its index in each enclosing program, then the sub-program's position
#: among :func:`subprograms`, alternately (``Site.path``).
Path: TypeAlias = tuple[int, ...]

_T = TypeVar("_T")


def environment(jaxpr: Jaxpr, consts: Sequence[_T], args: Sequence[_T]) -> dict[Var, _T]:
    """The start of a walk over ``jaxpr``: its constants bound to ``consts`` and its inputs
    to ``args`` (one value each, whatever an interpreter tracks: arrays, dataflow labels)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    return env


class ArrayAval(Protocol):
    """What is read of an array value's abstract value (a ``ShapedArray``, a reference's)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...


def aval(v: Atom) -> ArrayAval:
    """The abstract value of an array operand or result of an equation (its shape and dtype);
    TypeError for one that has none (a token)."""
    a = v.aval
    if not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{v} is no array: its abstract value {a} has no shape and dtype")
    return cast(ArrayAval, a)


# --- the primitive vocabulary ----------------------------------------------------------------
# The names of the primitives the rest of the package reasons about, as data: other modules
# ask "is this a matmul, a loop, an exact operation" through these constants and groups and
# never spell a primitive's name (tests/test_jax_boundary.py checks it). A primitive JAX
# renames is renamed here, once.

#: The kinds of higher-order primitive the interpreter understands (:func:`kind`); a
#: construct appears under its kind in :attr:`precisionlab.intercept.Site.within`.
JIT, CALL, CUSTOM_JVP, CUSTOM_VJP = "jit", "call", "custom_jvp", "custom_vjp"
CHECKPOINT, SCAN, WHILE, COND = "checkpoint", "scan", "while", "cond"
KINDS = (JIT, CALL, CUSTOM_JVP, CUSTOM_VJP, CHECKPOINT, SCAN, WHILE, COND)
#: Kinds that are calls: their program runs once, inlined (no loop, no branch).
CALLS = frozenset({JIT, CALL, CUSTOM_JVP, CUSTOM_VJP})
#: Loop kinds: their operations run once per iteration.
LOOPS = (SCAN, WHILE)
#: Kinds under which an operation may not run on a given call (a branch not taken, a while
#: loop run zero times).
CONDITIONAL = frozenset({COND, WHILE})

#: The matmul-like primitives: a matrix product and a convolution (an implicit GEMM).
DOT_GENERAL, CONV = "dot_general", "conv_general_dilated"
PRODUCTS = (DOT_GENERAL, CONV)
#: Matmul-like primitives with no rule in recipes or telemetry (listed and warned about);
#: ``ragged_dot`` is an older JAX's name.
RAGGED_PRODUCTS = ("ragged_dot_general", "ragged_dot")

#: Elementwise arithmetic (two operands).
ADD, SUB, MUL, DIV = "add", "sub", "mul", "div"
ARITHMETIC = (ADD, SUB, MUL, DIV)
#: A sum over axes, a cast, the logistic sigmoid and tanh, error function: named singly
#: because a rule treats them specially.
REDUCE_SUM, CONVERT, LOGISTIC, TANH, ERF = (
    "reduce_sum", "convert_element_type", "logistic", "tanh", "erf",
)  # fmt: skip
#: Powers (``integer_pow`` is ``x ** n`` for a static integer ``n``), roots, exponentials
#: and logarithms.
INTEGER_POW, EXP = "integer_pow", "exp"
POWERS = (INTEGER_POW, "pow", "square")
ROOTS = ("sqrt", "rsqrt")
EXPONENTIALS = (EXP, "exp2", "expm1")
LOGARITHMS = ("log", "log1p")


def _elementwise(f: Callable[[float], float]) -> Callable[[np.ndarray], np.ndarray]:
    """A scalar ``math`` function over a float64 array (NaN where it is undefined)."""

    def g(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for i, v in enumerate(x.tolist()):
            try:
                out[i] = f(v)
            except (ValueError, OverflowError):
                out[i] = np.nan
        return out

    return g


#: The unary transcendental primitives and the real function each computes, in float64
#: (numpy, ``math``): the definition a correctly rounded emulation rounds.
TRANSCENDENTAL: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    EXP: np.exp,
    "exp2": np.exp2,
    "expm1": np.expm1,
    "log": np.log,
    "log1p": np.log1p,
    TANH: np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "cbrt": np.cbrt,
    ERF: _elementwise(math.erf),
    "erfc": _elementwise(math.erfc),
    "lgamma": _elementwise(math.lgamma),
}

#: Primitives whose output is a rearranged, re-typed or re-placed copy of their first operand
#: (its other operands, indices or padding values, are no data). ``copy_p`` and
#: ``mesh_cast`` are names other JAX versions use.
VIEWS = frozenset(
    {CONVERT, "reshape", "transpose", "broadcast_in_dim", "squeeze", "copy",
     "copy_p", "slice", "dynamic_slice", "gather", "rev", "pad", "reduce_precision",
     "device_put", "sharding_constraint", "mesh_cast", "reshard", "pvary",
     "optimization_barrier"}
)  # fmt: skip
#: Primitives whose result is exactly representable when their operands are: they move,
#: select or compare values, or change only the sign (their results need no rounding). A
#: cast is not among them: it is exact only when it widens.
EXACT = frozenset(
    {"reshape", "broadcast_in_dim", "transpose", "squeeze", "slice",
     "dynamic_slice", "dynamic_update_slice", "gather", "concatenate", "pad", "rev", "select_n",
     "copy", "copy_p", "device_put", "max", "min", "neg", "abs", "sign", "reduce_max",
     "reduce_min", "cummax", "cummin", "sort", "clamp", "floor", "ceil", "round", "split"}
)  # fmt: skip


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", text)[:3])


_checked: dict[str, bool] = {}


def check_version(version: str | None = None) -> None:
    """RuntimeError, one line, when ``version`` (default: the installed jax) is older than
    :data:`LOWEST`. Checked once per version."""
    version = jax.__version__ if version is None else version
    if version in _checked:
        return
    if _version_tuple(version) < _version_tuple(LOWEST):
        raise RuntimeError(
            f"precisionlab supports jax >= {LOWEST} (checked up to {HIGHEST_CHECKED}); "
            f"this is jax {version}: pip install -U 'jax>={LOWEST}' 'jaxlib>={LOWEST}'"
        )
    _checked[version] = True


# --- primitive identities ------------------------------------------------------------------
_EXPORTERS = (jex.core.primitives, jax.lax)


def _exported(attrs: Sequence[str]) -> tuple[Any, ...]:
    out: list[Any] = []
    for module in _EXPORTERS:
        for a in attrs:
            p = getattr(module, a, None)
            if isinstance(p, jex.core.Primitive) and p not in out:
                out.append(p)
    return tuple(out)


class _Identity:
    """Primitives by object where JAX exports them; a fallback name matches only when no
    exported primitive carries that name (a primitive this JAX version does not export)."""

    def __init__(self, attrs: Sequence[str], names: Sequence[str]):
        self.objects = _exported(attrs)
        exported_names = {p.name for p in self.objects}
        self.names = frozenset(n for n in names if n not in exported_names)

    def __contains__(self, prim: Any) -> bool:
        return any(prim is p for p in self.objects) or getattr(prim, "name", None) in self.names


_IDENTITIES: dict[str, _Identity] = {
    JIT: _Identity(("jit_p", "pjit_p"), ("jit", "pjit")),
    # closed_call is named eval_jaxpr at JAX's head (the same object)
    CALL: _Identity(
        ("closed_call_p", "call_p", "eval_jaxpr_p", "core_call_p"),
        ("closed_call", "core_call", "call", "eval_jaxpr"),
    ),
    CUSTOM_JVP: _Identity(("custom_jvp_call_p",), ("custom_jvp_call",)),
    CUSTOM_VJP: _Identity(
        ("custom_vjp_call_p", "custom_vjp_call_jaxpr_p"),
        ("custom_vjp_call", "custom_vjp_call_jaxpr"),
    ),
    CHECKPOINT: _Identity(("remat_p", "checkpoint_p"), ("remat2", "checkpoint")),
    SCAN: _Identity(("scan_p",), ("scan",)),
    WHILE: _Identity(("while_p",), ("while",)),
    COND: _Identity(("cond_p",), ("cond",)),
}

# First-order primitives whose parameters hold a small combiner program (a reduction's or a
# scatter's update computation): operations in their own right, never entered.
_COMBINER_NAMES = (
    "reduce", "reduce_window", "select_and_scatter", "select_and_scatter_add",
    "select_and_gather_add", "scatter", "scatter_add", "scatter_sub", "scatter_mul",
    "scatter_min", "scatter_max", "scatter_apply",
)  # fmt: skip
_COMBINERS = _Identity(tuple(f"{n}_p" for n in _COMBINER_NAMES), _COMBINER_NAMES)


def primitive_names() -> frozenset[str]:
    """The names of every primitive of this JAX: those it exports (``jax.extend.core.
    primitives``, ``jax.lax``) and every ``Primitive`` object at module level in its loaded
    modules (``ragged_dot_general``, ``one_minus_square`` are not exported): what an option
    naming primitives may name."""
    names = {p.name for p in _exported([a for m in _EXPORTERS for a in dir(m) if a.endswith("_p")])}
    for ident in _IDENTITIES.values():
        names |= ident.names | {p.name for p in ident.objects}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "jax" or mod_name.startswith(("jax.", "jaxlib."))):
            continue
        for v in list(getattr(mod, "__dict__", {}).values()):
            if isinstance(v, jex.core.Primitive):
                names.add(v.name)
    return frozenset(names)


def kind(prim: Any) -> str | None:
    """The kind of a higher-order primitive the interpreter understands (one of
    :data:`KINDS`), or None (first-order, or a higher-order primitive it does not know)."""
    for k, ident in _IDENTITIES.items():
        if prim in ident:
            return k
    return None


def is_combiner(eqn: Any) -> bool:
    """Whether ``eqn`` is a first-order primitive whose parameters hold a combiner program
    (``reduce``, ``scatter_add``, ...): not a construct to enter."""
    return eqn.primitive in _COMBINERS


# --- sub-programs by type ------------------------------------------------------------------
def _is_jaxpr(x: Any) -> bool:
    return isinstance(x, (jex.core.ClosedJaxpr, jex.core.Jaxpr))


def _program_params(params: dict[str, Any]) -> Iterator[tuple[str, int | None, Program]]:
    """(key, position in a tuple or None, program) for every jaxpr-valued parameter, keys in
    sorted order (stable whatever order JAX built the dict in)."""
    for key in sorted(params):
        v = params[key]
        if _is_jaxpr(v):
            yield key, None, v
        elif isinstance(v, (tuple, list)):
            for j, x in enumerate(v):
                if _is_jaxpr(x):
                    yield key, j, x


def subprograms(eqn: Eqn) -> list[Program]:
    """Every sub-program (ClosedJaxpr or Jaxpr) in ``eqn``'s parameters, found by type; empty
    for a combiner (:func:`is_combiner`). Position ``k`` in this list is the sub-program's index
    in :attr:`precisionlab.intercept.Site.path`."""
    if is_combiner(eqn):
        return []
    return [p for _, _, p in _program_params(eqn.params)]


def rebind(
    eqn: Eqn, args: Sequence[Any], transform: Callable[[Program, int], Program]
) -> list[Any]:
    """``eqn``'s primitive bound on ``args`` with its own parameters, each sub-program ``p``
    (the ``k``-th of :func:`subprograms`) replaced by ``transform(p, k)``: a rewrite that needs
    no knowledge of what the primitive means."""
    params = dict(eqn.params)
    for k, (key, j, prog) in enumerate(list(_program_params(eqn.params))):
        new = transform(prog, k)
        if j is None:
            params[key] = new
        else:
            orig = eqn.params[key]
            seq = list(params[key])
            seq[j] = new
            params[key] = orig._make(seq) if hasattr(orig, "_make") else type(orig)(seq)
    return bind(eqn.primitive, params, *args)


def open_jaxpr(j: Program) -> tuple[Jaxpr, Sequence[Any]]:
    """(open jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    if isinstance(j, jex.core.ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


def retrace(fn: Callable[..., Any], like: Program) -> Program | None:
    """``fn`` traced on the input types of the program ``like``, as a program of ``like``'s
    type (ClosedJaxpr or open Jaxpr); None when an open Jaxpr is asked for and the trace
    captured constants (an open Jaxpr cannot hold them)."""
    jaxpr, _ = open_jaxpr(like)
    specs = [_spec(v.aval) for v in jaxpr.invars]
    closed = jax.make_jaxpr(fn)(*specs)
    if isinstance(like, jex.core.ClosedJaxpr):
        return closed
    if closed.consts:
        return None
    return closed.jaxpr


def is_literal(v: Any) -> bool:
    """Whether a jaxpr operand is a literal (read its ``.val``) rather than a variable."""
    return isinstance(v, jex.core.Literal)


def jaxpr_as_fun(jaxpr: Jaxpr, consts: Sequence[Any]) -> Callable[..., list[Any]]:
    """The open ``jaxpr`` with ``consts`` as a function of its inputs (outputs: a list)."""
    return jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(jaxpr, list(consts)))


# --- the bind-parameter protocol -----------------------------------------------------------
def bind(prim: Any, params: dict, *args: Any) -> list:
    """``prim`` applied to ``args`` with the parameters an equation records, as a list of
    outputs. ``get_bind_params`` returns the parameters (jax >= 0.9.2) or a
    ``(subfuns, params)`` tuple (earlier: the sub-functions go before the operands)."""
    got = prim.get_bind_params(params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        subfuns, bind_params = got
        out = prim.bind(*subfuns, *args, **bind_params)
    else:
        out = prim.bind(*args, **got)
    return list(out) if prim.multiple_results else [out]


# --- parameter keys of the higher-order primitives -----------------------------------------
def _leaf_count(tree: Any) -> int:
    """Leaves of one group of scan's ``ft_in``: a FlatTree (``len``), or its recorded form,
    nested tuples whose leaves are the entries (``(None, None)``)."""
    if isinstance(tree, (tuple, list)):
        return sum(_leaf_count(t) for t in tree)
    if hasattr(tree, "unpack") and hasattr(tree, "__len__"):
        return len(tree)
    return 1


class ScanSplit(NamedTuple):
    """How a ``scan`` equation's operands split (consts, carry, xs) and how it runs."""

    n_consts: int
    n_carry: int
    length: int
    reverse: bool
    unroll: Any
    jaxpr: ClosedJaxpr  # the body: consts, carry, x in; carry, y out


def scan_split(params: dict) -> ScanSplit:
    """Read a ``scan`` equation's parameters: ``ft_in`` (jax >= 0.11: a flat tree of
    (consts, carry, xs) groups) when present, else ``num_consts``/``num_carry``."""
    if "ft_in" in params:
        ft = params["ft_in"]
        groups = ft.unpack() if hasattr(ft, "unpack") else tuple(ft)
        if len(groups) != 3:
            raise NotImplementedError(
                f"scan's ft_in has {len(groups)} groups, expected 3 (consts, carry, xs) "
                f"(jax {jax.__version__})"
            )
        n_consts, n_carry = _leaf_count(groups[0]), _leaf_count(groups[1])
    else:
        n_consts, n_carry = params["num_consts"], params["num_carry"]
    return ScanSplit(
        int(n_consts), int(n_carry), int(params["length"]), bool(params["reverse"]),
        params.get("unroll", 1), params["jaxpr"],
    )  # fmt: skip


class WhileParts(NamedTuple):
    """A ``while`` equation: operands are cond consts, body consts, then the carry."""

    cond_nconsts: int
    body_nconsts: int
    cond_jaxpr: ClosedJaxpr
    body_jaxpr: ClosedJaxpr


def while_parts(params: dict) -> WhileParts:
    """Read a ``while`` equation's parameters."""
    return WhileParts(
        int(params["cond_nconsts"]), int(params["body_nconsts"]),
        params["cond_jaxpr"], params["body_jaxpr"],
    )  # fmt: skip


def while_body_index(params: dict) -> int:
    """The body's position among :func:`subprograms` of a ``while`` equation."""
    keys = [key for key, _, _ in _program_params(params)]
    return keys.index("body_jaxpr")


def while_cond_index(params: dict) -> int:
    """The condition's position among :func:`subprograms` of a ``while`` equation."""
    keys = [key for key, _, _ in _program_params(params)]
    return keys.index("cond_jaxpr")


def cond_branches(params: dict[str, Any]) -> tuple[ClosedJaxpr, ...]:
    """A ``cond`` equation's branches (operand 0 is the branch index, the rest the branches'
    operands); positions among :func:`subprograms` are the branch numbers."""
    return tuple(params["branches"])


def checkpoint_parts(params: dict[str, Any]) -> tuple[Program, bool, Any]:
    """(program, prevent_cse, policy) of a ``checkpoint``/``remat`` equation."""
    return params["jaxpr"], bool(params.get("prevent_cse", True)), params.get("policy")


def call_program(eqn: Eqn) -> Program:
    """The program a call (jit, closed_call, custom_jvp/vjp) runs on all its operands: its one
    jaxpr-valued parameter (``jaxpr``, ``call_jaxpr`` or ``fun_jaxpr`` across versions)."""
    progs = [p for _, _, p in _program_params(eqn.params)]
    if len(progs) != 1:
        raise NotImplementedError(
            f"{eqn.primitive.name} has {len(progs)} programs in its parameters, expected one "
            f"(jax {jax.__version__})"
        )
    return progs[0]


def call_name(eqn: Any) -> str:
    """The function name a ``jit`` equation records ("" for other primitives)."""
    if kind(eqn.primitive) != JIT:
        return ""
    return str(eqn.params.get("name") or "")


def loop_length(eqn: Any) -> int | None:
    """The iteration count of a ``scan`` (None for a ``while``)."""
    return int(eqn.params["length"]) if kind(eqn.primitive) == SCAN else None


def product_flops(eqn: Any) -> int:
    """2 x the multiply-adds of a ``dot_general`` or ``conv_general_dilated`` equation (its
    parameters read here); 0 for any other equation."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval.shape if eqn.outvars else ()
    size = 1
    for d in out:
        size *= int(d)
    if name == DOT_GENERAL:
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        k = 1
        for d in lc:
            k *= int(lhs[d])
        return 2 * size * k
    if name == CONV:
        rhs = eqn.invars[1].aval.shape
        spec = getattr(eqn.params.get("dimension_numbers"), "rhs_spec", None)
        spec = tuple(range(len(rhs))) if spec is None else tuple(spec)
        k = int(rhs[spec[1]])
        for d in spec[2:]:
            k *= int(rhs[d])
        return 2 * size * k
    return 0


# --- errors --------------------------------------------------------------------------------
class UnsupportedPrimitive(NotImplementedError):
    """A selected operation sits inside a higher-order primitive the interpreter does not know."""


def unsupported(
    sites: Sequence[str] | str, eqn_or_name: Any, what: str = "replaced"
) -> UnsupportedPrimitive:
    """The error for selected operations inside an unknown higher-order primitive.

    ``sites``: the operations' names (``["dot_general[0]", "dot_general[1]"]``: the message
    suggests ``exclude=[...]`` with them, valid Python to pass as it is), or a description
    (a string: no suggestion)."""
    name = getattr(getattr(eqn_or_name, "primitive", None), "name", None) or str(eqn_or_name)
    if isinstance(sites, str):
        label, advice = sites, ""
    else:
        names = [str(s) for s in sites]
        label, advice = ", ".join(names), f"exclude it (exclude={names!r}), "
    return UnsupportedPrimitive(
        f"{label} sits inside {name!r}, a higher-order primitive precisionlab does not know "
        f"(jax {jax.__version__}; known: {', '.join(KINDS)}), so it would not be {what}: "
        f"{advice}move it out of {name}, or report the primitive"
    )


# --- source information (optional) --------------------------------------------------------
try:  # private to JAX: used for line numbers and scope names only, so guarded
    from jax._src import source_info_util as _siu
except Exception:  # pragma: no cover - a JAX without it loses source lines only
    _siu = None  # type: ignore[assignment]


def name_stack(eqn: Any) -> str:
    """The ``jax.named_scope`` names an equation was traced under ("" if unknown)."""
    try:
        return str(eqn.source_info.name_stack)
    except Exception:
        return ""


def where(eqn: Any) -> str:
    """The user's source line of an equation (``"model.py:42 (fn)"``), or ""."""
    try:
        try:  # jax >= 0.7 takes the traceback, earlier versions the source info
            fr = _siu.user_frame(eqn.source_info.traceback)
        except AttributeError:
            fr = _siu.user_frame(eqn.source_info)
        if fr is None:
            return ""
        return f"{fr.file_name.rsplit('/', 1)[-1]}:{fr.start_line} ({fr.function_name})"
    except Exception:
        return ""


def source_context(eqn: Any) -> contextlib.AbstractContextManager:
    """A context re-emitting operations under ``eqn``'s name stack and source line (as
    ``jax.core.eval_jaxpr`` does); a no-op where JAX lacks the means."""
    try:
        stack = _siu.current_name_stack() + eqn.source_info.name_stack
        return _siu.user_context(eqn.source_info.traceback, name_stack=stack)
    except Exception:
        return contextlib.nullcontext()


# --- varying manual axes (shard_map) ---------------------------------------------------------
def _varying(aval: Any) -> frozenset:
    # jax < 0.8 (from 0.6.1): ``aval.vma``; later: ``aval.manual_axis_type.varying``
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return frozenset(vma or ())


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes ``x`` varies over inside ``shard_map`` with ``check_vma=True``
    (empty outside ``shard_map``, for a non-array and under ``check_vma=False``)."""
    if isinstance(x, (jax.ShapeDtypeStruct, jax.core.ShapedArray)):
        return _varying(x)
    if not is_array(x):
        return frozenset()
    try:
        return _varying(jax.typeof(x))
    except TypeError:
        return frozenset()


def pvary(x: Any, axes: Any) -> Any:
    """``x`` marked as varying over the manual ``axes`` too (``lax.pcast(..., to="varying")``,
    ``lax.pvary`` before it existed); axes it already varies over are left as they are, and
    with nothing to add ``x`` is returned itself. Its transpose is a ``psum``: a gradient
    flowing back into an invariant value is summed over the axes."""
    missing = tuple(sorted(frozenset(axes) - varying_axes(x), key=str))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # type: ignore[attr-defined]  # JAX before pcast


def eval_shape(fn: Callable, *args: Any) -> Any:
    """``jax.eval_shape(fn, *args)`` whose leaves keep the manual axes they vary over inside
    ``shard_map`` (:func:`varying_axes` reads them; jax < 0.7's ``eval_shape`` drops them):
    the traced program's output avals."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    return jax.tree.unflatten(jax.tree_util.tree_structure(shape), list(closed.out_avals))


def tree_varying_axes(tree: Any) -> frozenset:
    """The union of :func:`varying_axes` over the array leaves of ``tree``."""
    out: frozenset = frozenset()
    for leaf in jax.tree_util.tree_leaves(tree):
        out |= varying_axes(leaf)
    return out


def match_varying(tree: Any, axes: Any = None) -> Any:
    """Every array leaf of ``tree`` varying over ``axes`` (default: the union over its
    leaves), so the values can meet in one primitive or a ``custom_vjp`` whose backward rule
    returns cotangents as varying as the data (``check_vma=True``); other leaves as they are.
    Outside ``shard_map`` the tree itself."""
    axes = tree_varying_axes(tree) if axes is None else frozenset(axes)
    if not axes:
        return tree
    return jax.tree_util.tree_map(lambda x: pvary(x, axes) if is_array(x) else x, tree)


# --- tracing -------------------------------------------------------------------------------
def is_array(x: Any) -> bool:
    """Whether a pytree leaf is traced (an array or ShapeDtypeStruct) rather than static."""
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return True
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


_R = TypeVar("_R")


def split_leaves(
    fn: Callable[..., _R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: Callable[[Any], bool] = is_array,
) -> tuple[Callable[..., _R], list[Any]]:
    """``(flat, values)``: ``flat(*values)`` is ``fn(*args, **kwargs)``, where ``values`` are
    the leaves of the arguments for which ``dynamic`` holds (flattening order) and every other
    leaf is closed over as a constant: what tracing or jitting a function whose arguments
    hold more than arrays (static numbers, an Equinox module's functions) needs."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dyn = [i for i, x in enumerate(leaves) if dynamic(x)]

    def flat(*values: Any) -> _R:
        full = list(leaves)
        for i, v in zip(dyn, values, strict=True):
            full[i] = v
        a, kw = jax.tree.unflatten(treedef, full)
        return fn(*a, **kw)

    return flat, [leaves[i] for i in dyn]


def _spec(aval: Any) -> Any:
    if _varying(aval):
        # inside shard_map: the aval itself, so the program is traced with the manual axes
        # the value varies over (JAX then inserts the pvary a mixed operation needs)
        return aval
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def abstract(x: Any) -> Any:
    """The shape, dtype and weak type of an array (a ShapeDtypeStruct as it is); inside
    ``shard_map`` a value varying over manual axes keeps them (its aval is returned)."""
    return _spec(x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x))


def trace(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[ClosedJaxpr, Any, list[Any]]:
    """``(closed jaxpr, output shapes, traced leaves)`` of ``fn(*args, **kwargs)``: the array
    leaves of the arguments are traced (abstractly: the caller's tracers never enter the trace),
    the other leaves are static (closed over), as ``jax.jit`` with static arguments."""
    check_version()
    flat, values = split_leaves(fn, args, kwargs)
    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*[abstract(v) for v in values])
    return closed, out_shape, values
