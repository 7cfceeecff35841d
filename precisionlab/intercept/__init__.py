"""Interception: run any JAX function with chosen primitives replaced.

:func:`intercept` traces a function once (``jax.make_jaxpr``) and re-evaluates it equation
by equation, calling a :class:`Rule` for every matched primitive (``dot_general`` for the
low-precision matmul recipes), recursing into ``jit``, custom-derivative functions, ``scan``,
``while_loop``, ``cond`` and ``checkpoint``. Each match is a :class:`Site` with a stable
name (``"dot_general[3]"``), its scope (``jax.named_scope`` and ``jit`` names) and source
line; ``include``/``exclude`` pick which are replaced, by position, name, scope, or the
parameter each operand is (its input leaf's pytree path, traced through the dataflow: see
``Site.operands``, ``Site.roles``), as globs or regular expressions. The result
composes with ``jit``, ``grad`` and ``vmap``. A rule may also return auxiliary values
(:class:`Emit`), which :meth:`Intercepted.call_with_aux` threads out of loops (stacked per
iteration), conds and checkpoints as :class:`Aux`; :class:`PerIteration` state is sliced per
loop iteration.

:mod:`precisionlab.intercept._boundary` is the one module that reads JAX's internals (primitive
identities, parameter keys, the bind protocol, source information); a selected operation inside
a higher-order primitive it does not know raises
:class:`UnsupportedPrimitive`.
"""

from precisionlab.intercept._boundary import UnsupportedPrimitive
from precisionlab.intercept._dataflow import Promotion
from precisionlab.intercept._dtypes import compute_line, flops_by_dtype
from precisionlab.intercept._interpret import (
    Aux,
    Context,
    Emit,
    Intercepted,
    PerIteration,
    Rule,
    SkippedOperationWarning,
    intercept,
)
from precisionlab.intercept._sites import Site, numbered, select

__all__ = [
    "Aux",
    "Context",
    "Emit",
    "Intercepted",
    "PerIteration",
    "Promotion",
    "Rule",
    "Site",
    "SkippedOperationWarning",
    "UnsupportedPrimitive",
    "compute_line",
    "flops_by_dtype",
    "intercept",
    "numbered",
    "select",
]
