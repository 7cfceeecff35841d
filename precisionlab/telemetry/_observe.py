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

Sites inside ``scan``/``while`` bodies, ``cond`` branches and ``checkpoint`` regions are not
observed yet (their values live in a nested trace); :meth:`Observed.skipped` lists them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from precisionlab.intercept import Context, Site, intercept
from precisionlab.intercept._interpret import _CALLS, _open, _subjaxprs
from precisionlab.telemetry._stats import TensorStats, tensor_stats
from precisionlab.telemetry._targets import parse_targets

__all__ = ["Observed", "every", "observe", "tree_stats"]


def _contraction_last(x: jax.Array, contract, batch) -> jax.Array:
    """(rows, K): batch and free axes flattened into rows, the contraction axes into K."""
    free = [d for d in range(x.ndim) if d not in contract and d not in batch]
    k = math.prod(x.shape[d] for d in contract)
    return jnp.transpose(x, (*batch, *free, *contract)).reshape(-1, k)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


class _StatsRule:
    primitives = ("dot_general",)

    def __init__(self, targets, record: frozenset, sink: dict, stat=tensor_stats):
        self.targets, self.record, self.sink, self.stat = targets, record, sink, stat

    def apply(self, ctx: Context, lhs, rhs, *, dimension_numbers, **params) -> list:
        out = ctx.original(lhs, rhs)[0]
        name = ctx.site.name
        if name in self.record and _is_float(lhs) and _is_float(rhs) and _is_float(out):
            (lc, rc), (lb, rb) = dimension_numbers
            self.sink[name] = {
                "lhs": self.stat(_contraction_last(lhs, lc, lb), self.targets),
                "rhs": self.stat(_contraction_last(rhs, rc, rb), self.targets),
                "out": self.stat(out, self.targets),
            }
            if ctx.state is not None:
                out = out + ctx.state.astype(out.dtype)
        return [out]


def _inlined(closed, site: Site) -> bool:
    """Whether the site sits at the top level or only inside calls the interpreter inlines
    (jit, custom_jvp/vjp), i.e. its values live in the caller's trace."""
    jaxpr, path = closed.jaxpr, site.path
    for j in range(0, len(path) - 1, 2):
        eqn = jaxpr.eqns[path[j]]
        if eqn.primitive.name not in _CALLS:
            return False
        jaxpr = _open(_subjaxprs(eqn)[path[j + 1]])[0]
    return True


class Observed:
    """``fn`` with its matmuls observed; see :func:`observe`."""

    def __init__(self, fn, targets, include, exclude):
        self.fn, self.targets = fn, parse_targets(targets)
        self.include, self.exclude = include, exclude
        self.__wrapped__ = fn

    def _intercepted(self, record=frozenset(), sink=None, stat=tensor_stats):
        rule = _StatsRule(self.targets, record, {} if sink is None else sink, stat)
        return intercept(self.fn, rule, include=self.include, exclude=self.exclude)

    def _plan(self, args, kwargs) -> tuple[list[Site], list[Site]]:
        inter = self._intercepted()
        closed, _, _ = inter._trace(args, kwargs)
        sites = [s for s in inter._sites(closed) if s.selected]
        ok = [s for s in sites if _inlined(closed, s)]
        return ok, [s for s in sites if s not in ok]

    def sites(self, *args, **kwargs) -> list[Site]:
        """The observed matmuls (selected, outside loops, conds and checkpoints)."""
        return self._plan(args, kwargs)[0]

    def skipped(self, *args, **kwargs) -> list[Site]:
        """Selected matmuls not observed (inside scan/while/cond/checkpoint)."""
        return self._plan(args, kwargs)[1]

    def __call__(self, *args, **kwargs) -> tuple[Any, dict[str, dict[str, TensorStats]]]:
        """``(fn(*args, **kwargs), {site: {"lhs", "rhs", "out": TensorStats}})``."""
        ok, _ = self._plan(args, kwargs)
        sink: dict = {}
        out = self._intercepted(frozenset(s.name for s in ok), sink)(*args, **kwargs)
        return out, dict(sink)

    def value_and_grad(
        self, argnums: int | Sequence[int] = 0, has_aux: bool = False, *, tensors: bool = False
    ) -> Callable[..., tuple[Any, Any, dict]]:
        """``f(*args, **kwargs) -> (value, grads, stats)``: ``jax.value_and_grad(fn,
        argnums, has_aux)``'s value and gradients (unchanged) plus per-site statistics with
        ``"grad"``: the output cotangent's. ``tensors=True`` gives the tensors themselves
        (float, laid out as their statistics would be: operands ``(rows, K)``) instead of
        their statistics, for a caller that batches the statistics of many tensors."""
        nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
        stat = (lambda x, _: x) if tensors else tensor_stats

        def f(*args, **kwargs):
            ok, _ = self._plan(args, kwargs)
            probes = {s.name: jnp.full(s.out_shapes[0], -0.0, jnp.float32) for s in ok}

            def run(pr, *a):
                sink: dict = {}
                inter = self._intercepted(frozenset(pr), sink, stat)
                out = inter.call_with_state(pr, *a, **kwargs)
                if has_aux:
                    return out[0], (out[1], dict(sink))
                return out, (None, dict(sink))

            vg = jax.value_and_grad(run, argnums=(0, *(n + 1 for n in nums)), has_aux=True)
            (value, (aux, fwd)), grads = vg(probes, *args)
            stats = {k: dict(v) for k, v in fwd.items()}
            for name, ct in grads[0].items():
                if name in stats:
                    stats[name]["grad"] = stat(ct, self.targets)
            g = grads[1] if isinstance(argnums, int) else tuple(grads[1:])
            return ((value, aux) if has_aux else value), g, stats

        return f


def observe(
    fn: Callable,
    targets: Sequence[str] | str = (),
    *,
    include: Sequence[int | str] | int | str | None = None,
    exclude: Sequence[int | str] | int | str = (),
) -> Observed:
    """``fn`` with statistics of every matched ``dot_general`` (matmul, einsum, dense layer).

    Args:
      fn: any JAX function (a Flax ``apply``, a loss); traced by the interception layer.
      targets: static target names for the per-format counts (see :func:`tensor_stats`).
      include / exclude: which matmuls to observe, as in :func:`precisionlab.intercept.intercept`
        (positions, names ``"dot_general[3]"``, or glob patterns on the scope).

    Returns:
      An :class:`Observed`: ``obs(*args)`` gives ``(out, stats)``;
      ``obs.value_and_grad(argnums)(*args)`` gives ``(value, grads, stats)`` with the output
      cotangents' statistics too. ``stats`` maps site names to ``{"lhs", "rhs", "out"[,
      "grad"]}`` :class:`TensorStats`. Computations are unchanged (bit for bit).
    """
    return Observed(fn, targets, include, exclude)


def tree_stats(tree: Any, targets: Sequence[str] | str = ()) -> dict[str, TensorStats]:
    """Statistics of every float leaf of a pytree (params, grads, optimizer state), keyed by
    the leaf's path (``jax.tree_util.keystr``); integer leaves are left out."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {
        jax.tree_util.keystr(path): tensor_stats(leaf, targets)
        for path, leaf in leaves
        if _is_float(leaf)
    }


def every(n: int, step: jax.Array, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` when ``step % n == 0``, else zeros of the same structure, behind a
    ``lax.cond`` (only the taken branch runs). ``n`` is a static int >= 1; ``step`` an
    integer (traced or not)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"every: n must be an int >= 1, got {n!r}")
    shapes = jax.eval_shape(fn, *args)

    def skip(*_):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    return lax.cond(jnp.asarray(step) % n == 0, fn, skip, *args)
