"""Numerics telemetry in the train step: statistics of every matmul and every state leaf.

Every ``interval`` steps (behind a ``lax.cond``, so other steps do no telemetry work) the step
computes :func:`precisionlab.telemetry.tensor_stats` of

- every matmul's operands, output and output cotangent (``matmul`` rows), from an observed
  forward and backward pass of the loss the step differentiates (the scaled loss, on the
  compute-dtype params, micro-batch by micro-batch, each device on its shard), found through
  the interception layer (:func:`precisionlab.telemetry.observe`);
- every float leaf of the params (as stored), of the gradients the optimizer receives
  (unscaled float32, after the gradient dtype's rounding) and of the optimizer state (as
  stored): ``param``, ``grad`` and ``opt_state`` rows.

Statistics of micro-batches are combined with :func:`~precisionlab.telemetry.combine` and
those of data-parallel shards with :func:`~precisionlab.telemetry.reduce_over`, so they are
the statistics of the whole batch. The observed pass is a second forward and backward pass
(the step's own pass is left as it was, bit for bit): with a recipe it observes the
compute-dtype tensors the recipe would quantize, and the targets say what the recipe does to
them. Matmuls inside ``scan``/``while``/``cond``/``checkpoint`` (``remat = true``) are not
observed (see :meth:`precisionlab.telemetry.Observed.skipped`).

:func:`telemetry_rows` turns a step's statistics into JSON rows (one per layer and tensor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab._schema import INT32_MAX, Field, validate_table
from precisionlab.mixed.loss_scale import LossScale
from precisionlab.mixed.policy import Policy, cast_floating
from precisionlab.telemetry import (
    TensorStats,
    combine,
    derive,
    every,
    observe,
    parse_targets,
    reduce_over,
    stats_of_many,
    tensor_stats,
)

__all__ = [
    "DEFAULT_TARGETS",
    "TELEMETRY_FIELDS",
    "Telemetry",
    "auto_interval",
    "make_telemetry_fn",
    "parse_telemetry",
    "telemetry_rows",
]

#: Targets when the table names none: the two 16-bit formats (why bf16 survives where fp16
#: does not) and e4m3 with current scaling (the common fp8 recipe).
DEFAULT_TARGETS: tuple[str, ...] = ("fp16", "bf16", "e4m3:tensor")


def _targets(value: list[str]) -> list[str]:
    parse_targets(value)
    return value


#: The ``telemetry`` table of a ``[train]`` section.
TELEMETRY_FIELDS: dict[str, Field] = {
    "enabled": Field(bool, True, doc="compute telemetry"),
    "interval": Field(
        int, 0, low=0, high=INT32_MAX, why="the step counter is an int32",
        doc="every N steps; 0: auto (max(10, steps // 10))",
    ),
    "targets": Field(list, list(DEFAULT_TARGETS), item=str, check=_targets, doc="what-if targets"),
    "matmuls": Field(bool, True, doc="statistics of every matmul's operands, output, cotangent"),
    "state": Field(bool, True, doc="statistics of every param, gradient and optimizer-state leaf"),
}  # fmt: skip


def auto_interval(steps: int) -> int:
    """The default interval: every 10% of the steps, at most every 10 steps."""
    return max(10, steps // 10)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Telemetry:
    """What the step computes: every ``interval`` steps (the steps ``s`` with ``s % interval
    == 0``, counted from 0 before the step, i.e. recorded steps 1, interval + 1, ...), for
    ``targets`` (names, see :func:`precisionlab.telemetry.parse_targets`), the matmul
    statistics (``matmuls``) and the state leaves' (``state``)."""

    interval: int
    targets: tuple[str, ...] = DEFAULT_TARGETS
    matmuls: bool = True
    state: bool = True

    def __post_init__(self) -> None:
        n = self.interval
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"telemetry interval must be an int >= 1, got {n!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        parse_targets(self.targets)

    def due(self, step: int) -> bool:
        """Whether the step starting at ``step`` (0-based) computes telemetry."""
        return step % self.interval == 0


def parse_telemetry(table: dict[str, Any] | None, steps: int) -> Telemetry | None:
    """A :class:`Telemetry` from a ``telemetry`` table (None or ``enabled = false``: off)."""
    if table is None:
        return None
    values = validate_table(table, TELEMETRY_FIELDS, "telemetry")
    if not values["enabled"]:
        return None
    return Telemetry(
        interval=values["interval"] or auto_interval(steps),
        targets=tuple(values["targets"]),
        matmuls=values["matmuls"],
        state=values["state"],
    )


def _empty(stats: Any) -> Any:
    """The identity of :func:`combine` for statistics shaped like ``stats``."""

    def one(s: TensorStats) -> TensorStats:
        t = s.overflow.shape[-1]
        e = tensor_stats(jnp.zeros((0,), jnp.float32), ())
        pad = lambda v: jnp.zeros((t,), v.dtype)  # noqa: E731
        return e._replace(
            overflow=pad(e.overflow), saturate=pad(e.saturate), underflow=pad(e.underflow),
            subnormal=pad(e.subnormal), poisoned=pad(e.poisoned), noise_n=pad(e.noise_n),
        )  # fmt: skip

    return jax.tree.map(one, stats, is_leaf=lambda x: isinstance(x, TensorStats))


def _map_stats(fn: Callable, *trees: Any) -> Any:
    return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, TensorStats))


def make_telemetry_fn(
    loss_fn: Callable,
    policy: Policy,
    telemetry: Telemetry,
    *,
    microbatches: int = 1,
    mesh: Any = None,
) -> Callable[[Any, Any, LossScale, Any, Any], dict[str, Any]]:
    """``fn(params_stored, opt_state, loss_scale, grads32, batch, step) -> stats``, the
    step's telemetry: ``{"matmul": {site: {"lhs", "rhs", "out", "grad"}}, "param": {path:
    ...}, "grad": {...}, "opt_state": {...}}`` of :class:`TensorStats` (zeros on the steps
    ``telemetry.interval`` skips). ``loss_fn(params, batch) -> (loss, aux)`` as the step
    differentiates it (aux is ignored); ``mesh``: the data-parallel mesh (the batch is
    sharded over its axis) or None."""
    targets = telemetry.targets

    def scaled(p, b, ls):
        loss, _ = loss_fn(p, b)
        return ls.scale(loss)

    vg = observe(scaled, targets).value_and_grad(0, tensors=True)

    def one(pc, b, ls):
        tensors = vg(pc, b, ls)[2]
        flat = {(site, k): v for site, d in tensors.items() for k, v in d.items()}
        st = stats_of_many(flat, targets)  # one compiled copy per layout, not per tensor
        return {site: {k: st[(site, k)] for k in d} for site, d in tensors.items()}

    def matmul_stats(pc, batch, ls):
        if microbatches == 1:
            return one(pc, batch, ls)
        from precisionlab.train.step import split_micro

        micro = split_micro(batch, microbatches)
        first = jax.tree.map(lambda x: x[0], micro)
        init = _empty(jax.eval_shape(lambda b: one(pc, b, ls), first))

        def body(acc, b):
            return _map_stats(combine, acc, one(pc, b, ls)), None

        return jax.lax.scan(body, init, micro)[0]

    if mesh is not None:
        from jax.sharding import PartitionSpec

        from precisionlab.train.parallel import AXIS

        def per_device(pc, batch, ls):
            return _map_stats(lambda s: reduce_over(s, AXIS), matmul_stats(pc, batch, ls))

        rep = PartitionSpec()
        matmul_stats = jax.shard_map(  # noqa: F811 (the data-parallel version)
            per_device,
            mesh=mesh,
            in_specs=(rep, PartitionSpec(AXIS), rep),
            out_specs=rep,
            check_vma=False,
        )

    def compute(params_s, opt_state, ls, g32, batch):
        out: dict[str, Any] = {}
        if telemetry.matmuls:
            out["matmul"] = matmul_stats(cast_floating(params_s, policy.compute_dtype), batch, ls)
        if telemetry.state:
            flat = {}
            for kind, tree in (("param", params_s), ("grad", g32), ("opt_state", opt_state)):
                out[kind] = {}
                for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                    if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
                        flat[(kind, jax.tree_util.keystr(path))] = leaf
            for (kind, path), st in stats_of_many(flat, targets).items():
                out[kind][path] = st
        return out

    def fn(params_s, opt_state, ls, g32, batch, step):
        return every(telemetry.interval, step, compute, params_s, opt_state, ls, g32, batch)

    return fn


# --- host side -----------------------------------------------------------------------------
_PER_TARGET = ("overflow", "saturate", "underflow", "subnormal", "poisoned")
_COUNTS = ("n", "n_nan", "n_inf", "n_zero", "n_nonzero")


def _num(v: Any) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def telemetry_rows(stats: dict[str, Any], step: int, targets: tuple[str, ...]) -> list[dict]:
    """One JSON row per layer and tensor of a step's statistics (host values), in the order
    matmuls (by site), params, grads, optimizer state (by leaf path)::

        {"step", "kind": "matmul" | "param" | "grad" | "opt_state", "layer": site name or
         leaf path, "tensor": "lhs" | "rhs" | "out" | "grad" (matmuls; "" otherwise),
         "n", "n_nan", "n_inf", "n_zero", "n_nonzero", "amax", "amin_nonzero",
         "dynamic_range", "mean", "std", "frac_zero", "frac_nonfinite",
         "targets": {name: {"overflow", "saturate", "underflow", "subnormal", "poisoned",
                            "sqnr_db"}}}

    Fractions of ``targets`` are of the finite nonzero elements (exact quotients of the
    counts); values undefined for a tensor (no nonzero element) are None.
    """
    names = [t.name for t in parse_targets(targets)]
    keyed: list[tuple[str, str, str, TensorStats]] = []
    for site, tensors in stats.get("matmul", {}).items():
        for tensor in ("lhs", "rhs", "out", "grad"):
            if tensor in tensors:
                keyed.append(("matmul", site, tensor, tensors[tensor]))
    for kind in ("param", "grad", "opt_state"):
        for path, s in stats.get(kind, {}).items():
            keyed.append((kind, path, "", s))
    if not keyed:
        return []
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *[k[3] for k in keyed])
    derived = {k: np.asarray(v) for k, v in jax.vmap(derive)(stacked).items()}
    rows = []
    for i, (kind, layer, tensor, _) in enumerate(keyed):
        row: dict[str, Any] = {"step": step, "kind": kind, "layer": layer, "tensor": tensor}
        counts = {k: int(np.asarray(getattr(stacked, k))[i]) for k in _COUNTS}
        row.update(counts)
        for key in ("amax", "amin_nonzero", "dynamic_range", "mean", "std"):
            row[key] = _num(derived[key][i])
        n, nz = max(counts["n"], 1), max(counts["n_nonzero"], 1)
        row["frac_zero"] = counts["n_zero"] / n
        row["frac_nonfinite"] = (counts["n_nan"] + counts["n_inf"]) / n
        row["targets"] = {
            name: {
                **{k: int(np.asarray(getattr(stacked, k))[i, j]) / nz for k in _PER_TARGET},
                "sqnr_db": _num(derived["sqnr_db"][i, j]),
            }
            for j, name in enumerate(names)
        }
        rows.append(row)
    return rows
