"""``diagnose --compare``: two variants in lockstep, every intercepted tensor compared per step.

Both variants train on the same batches (same data, order and seed; each from its own state),
and at every ``every``-th step each captured tensor (:mod:`precisionlab.diagnose._capture`) of
the second is compared with the first's: the relative difference is ``||b - a||_2 /
||a||_2`` in float64 (``inf`` where only ``b`` holds a NaN or inf; not compared where ``a``
does). At the first step where any tensor's difference exceeds ``threshold``, the tensor that
differs most is the answer (ties go to the earliest in causal order: forward in program
order, the loss, then cotangents from the last layer back, so an overflow is blamed on the
layer where it starts, not on the layers its infinities reach),
explained by the statistics of the reference tensor in the second variant's compute dtype
(:func:`precisionlab.telemetry.tensor_stats`: the fractions that overflow or underflow there,
cotangents taken at the second variant's loss weight times loss scale).

Tensors are paired by model layer and role, not by interception site
(:func:`match_tensors`): a variant with ``scan_layers`` (one site serves every stacked
layer) compares with an unrolled one. Tensors without a counterpart in the other variant
are listed in :attr:`CompareResult.unmatched` (and the report); when none pairs at all,
compare raises ``ValueError``. A ``cond`` branch that ran in one variant and not in the
other at a compared step is a crossing (relative difference inf).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from precisionlab import _io
from precisionlab.diagnose._capture import Capture, Tensor
from precisionlab.diagnose._options import check_counts
from precisionlab.experiments._config import Unit
from precisionlab.telemetry import tensor_stats, to_dict
from precisionlab.train import build, build_step, make_data
from precisionlab.train._step import normalize_loss_fn

__all__ = [
    "CompareOptions",
    "CompareResult",
    "Crossing",
    "compare",
    "match_tensors",
    "relative_difference",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareOptions:
    """threshold: relative difference that counts as a break (> 0). every: compare every N
    steps (>= 1). steps: steps to run at most (None: the variants' ``steps``)."""

    threshold: float = 0.1
    every: int = 1
    steps: int | None = None

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t < math.inf:
            raise ValueError(f"threshold must be a number > 0, got {t!r}")
        check_counts(self, counts=("every",), optional=("steps",))


@dataclasses.dataclass(frozen=True)
class Crossing:
    """A tensor over the threshold: where, how far, and the statistics that explain it."""

    step: int
    layer: str
    tensor: str
    kind: str
    rel: float
    explain: str
    stats: dict[str, Any]
    order: int = 0


@dataclasses.dataclass
class CompareResult:
    """ref / other: the variants' names. steps_run: steps trained. first: the first crossing
    (None if none). at_step: every crossing at that step, largest first. heat: per layer, the
    largest relative difference at each compared step (``compared_steps``). grad_underflow: per
    layer, the fraction of the reference's output cotangents (at ``other``'s scale) that
    underflow in ``other``'s compute dtype at the first crossing's step (or the last step).
    dtype: ``other``'s compute dtype. unmatched: ``"ref LAYER:NAME"`` / ``"other LAYER:NAME"``
    of each tensor with no counterpart in the other variant (not compared). uncaptured: the
    matmuls neither variant's capture can see (inside a ``while_loop``), ``"ref SITE"``."""

    ref: str
    other: str
    threshold: float
    steps_run: int
    first: Crossing | None
    at_step: list[Crossing]
    compared_steps: list[int]
    heat: dict[str, list[float]]
    grad_underflow: dict[str, float]
    dtype: str
    unmatched: list[str] = dataclasses.field(default_factory=list)
    uncaptured: list[str] = dataclasses.field(default_factory=list)


def match_tensors(
    a: list[Tensor], b: list[Tensor]
) -> tuple[list[tuple[Tensor, Tensor]], list[str]]:
    """Pairs ``(a's tensor, b's tensor)`` with the same :attr:`Tensor.match` (layer, role and
    position among the layer's matmuls), in ``a``'s order, and the unpaired ones as
    ``"ref LAYER:NAME"`` / ``"other LAYER:NAME"`` (a name twice in one list pairs nothing)."""

    def index(ts: list[Tensor]) -> dict[str, Tensor | None]:
        out: dict[str, Tensor | None] = {}
        for t in ts:
            m = t.match or t.key
            out[m] = None if m in out else t  # ambiguous: pairs nothing
        return out

    ia, ib = index(a), index(b)
    pairs = []
    for m, t in ia.items():
        u = ib.get(m)
        if t is not None and u is not None:
            pairs.append((t, u))
    paired_a = {id(t) for t, _ in pairs}
    paired_b = {id(u) for _, u in pairs}
    unmatched = [f"ref {t.key}" for t in a if id(t) not in paired_a]
    unmatched += [f"other {t.key}" for t in b if id(t) not in paired_b]
    return pairs, unmatched


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``||b - a|| / ||a||`` in float64; inf where only ``b`` is non-finite (or ``a`` is all
    zeros and ``b`` is not); NaN where ``a`` is non-finite (nothing to compare against)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not np.isfinite(a64).all():
        return math.nan
    if not np.isfinite(b64).all():
        return math.inf
    na, d = float(np.linalg.norm(a64)), float(np.linalg.norm(b64 - a64))
    if na == 0.0:
        return 0.0 if d == 0.0 else math.inf
    return d / na


def _weighted(loss_fn: Callable, w: float) -> Callable:
    f = normalize_loss_fn(loss_fn)

    def weighted(p: Any, b: Any) -> tuple[jax.Array, Any]:
        loss, aux = f(p, b)
        return loss.astype(np.float32) * np.float32(w), aux

    return weighted


class _Runner:
    """One variant: its jitted train step, state and capture."""

    def __init__(self, unit: Unit, example: Any):
        cfg = dataclasses.replace(unit.config, remat=False, hist_interval=0)
        self.setup = build(cfg)
        loss = self.setup.loss_fn
        if cfg.loss_weight != 1:
            loss = _weighted(loss, cfg.loss_weight)
        fn, self.state, _ = build_step(
            loss, self.setup.params, self.setup.optimizer, self.setup.options, example
        )
        self.step = jax.jit(fn)
        self.capture = Capture(self.setup)


def _dtype_of(runner: _Runner, layer: str) -> np.dtype:
    hp = runner.setup.config.high_precision
    return np.dtype(np.float32) if layer in hp else runner.capture.compute_dtype


def _explain(t: Tensor, a: np.ndarray, b: np.ndarray, other: _Runner, name: str) -> tuple:
    dtype = _dtype_of(other, t.layer)
    scale = other.capture.grad_scale if t.kind == "grad" else 1.0
    target = str(dtype)
    with np.errstate(over="ignore"):  # inf reference values are counted, not warned about
        x = np.asarray(a, np.float32) * np.float32(scale)
        ref = to_dict(tensor_stats(x, (target,)), (target,))
    tg = ref["targets"][target]
    b64 = np.asarray(b, np.float64)
    stats = {
        "dtype": target,
        "scale": scale,
        "ref_amax": ref["amax"],
        "ref_amin_nonzero": ref["amin_nonzero"],
        "overflow": tg["overflow"],
        "underflow": tg["underflow"],
        "subnormal": tg["subnormal"],
        "other_zero": float(np.mean(b64 == 0)),
        "other_nonfinite": float(np.mean(~np.isfinite(b64))),
    }
    what = {
        "grad": "activation gradients",
        "operand": "matmul operands",
        "output": "matmul outputs",
        "activation": "activations",
        "loss": "loss",
    }[t.kind]
    where = f"{t.layer}'s {what} ({t.name})" if t.layer != "-" else "the loss"
    if stats["overflow"] > 0:
        text = (
            f"{stats['overflow']:.1%} of {where} overflow {target} (reference amax "
            f"{ref['amax']:.3g}, {target} max {float(np.finfo(dtype).max):.6g})"
        )
    elif stats["other_nonfinite"] > 0:
        text = (
            f"{stats['other_nonfinite']:.1%} of {name}'s {where} are inf/NaN carried in from "
            f"earlier tensors (the reference fits {target}: amax {ref['amax']:.3g})"
        )
    elif stats["underflow"] > 0:
        at = f" at loss weight x loss scale {scale:g}" if t.kind == "grad" else ""
        text = (
            f"{stats['underflow']:.1%} of {where} underflow in {target}{at} "
            f"({stats['other_zero']:.1%} of {name}'s copy is zero)"
        )
    else:
        text = f"{where} differ by rounding and drift (no overflow or underflow in {target})"
    return text, stats


def compare(
    ref: Unit,
    other: Unit,
    options: CompareOptions = CompareOptions(),
    *,
    say: Callable[[str], None] = lambda _m: None,
    dump: Path | None = None,
) -> CompareResult:
    """Run ``ref`` and ``other`` in lockstep and find the first tensor that breaks (see the
    module docstring). ``dump``: write both variants' tensors at the answer's step there
    (``.npz``: ``ref/LAYER:NAME``, ``other/LAYER:NAME``, ``grad_scale``)."""
    cfg = ref.config
    batches = make_data(cfg.data, **cfg.data_kwargs).batches(cfg.batch_size, seed=cfg.seed)
    first_batch = next(batches)
    ra, rb = _Runner(ref, first_batch), _Runner(other, first_batch)
    steps = min(ref.config.steps, other.config.steps, options.steps or 2**31)
    heat: dict[str, list[float]] = {layer: [] for layer in (*ra.capture.layers, "-")}
    compared: list[int] = []
    at_step: list[Crossing] = []
    last: tuple = ()
    pairs: list[tuple[Tensor, Tensor]] | None = None
    unmatched: list[str] = []
    batch, step = first_batch, 0
    while step < steps:
        if step % options.every == 0:
            ta, tb = ra.capture(ra.state, batch), rb.capture(rb.state, batch)
            if pairs is None:
                pairs, unmatched = _pair(ra, rb, ta, tb, ref.name, other.name, say)
            compared.append(step + 1)
            worst: dict[str, float] = {}
            for t, u in pairs:
                if t.key not in ta and u.key not in tb:
                    continue  # a cond branch that ran in neither variant
                if t.key not in ta or u.key not in tb:
                    ran = other.name if t.key not in ta else ref.name
                    text = f"{t.layer}'s {t.name} ran in {ran} only (a cond took another branch)"
                    at_step.append(
                        Crossing(step + 1, t.layer, t.name, t.kind, math.inf, text, {}, t.order)
                    )
                    continue
                rel = relative_difference(ta[t.key], tb[u.key])
                if not math.isnan(rel):
                    worst[t.layer] = max(worst.get(t.layer, 0.0), rel)
                if rel > options.threshold:
                    text, stats = _explain(t, ta[t.key], tb[u.key], rb, other.name)
                    at_step.append(
                        Crossing(step + 1, t.layer, t.name, t.kind, rel, text, stats, t.order)
                    )
            for layer in heat:
                heat[layer].append(worst.get(layer, math.nan))
            last = (ta, tb)
            if at_step:
                say(f"step {step + 1}: {len(at_step)} tensor(s) over {options.threshold:g}")
                break
        ra.state, _ = ra.step(ra.state, batch)
        rb.state, _ = rb.step(rb.state, batch)
        step += 1
        if step < steps:
            batch = next(batches)
    ta, tb = last
    underflow: dict[str, float] = {}
    for t, u in pairs or []:
        if t.kind == "grad" and t.key in ta and u.key in tb:
            _, st = _explain(t, ta[t.key], tb[u.key], rb, other.name)
            underflow[t.layer] = max(underflow.get(t.layer, 0.0), st["underflow"])
    if dump is not None:
        arrays = {f"ref/{k}": v for k, v in ta.items()}
        arrays.update({f"other/{k}": v for k, v in tb.items()})
        with _io.atomic_open(dump, "wb") as f:  # the one write path: no link, no device
            np.savez_compressed(f, grad_scale=np.float64(rb.capture.grad_scale), **arrays)
    # The answer: at the first step over the threshold, the tensor that differs most (ties,
    # e.g. several infinities, go to the earliest in causal order: where the break starts).
    at_step.sort(key=lambda c: (-c.rel, c.order))
    first = at_step[0] if at_step else None
    return CompareResult(
        ref=ref.name,
        other=other.name,
        threshold=options.threshold,
        steps_run=step + (1 if at_step else 0),
        first=first,
        at_step=at_step,
        compared_steps=compared,
        heat={k: v for k, v in heat.items() if any(not math.isnan(x) for x in v)},
        grad_underflow=underflow,
        dtype=str(rb.capture.compute_dtype),
        unmatched=unmatched,
        uncaptured=[f"ref {n}" for n in ra.capture.uncaptured]
        + [f"other {n}" for n in rb.capture.uncaptured],
    )


def _pair(ra: _Runner, rb: _Runner, ta: dict, tb: dict, na: str, nb: str, say: Callable) -> tuple:
    """The tensor pairs of two variants (same match name and shape) and the unpaired ones;
    ``ValueError`` when nothing pairs."""
    pairs, unmatched = match_tensors(ra.capture.tensors, rb.capture.tensors)
    kept = []
    for t, u in pairs:
        if t.key in ta and u.key in tb and np.shape(ta[t.key]) != np.shape(tb[u.key]):
            unmatched += [f"ref {t.key} (shape differs)", f"other {u.key} (shape differs)"]
        else:
            kept.append((t, u))
    if not [p for p in kept if p[0].kind != "loss"] and (ra.capture.tensors or rb.capture.tensors):
        raise ValueError(
            f"no tensor of {nb} matches one of {na} by layer and role "
            f"({len(ra.capture.tensors)} vs {len(rb.capture.tensors)} tensors): nothing to compare"
        )
    if unmatched:
        say(f"not compared (no counterpart in the other variant): {', '.join(unmatched)}")
    for name, cap in ((na, ra.capture), (nb, rb.capture)):
        if cap.uncaptured:
            say(f"{name}: {len(cap.uncaptured)} matmul(s) inside a while_loop not captured")
    return kept, unmatched
