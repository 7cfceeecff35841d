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
them. Matmuls inside ``scan``/``while``/``cond``/``checkpoint`` are observed too: a site inside
a scan over stacked layers (``scan_layers = true``, with or without ``remat_every``) gives one
entry per iteration, i.e. per layer, so a scanned model has the same rows as unrolled. An
untaken ``cond`` branch or an unused while slot gives no row: its statistics are the empty
identity of :func:`~precisionlab.telemetry.combine` (``n == 0``; across micro-batches and shards
only the ones where the branch ran count), and :func:`telemetry_rows` leaves out matmul entries
with no element. Matmul rows name
the model layer (``layer3``, from the site's named scope, see
:meth:`precisionlab.intercept.Site.layer`) and the interception site (``dot_general[1]``).

:func:`telemetry_rows` turns a step's statistics into JSON rows (one per layer and tensor).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from precisionlab._schema import INT32_MAX, Field, validate_enabled_table
from precisionlab.intercept import Site
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed._loss_scale import LossScale
from precisionlab.mixed._policy import Policy, cast_floating
from precisionlab.telemetry import (
    OPS,
    TensorStats,
    combine,
    derive,
    every,
    observe,
    parse_targets,
    reduce_over,
    stacked_stats,
    tensor_stats,
)
from precisionlab.train._parallel import AXIS

__all__ = [
    "DEFAULT_TARGETS",
    "TELEMETRY_FIELDS",
    "Telemetry",
    "TelemetryNames",
    "auto_interval",
    "make_telemetry_fn",
    "parse_telemetry",
    "telemetry_rows",
]


class TelemetryNames(TypedDict, total=False):
    """What the statistics of :func:`make_telemetry_fn`'s ``fn`` are, in order (filled when
    ``fn`` is traced): ``matmul``: ``(site, "lhs" | "rhs" | "out" | "grad", layer)`` per
    observed tensor; ``state``: ``("param" | "grad" | "opt_state", leaf path)`` per state
    tensor; ``where``: each observed site's source line."""

    matmul: list[tuple[str, str, str]]
    state: list[tuple[str, str]]
    where: dict[str, str]


#: One step's telemetry: ``"matmul"`` and ``"state"`` statistics (stacked over the tensors)
#: and, with ``dump``, ``"tensors"``: the tensors themselves (``{"matmul": [...], "state":
#: [...]}``).
TelemetryStats: TypeAlias = dict[str, TensorStats | dict[str, list[jax.Array]]]

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
    "ops": Field(
        bool, True,
        doc="statistics of every other operation that can overflow or underflow (GELU's x**3, "
        "softmax's exp, norms' sums, the loss ...): output and cotangent (needs matmuls)",
    ),
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
    ops: bool = True

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
    values = validate_enabled_table(table, TELEMETRY_FIELDS, "telemetry")
    if values is None:
        return None
    return Telemetry(
        interval=values["interval"] or auto_interval(steps),
        targets=tuple(values["targets"]),
        matmuls=values["matmuls"],
        state=values["state"],
        ops=values["ops"],
    )


def _empty(s: TensorStats) -> TensorStats:
    """The identity of :func:`combine` for stacked statistics shaped like ``s``."""
    e = tensor_stats(jnp.zeros((0,), jnp.float32), ())
    n, t = s.n.shape[0], s.overflow.shape[-1]
    per = ("overflow", "saturate", "underflow", "subnormal", "poisoned", "noise_n")
    fields = {f: jnp.broadcast_to(getattr(e, f), (n,)) for f in e._fields if f not in per}
    for f in per:
        fields[f] = jnp.zeros((n, t), getattr(e, f).dtype)
    return TensorStats(**fields)


def _per_layer(
    site: Site, tensors: dict[str, jax.Array]
) -> dict[tuple[str, str, str], tuple[jax.Array, jax.Array]]:
    """``{(site, tensor, layer): (tensor, valid)}`` of one site's observed tensors, one entry
    per iteration of its loops (leading axes, flattened row-major: a scanned layer each);
    ``valid``: bool scalar, False for an untaken ``cond`` branch or an unused while slot."""
    out: dict[tuple[str, str, str], tuple[jax.Array, jax.Array]] = {}
    roles = [k for k in ("lhs", "rhs", "out", "grad") if k in tensors]
    n_loops = len(site.loops)
    loop_shape = tensors["out"].shape[:n_loops]
    valid = tensors.get("valid")
    for i in range(math.prod(loop_shape)):
        idx = tuple(int(j) for j in np.unravel_index(i, loop_shape)) if n_loops else ()
        layer = site.layer(i if n_loops else None)
        ok = jnp.bool_(True) if valid is None else jnp.asarray(valid)[idx]
        for k in roles:
            out[(site.name, k, layer)] = (tensors[k][idx], ok)
    return out


def _masked(stats: TensorStats, valid: list[jax.Array]) -> TensorStats:
    """Stacked statistics with the invalid entries' replaced by the empty identity (n == 0)."""
    if not valid:
        return stats
    ok = jnp.stack(valid)
    empty = _empty(stats)
    return jax.tree.map(
        lambda s, e: jnp.where(ok.reshape(-1, *(1,) * (s.ndim - 1)), s, e), stats, empty
    )


def make_telemetry_fn(
    loss_fn: Callable,
    policy: Policy,
    telemetry: Telemetry,
    *,
    microbatches: int = 1,
    mesh: jax.sharding.Mesh | None = None,
    dump: bool = False,
) -> Callable[..., TelemetryStats]:
    """``fn(params_stored, opt_state, loss_scale, grads32, batch, step) -> stats``, the
    step's telemetry: ``{"matmul": TensorStats, "state": TensorStats}``, each stacked over
    its tensors (see :func:`precisionlab.telemetry.stacked_stats`; zeros on the steps
    ``telemetry.interval`` skips), named by ``fn.names`` once traced: ``{"matmul": [(site,
    "lhs" | "rhs" | "out" | "grad", layer), ...], "state": [("param" | "grad" | "opt_state",
    leaf path), ...]}`` (a site inside a scan over layers: one entry per layer).
    ``loss_fn(params, batch) -> (loss, aux)`` as the step differentiates it (aux is
    ignored); ``mesh``: the data-parallel mesh (the batch is sharded over its axis) or None.
    ``dump`` (one device, one micro-batch): ``stats["tensors"]`` also holds the tensors
    themselves (``{"matmul": [...], "state": [...]}``, in ``names`` order), computed in the
    same program as their statistics, for checks against an independent recount."""
    targets = telemetry.targets
    names: TelemetryNames = {}

    def scaled(p: Any, b: Any, ls: LossScale) -> jax.Array:
        loss, _ = loss_fn(p, b)
        return ls.scale(loss)

    ops = OPS if telemetry.ops else ()
    vg = observe(scaled, targets, ops=ops).value_and_grad(0, tensors=True)

    def matmul_tensors(pc: Any, b: Any, ls: LossScale) -> tuple[list[jax.Array], list[jax.Array]]:
        """(tensors, valid flags), in ``names["matmul"]`` order."""
        tensors = vg(pc, b, ls)[2]
        flat: dict[tuple[str, str, str], tuple[jax.Array, jax.Array]] = {}
        for site in vg.sites:  # program order
            if site.name in tensors:
                flat.update(_per_layer(site, tensors[site.name]))
        names["matmul"] = list(flat)
        names["where"] = {s.name: s.where for s in vg.sites}
        return [x for x, _ in flat.values()], [ok for _, ok in flat.values()]

    def one(pc: Any, b: Any, ls: LossScale) -> TensorStats:
        # one program for all tensors: hundreds of separate statistics compile slowly
        xs, valid = matmul_tensors(pc, b, ls)
        return _masked(stacked_stats(xs, targets), valid)

    def local_stats(pc: Any, batch: Any, ls: LossScale) -> TensorStats:
        if microbatches == 1:
            return one(pc, batch, ls)
        # [B, ...] -> [microbatches, B // microbatches, ...], as the step splits it
        micro = jax.tree.map(lambda x: x.reshape(microbatches, -1, *x.shape[1:]), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        init = _empty(jax.eval_shape(lambda b: one(pc, b, ls), first))

        def body(acc: TensorStats, b: Any) -> tuple[TensorStats, None]:
            return jax.vmap(combine)(acc, one(pc, b, ls)), None

        return jax.lax.scan(body, init, micro)[0]

    matmul_stats = local_stats
    if mesh is not None:

        def per_device(pc: Any, batch: Any, ls: LossScale) -> TensorStats:
            # every device's statistics are its own (params and scale varying over the data
            # axis, as the step's gradients are), combined over the axis by reduce_over
            pc, ls = boundary.match_varying((pc, ls), (AXIS,))
            return jax.vmap(lambda s: reduce_over(s, AXIS))(local_stats(pc, batch, ls))

        rep = PartitionSpec()
        matmul_stats = jax.shard_map(
            per_device, mesh=mesh, in_specs=(rep, PartitionSpec(AXIS), rep), out_specs=rep
        )

    def state_tensors(params_s: Any, opt_state: Any, g32: Any) -> list[jax.Array]:
        flat: dict[tuple[str, str], jax.Array] = {}
        for kind, tree in (("param", params_s), ("grad", g32), ("opt_state", opt_state)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                if jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
                    flat[(kind, jax.tree_util.keystr(path))] = leaf
        names["state"] = list(flat)
        return list(flat.values())

    def compute(
        params_s: Any, opt_state: Any, ls: LossScale, g32: Any, batch: Any
    ) -> TelemetryStats:
        pc = cast_floating(params_s, policy.compute_dtype)
        mm = telemetry.matmuls
        st = state_tensors(params_s, opt_state, g32) if telemetry.state else []
        if not mm:
            names["matmul"] = []
        if mm and microbatches == 1 and mesh is None:
            # the whole batch's tensors and the state's in one program (half the code)
            xs, valid = matmul_tensors(pc, batch, ls)
            if not xs and not st:
                return {}
            both = stacked_stats(xs + st, targets)
            mm_stats = _masked(jax.tree.map(lambda v: v[: len(xs)], both), valid)
            out: TelemetryStats = {"matmul": mm_stats} if xs else {}
            if st:
                out["state"] = jax.tree.map(lambda v: v[len(xs) :], both)
            if dump:
                out["tensors"] = {"matmul": xs, "state": st}
            return out
        out = {}
        if mm:
            out["matmul"] = matmul_stats(pc, batch, ls)
        if st:
            out["state"] = stacked_stats(st, targets)
        return out

    def fn(
        params_s: Any, opt_state: Any, ls: LossScale, g32: Any, batch: Any, step: jax.Array
    ) -> TelemetryStats:
        return every(telemetry.interval, step, compute, params_s, opt_state, ls, g32, batch)

    fn.names = names  # type: ignore[attr-defined]  # read by the step's row hook
    return fn


# --- host side -----------------------------------------------------------------------------
_PER_TARGET = ("overflow", "saturate", "underflow", "subnormal", "poisoned")
_COUNTS = ("n", "n_nan", "n_inf", "n_zero", "n_nonzero")


#: ``derive`` of stacked statistics, compiled once per (tensors, targets) shape per process.
_derive_stacked = jax.jit(jax.vmap(derive))


def _num(v: Any) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def telemetry_rows(
    stats: dict[str, Any], names: Mapping[str, Any], step: int, targets: tuple[str, ...]
) -> list[dict]:
    """One JSON row per layer and tensor of a step's statistics (host values of
    :func:`make_telemetry_fn`'s output, named by its ``names``: ``TelemetryNames``), matmuls
    first (by site), then params, grads and optimizer state (by leaf path); a matmul entry
    with no element (a ``cond`` branch that did not run, an unused while slot) gives no row::

        {"step", "kind": "matmul" | "op" | "param" | "grad" | "opt_state", "layer": the
         model layer (matmuls and ops: "layer3", see Site.layer) or leaf path, "site": the
         interception site ("dot_general[1]", "conv_general_dilated[0]": kind "matmul";
         "integer_pow[0]"; matmuls and ops only),
         "where": the source line that emitted it (matmuls and ops, where known),
         "tensor": "lhs" | "rhs" | "out" | "grad" (matmuls; ops: "out" | "grad"; "" otherwise),
         "n", "n_nan", "n_inf", "n_zero", "n_nonzero", "amax", "amin_nonzero",
         "dynamic_range", "mean", "std", "frac_zero", "frac_nonfinite",
         "targets": {name: {"overflow", "saturate", "underflow", "subnormal", "poisoned",
                            "sqnr_db"}}}

    Fractions of ``targets`` are of the finite nonzero elements (exact quotients of the
    counts); values undefined for a tensor (no nonzero element) are None.
    """
    tnames = [t.name for t in parse_targets(targets)]
    where = names.get("where", {})
    rows = []
    for group in ("matmul", "state"):
        if group not in stats:
            continue
        st = TensorStats._make(np.asarray(v) for v in stats[group])  # host copies
        derived = {k: np.asarray(v) for k, v in _derive_stacked(st).items()}
        for i, key in enumerate(names[group]):
            if group == "matmul" and int(st.n[i]) == 0:
                continue  # an untaken cond branch or an unused while slot: no row
            if group == "matmul":
                site, tensor, layer = key
                # a convolution is a product too: its operands are rows as a matmul's are
                kind = "matmul" if site.split("[")[0] in boundary.PRODUCTS else "op"
                row: dict[str, Any] = {"step": step, "kind": kind, "layer": layer}
                row.update(site=site, tensor=tensor)
                if where.get(site):
                    row["where"] = where[site]
            else:
                row = {"step": step, "kind": key[0], "layer": key[1], "tensor": ""}
            counts = {k: int(getattr(st, k)[i]) for k in _COUNTS}
            row.update(counts)
            for k in ("amax", "amin_nonzero", "dynamic_range", "mean", "std"):
                row[k] = _num(derived[k][i])
            n, nz = max(counts["n"], 1), max(counts["n_nonzero"], 1)
            row["frac_zero"] = counts["n_zero"] / n
            row["frac_nonfinite"] = (counts["n_nan"] + counts["n_inf"]) / n
            row["targets"] = {
                name: {
                    **{k: int(getattr(st, k)[i, j]) / nz for k in _PER_TARGET},
                    "sqnr_db": _num(derived["sqnr_db"][i, j]),
                }
                for j, name in enumerate(tnames)
            }
            rows.append(row)
    return rows
