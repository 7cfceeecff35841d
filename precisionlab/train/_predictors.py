"""Divergence predictors inside ``jit``: per-layer signals that warn before a run breaks.

Every ``interval`` steps (behind a ``lax.cond``: other steps do no predictor work) the train
step adds ``metrics["predictors"]``: ``{signal: {layer: float32 scalar}}`` for the signals of
:data:`SIGNALS`, measured on the state the step started from and the update it applied. The
loop keeps them on the due steps as ``record["predictors"]`` (see :func:`predictor_row`), and
a :class:`PredictorHook` hands them on (the experiment runner writes ``predictors.jsonl``; the
live forecaster of :mod:`precisionlab.train._forecast` reads them).

Where each signal comes from (the papers' own definitions, restated):

- ``kurtosis`` (Hernandez-Cano et al., "Towards Fully FP8 GEMM LLM Training at Scale", arXiv
  2505.20524, FOG, the kurtosis monitor of its outlier analysis): for each row (token) ``x``
  of a linear layer's input, ``mean(x**4) / mean(x**2)**2``; the mean over rows; the layer's
  maximum over its linear layers. 3 for Gaussian rows, large when a few channels dominate.
- ``amax``: the largest magnitude of the layer's matmul operands and outputs (the GEMM
  tensors); ``headroom``: ``log2(format max / amax)`` of every forward tensor of the layer
  (the GEMM tensors and the outputs of the operations of :data:`GROWING_OPS`: GELU's
  ``x**3``, softmax's ``exp``), the binades left before overflow (minimum over the tensors):
  the format is each tensor's dtype (float16's 65504). Some overflows are harmless (tanh of
  an infinite GELU cube is 1): the level says where the range ends, the amax trend whether
  the layer is heading there.
  ``grad_headroom``: the same for the output cotangents (of the scaled loss);
  ``scaled_headroom``: for a delayed-scaling recipe, ``log2(FP8 max / (amax * scale))`` of
  the replaced matmuls' operands and gradients with the scale in the recipe's state (what
  the next quantization does with this step's tensors; below 0 they saturate). The amax
  slope (binades per step) is the forecaster's trend of ``amax``.
- ``grad_underflow`` (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2,
  where the gradients that become zero in float16 are counted): the fraction of the layer's
  matmul output cotangents (scaled loss) that are zero in their format (flushed, or zero by
  structure, such as the masked attention logits': the forecaster reads its rise).
- ``noise_ratio`` (Chmiel et al., "FP4 All the Way", arXiv 2505.19115, the gradient-noise
  threshold of its analysis of when quantized training stops helping): for each weight
  gradient ``G = X^T dY`` of a linear layer, ``||G|| / ||G_q - G||`` where ``G_q`` is that
  gradient as the run computes it (a recipe: both operands quantized along the tokens with
  its activation and gradient quantizers; no recipe: ``G`` rounded to the compute dtype, the
  dtype the gradient is produced in). The paper's threshold: below about ``sqrt(3)``,
  quantized training stops being effective. The layer's minimum.
- ``q_underflow`` and ``q_mse`` (Transformer Engine's precision-debug ``AutoswitchGemm``
  statistics, as :func:`precisionlab.diagnose.autoswitch` computes them): the largest over the
  layer's replaced linear layers and their three operands (``x``, ``w``, ``g``) of the fraction of
  nonzero elements the recipe's quantizer flushes to zero, and of the mean squared
  quantization error; 0 without a recipe (the statistics of a quantized GEMM: a run without
  one never switches).
- ``update_ratio``: RMS of the optimizer's update over RMS of the stored params (the
  update-to-weight ratio); ``update_applied``: ``||w_new - w_old|| / ||update||``, the part of
  the update the stored params kept (1 in float32; near 0 when bfloat16 params swamp the
  updates, Zamirai et al. 2020, "Revisiting BFloat16 Training").
- ``flip_rate`` (Chen et al., TetraJet, arXiv 2502.20853, the weight-oscillation analysis: the
  quantized weights flip between neighbouring levels while the latent weights barely move):
  the fraction of the layer's weight-matrix elements whose quantized value changed in this
  step: the element code of the recipe's weight quantizer (a scale that drifts with the
  tensor's amax moves every dequantized value without flipping a level), without a recipe
  the compute-dtype value.
- ``ln_bias`` (Su et al., "Characterization and Mitigation of Training Instabilities in
  Microscaling Formats", arXiv 2506.20752, the multiplicative gradient bias from quantized
  layer-norm affine weights): for each LayerNorm weight ``g`` the model quantizes (its
  ``norm_format``), ``|sum((Q(g) - g) * g) / sum(g * g)|``, the least-squares factor by which
  quantization scales what flows through the norm (forward and backward), minus 1; 0 when
  the norm weights are not quantized.
- ``swiglu_align`` (Fishman et al., "Scaling FP8 training to trillion-token LLMs", arXiv
  2409.12517, the weight alignment of SwiGLU under weight decay): the largest over the
  channels ``j`` of ``|cos(w_gate[:, j], w_up[:, j])|``; 0 without a SwiGLU MLP.
- ``grad_norm``: the L2 norm of the layer's gradients (unscaled float32).

Layers are the model's (:meth:`precisionlab.train._models.Model.layer_names`, given as
``Predictors.layers`` with each layer's params prefix); matmuls and operations are attributed
through their ``named_scope`` (see :meth:`precisionlab.intercept.Site.layer`), params by
prefix; what belongs to no layer (embeddings, the final norm) is ``"other"``.

Cost: one observed forward and backward pass of the loss on the due steps (as numerics
telemetry's), the per-tensor reductions, one extra weight-gradient product per linear layer
and the optimizer's update recomputed; measured with ``precisionlab bench predictors`` (see
``docs/benchmarks/forecast.md``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab._schema import INT32_MAX, Field, validate_enabled_table
from precisionlab.intercept import Site
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed._loss_scale import LossScale
from precisionlab.mixed._policy import Policy, cast_floating
from precisionlab.quant import MX_FORMATS, fake_quant, get_mx_format
from precisionlab.telemetry import every, observe

if TYPE_CHECKING:
    import optax


class _StepState(Protocol):
    """What the predictors read of the step's state (a ``TrainState``; the step imports this
    module, so its class is not named here)."""

    @property
    def step(self) -> jax.Array: ...

    @property
    def params(self) -> Any: ...

    @property
    def opt_state(self) -> Any: ...

    @property
    def loss_scale(self) -> LossScale: ...

    @property
    def recipe_state(self) -> Any: ...


__all__ = [
    "GROWING_OPS",
    "NOISE_THRESHOLD",
    "PREDICTOR_FIELDS",
    "SIGNALS",
    "PredictorHook",
    "Predictors",
    "kurtosis",
    "ln_weight_bias",
    "make_predictor_fn",
    "noise_ratio",
    "parse_predictors",
    "predictor_row",
    "run_meta",
    "swiglu_alignment",
]

#: The signals, in order, with what each measures (see the module docstring).
SIGNALS: dict[str, str] = {
    "kurtosis": "mean over rows of mean(x^4)/mean(x^2)^2 of the linear layers' inputs (max)",
    "amax": "largest magnitude of the matmul operands and outputs",
    "headroom": "log2(dtype max / amax) of the forward tensors (min), binades to overflow",
    "scaled_headroom": "log2(FP8 max / (amax * scale)) under delayed scaling (min)",
    "grad_headroom": "log2(format max / amax) of the output cotangents (min)",
    "grad_underflow": "fraction of output-cotangent elements that are zero (flushed)",
    "noise_ratio": "||G|| / ||G_q - G|| of the weight gradients (min); sqrt(3): ineffective",
    "q_underflow": "fraction of nonzero operand elements the quantizer flushes to 0 (max)",
    "q_mse": "mean squared quantization error of the operands (max)",
    "update_ratio": "RMS(update) / RMS(params)",
    "update_applied": "||w_new - w_old|| / ||update||: the part of the update kept",
    "flip_rate": "fraction of weight elements whose quantized value changed this step",
    "ln_bias": "|least-squares factor of Q(g) on g - 1| of quantized LayerNorm weights (max)",
    "swiglu_align": "max over channels of |cos(w_gate[:, j], w_up[:, j])|",
    "grad_norm": "L2 norm of the layer's gradients (unscaled)",
}

#: The operations besides matmuls whose outputs count for ``amax`` and ``headroom``: those
#: that can grow past a format's max (a subset of :data:`precisionlab.telemetry.OPS`: the
#: squashing functions, logarithms, roots and casts cannot; fewer sites compile faster).
GROWING_OPS: tuple[str, ...] = (
    *boundary.POWERS, *boundary.EXPONENTIALS, boundary.MUL, boundary.DIV, boundary.ADD,
    boundary.REDUCE_SUM,
)  # fmt: skip

#: Chmiel et al.'s threshold of ``noise_ratio``: below it quantized training stops helping.
NOISE_THRESHOLD = math.sqrt(3.0)

#: ``noise_ratio`` where the gradient's rounding adds no error (float32): a finite cap.
_RATIO_CAP = 1e6

#: The ``predictors`` table of a ``[train]`` section.
PREDICTOR_FIELDS: dict[str, Field] = {
    "enabled": Field(bool, True, doc="record the divergence predictors"),
    "interval": Field(
        int, 0, low=0, high=INT32_MAX, why="the step counter is an int32",
        doc="every N steps; 0: auto (max(5, steps // 50))",
    ),
    "live": Field(
        bool, False,
        doc="run the frozen forecaster during training and print its alarm when it fires",
    ),
    "norm_params": Field(
        list, ["*ln*_scale*"], item=str,
        doc="glob patterns of the LayerNorm weights' param paths (jax keystr) for ln_bias",
    ),
}  # fmt: skip


def auto_interval(steps: int) -> int:
    """The default interval: 50 records over the run, at most one every 5 steps."""
    return max(5, steps // 50)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Predictors:
    """What the step records: every ``interval`` steps (the steps ``s`` with ``s % interval
    == 0`` counted from 0 before the step), the :data:`SIGNALS` per layer.

    layers: ``(layer name, params keystr prefix)`` pairs in program order (the model's; empty:
    layers from the matmuls' scopes and the top-level params keys). norm_format: the MX format
    the model quantizes its LayerNorm weights with (``ln_bias``), or None. norm_params: glob
    patterns of those weights' param paths. live: the frozen forecaster runs during training
    (a hook the experiment runner adds).
    """

    interval: int
    layers: tuple[tuple[str, str], ...] = ()
    norm_format: str | None = None
    norm_params: tuple[str, ...] = ("*ln*_scale*",)
    live: bool = False

    def __post_init__(self) -> None:
        n = self.interval
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"predictor interval must be an int >= 1, got {n!r}")
        object.__setattr__(self, "layers", tuple((str(a), str(b)) for a, b in self.layers))
        object.__setattr__(self, "norm_params", tuple(self.norm_params))
        if self.norm_format is not None:
            if get_mx_format(self.norm_format) is None:
                raise ValueError(
                    f"unknown norm_format {self.norm_format!r}; allowed: {', '.join(MX_FORMATS)}"
                )

    def due(self, step: int) -> bool:
        """Whether the step starting at ``step`` (0-based) records the predictors."""
        return step % self.interval == 0


def parse_predictors(
    table: dict[str, Any] | None,
    steps: int,
    *,
    layers: Sequence[tuple[str, str]] = (),
    norm_format: str | None = None,
) -> Predictors | None:
    """:class:`Predictors` from a ``predictors`` table (None or ``enabled = false``: off)."""
    values = validate_enabled_table(table, PREDICTOR_FIELDS, "predictors")
    if values is None:
        return None
    return Predictors(
        interval=values["interval"] or auto_interval(steps),
        layers=tuple(layers),
        norm_format=norm_format,
        norm_params=tuple(values["norm_params"]),
        live=values["live"],
    )


# --- the signals on one tensor (public: each is tested against a hand-computed value) -------


def kurtosis(x: jax.Array) -> jax.Array:
    """FOG's kurtosis of a (rows, K) tensor: per row ``mean(x**4) / mean(x**2)**2`` over K,
    averaged over the rows with a nonzero ``mean(x**2)`` (0 when there is none); float32."""
    x = jnp.asarray(x, jnp.float32).reshape(-1, x.shape[-1])
    m2 = jnp.mean(x * x, axis=-1)
    m4 = jnp.mean((x * x) * (x * x), axis=-1)
    ok = m2 > 0
    k = jnp.where(ok, m4 / jnp.where(ok, m2 * m2, 1.0), 0.0)
    return jnp.sum(k) / jnp.maximum(jnp.sum(ok), 1)


def noise_ratio(g: jax.Array, g_q: jax.Array) -> jax.Array:
    """``||g|| / ||g_q - g||`` (float32); capped at 1e6 where the error is 0 and g is not."""
    g = jnp.asarray(g, jnp.float32)
    err = jnp.sqrt(jnp.sum((jnp.asarray(g_q, jnp.float32) - g) ** 2))
    norm = jnp.sqrt(jnp.sum(g * g))
    return jnp.where(
        err > 0, norm / jnp.where(err > 0, err, 1.0), jnp.where(norm > 0, _RATIO_CAP, 0.0)
    )


def ln_weight_bias(g: jax.Array, g_q: jax.Array) -> jax.Array:
    """``|sum((g_q - g) * g) / sum(g * g)|``: the least-squares factor of ``g_q`` on ``g``
    minus 1 (0 for an all-zero ``g``)."""
    g = jnp.asarray(g, jnp.float32)
    den = jnp.sum(g * g)
    num = jnp.sum((jnp.asarray(g_q, jnp.float32) - g) * g)
    return jnp.abs(jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0))


def swiglu_alignment(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """The largest over columns ``j`` of ``|cos(w_gate[:, j], w_up[:, j])|`` of two (d, f)
    matrices (a zero column counts 0)."""
    a = jnp.asarray(w_gate, jnp.float32)
    b = jnp.asarray(w_up, jnp.float32)
    num = jnp.sum(a * b, axis=0)
    den = jnp.sqrt(jnp.sum(a * a, axis=0) * jnp.sum(b * b, axis=0))
    cos = jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
    return jnp.max(jnp.abs(cos))


def _fmax(dtype: Any) -> float:
    return float(jnp.finfo(dtype).max)


def _log2_headroom(fmax: Any, amax: jax.Array) -> jax.Array:
    """log2(fmax / amax), clipped to [-64, 256] (amax 0: 256; amax inf/NaN: -64)."""
    a = jnp.asarray(amax, jnp.float32)
    h = jnp.log2(jnp.asarray(fmax, jnp.float32)) - jnp.log2(jnp.where(a > 0, a, 1.0))
    h = jnp.where(a > 0, h, 256.0)
    return jnp.clip(jnp.where(jnp.isfinite(a), h, -64.0), -64.0, 256.0)


def _amax(x: jax.Array) -> jax.Array:
    """max |x| over the finite elements (0 without one): masks fill with -inf on purpose, and
    an overflowed element has already failed (what is forecast is the approach to the max)."""
    x = jnp.abs(jnp.asarray(x).astype(jnp.float32))
    return jnp.max(jnp.where(jnp.isfinite(x), x, 0.0)) if x.size else jnp.float32(0)


# --- quantizers ---------------------------------------------------------------------------


def _qdq(
    recipe: Any, x: jax.Array, kind: str, scale: Any = None, key: Any = None, codes: bool = False
) -> jax.Array:
    """The (R, K) float32 ``x`` quantized along K as ``recipe`` quantizes ``kind`` operands,
    dequantized (zero padding to the recipe's blocks, cropped back); ``codes``: the element
    values before the scales are applied (what a 4-bit weight flips between)."""
    r, k = x.shape
    t = x.astype(jnp.float32)
    for blk in recipe.block_sizes(kind):
        t = jnp.pad(t, ((0, 0), (0, -t.shape[1] % blk)))
        if recipe.two_d(kind):
            t = jnp.pad(t, ((0, -t.shape[0] % blk), (0, 0)))
    if getattr(recipe, "stateful", False) and scale is None:
        # delayed scaling without a state entry: the current per-tensor scale
        fmt_max = float(recipe.fmt(kind).max)
        a = _amax(t)
        scale = jnp.where(a > 0, fmt_max / jnp.where(a > 0, a, 1.0), 1.0)
    if key is None:
        key = jax.random.PRNGKey(0)
    q = recipe.quantize(t[None], kind, scale=scale, key=key)
    out = q.elems[0] if codes else q.dequantize()[0]
    return out[:r, :k]


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return jnp.asarray(x).astype(dtype).astype(jnp.float32)


# --- the in-jit function ------------------------------------------------------------------


def _layer_of_param(path: str, layers: Sequence[tuple[str, str]]) -> str:
    best, best_len = "other", -1
    for name, prefix in layers:
        if path.startswith(prefix) and len(prefix) > best_len:
            best, best_len = name, len(prefix)
    return best


def _is_linear(site: Any) -> bool:
    """A matmul of an activation with a 2-D weight (no batch dimensions): a linear layer."""
    shapes = site.in_shapes
    return site.primitive == boundary.DOT_GENERAL and len(shapes) == 2 and len(shapes[1]) == 2


class _Acc:
    """Per-(signal, layer) reductions gathered while tracing, finished into scalars."""

    def __init__(self) -> None:
        self.max: dict[tuple[str, str], list] = {}
        self.min: dict[tuple[str, str], list] = {}
        self.sum: dict[tuple[str, str], list] = {}

    def add(self, kind: str, signal: str, layer: str, value: Any) -> None:
        getattr(self, kind).setdefault((signal, layer), []).append(jnp.asarray(value, jnp.float32))

    def get(self, kind: str, signal: str, layer: str, default: float) -> jax.Array:
        vals = getattr(self, kind).get((signal, layer))
        if not vals:
            return jnp.float32(default)
        s = jnp.stack(vals)
        if kind == "max":
            return jnp.max(s)
        if kind == "min":
            return jnp.min(s)
        return jnp.sum(s, axis=0)


def _entries(site: Any, tensors: dict[str, Any], names: Sequence[str]) -> list[tuple[str, dict]]:
    """(layer, {role: tensor}) per iteration of the site's loops (one entry without loops)."""
    n_loops = len(site.loops)
    if not n_loops:
        return [(site.layer(names=names), tensors)]
    ref = tensors["out"]
    loop_shape = ref.shape[:n_loops]
    out = []
    for i in range(math.prod(loop_shape)):
        idx = tuple(int(j) for j in np.unravel_index(i, loop_shape))
        roles = {k: v[idx] for k, v in tensors.items() if k in ("lhs", "rhs", "out", "grad")}
        out.append((site.layer(i, names=names), roles))
    return out


#: One step's predictors: signal -> layer -> float32 scalar.
Signals: TypeAlias = dict[str, dict[str, jax.Array]]


def make_predictor_fn(
    loss_fn: Callable,
    policy: Policy,
    predictors: Predictors,
    *,
    recipe: Any = None,
) -> Callable[..., Signals]:
    """``fn(state, new_params, grads32, batch, optimizer) -> {signal: {layer: f32[]}}``
    (zeros on the steps ``predictors.interval`` skips), the step's predictors.

    ``loss_fn(params, batch) -> (loss, aux)`` as the step differentiates it (on compute-dtype
    params; the observed pass runs it without the recipe, as numerics telemetry does, and
    applies the recipe's quantizers to what it sees); ``recipe``: the run's
    :class:`~precisionlab.train._recipe.TrainRecipe` or None; ``state``: the
    :class:`~precisionlab.train._step.TrainState` the step started from; ``optimizer``: the
    step's optax transformation (its update is recomputed for the update signals)."""
    layer_names = tuple(n for n, _ in predictors.layers)
    cd = policy.compute_dtype
    rq = None if recipe is None else recipe.recipe

    def scaled(p: Any, b: Any, ls: LossScale) -> jax.Array:
        loss, _ = loss_fn(p, b)
        return ls.scale(loss)

    vg = observe(scaled, (), ops=GROWING_OPS).value_and_grad(0, tensors=True)

    def compute(
        state: _StepState, new_params: Any, g32: Any, batch: Any, opt: optax.GradientTransformation
    ) -> Signals:
        acc = _Acc()
        seen_layers: list[str] = list(layer_names)
        ls = state.loss_scale
        pc = cast_floating(state.params, cd)
        _, _, tensors = vg(pc, batch, ls)
        replaced: set[str] = set()
        if recipe is not None:
            replaced = {s.name for s in recipe.apply(scaled).sites(pc, batch, ls) if s.selected}
        rstate = state.recipe_state or {}
        for site in vg.sites:
            if site.name not in tensors:
                continue
            for layer, ts in _entries(site, tensors[site.name], layer_names):
                if (layer_names and layer not in layer_names) or (
                    not layer_names and not site.scope
                ):
                    layer = "other"
                if layer not in seen_layers:
                    seen_layers.append(layer)
                _site_signals(
                    acc, site, layer, ts, rq, site.name in replaced, rstate.get(site.name), ls, cd
                )
        _state_signals(acc, state, new_params, g32, opt, predictors, rq, cd, seen_layers)
        out: Signals = {}
        # per signal: its reduction over a layer's values and its value without any
        extremes = {
            "kurtosis": ("max", 0.0), "amax": ("max", 0.0), "headroom": ("min", 256.0),
            "scaled_headroom": ("min", 256.0),
            "grad_headroom": ("min", 256.0), "noise_ratio": ("min", _RATIO_CAP),
            "q_underflow": ("max", 0.0), "q_mse": ("max", 0.0),
            "ln_bias": ("max", 0.0), "swiglu_align": ("max", 0.0),
        }  # fmt: skip
        for signal in SIGNALS:
            out[signal] = {}
            for layer in seen_layers:
                if signal in extremes:
                    kind, default = extremes[signal]
                    out[signal][layer] = acc.get(kind, signal, layer, default)
                else:  # pooled from summed parts
                    out[signal][layer] = _finish_sum(acc, signal, layer)
        return out

    def fn(
        state: _StepState, new_params: Any, g32: Any, batch: Any, opt: optax.GradientTransformation
    ) -> Signals:
        # the optimizer is functions, not arrays: closed over, not a lax.cond operand
        def run(st: _StepState, new: Any, g: Any, b: Any) -> Signals:
            return compute(st, new, g, b, opt)

        return every(predictors.interval, state.step, run, state, new_params, g32, batch)

    return fn


def _finish_sum(acc: _Acc, signal: str, layer: str) -> jax.Array:
    """The pooled signals, from their summed parts."""
    v = acc.sum.get((signal, layer))
    if not v:
        return jnp.float32(0.0 if signal != "update_applied" else 1.0)
    s = jnp.sum(jnp.stack(v), axis=0)
    if signal in ("grad_underflow", "flip_rate"):  # (count, n)
        return s[0] / jnp.maximum(s[1], 1.0)
    if signal == "update_ratio":  # (sum u^2, sum w^2)
        return jnp.sqrt(s[0]) / jnp.maximum(jnp.sqrt(s[1]), 1e-30)
    if signal == "update_applied":  # (sum dw^2, sum u^2)
        return jnp.where(s[1] > 0, jnp.sqrt(s[0]) / jnp.sqrt(jnp.where(s[1] > 0, s[1], 1.0)), 1.0)
    return jnp.sqrt(s[0])  # grad_norm: (sum g^2,)


def _site_signals(
    acc: _Acc,
    site: Site,
    layer: str,
    ts: dict[str, jax.Array],
    rq: Any,
    replaced: bool,
    rstate: dict[str, Any] | None,
    ls: LossScale,
    cd: np.dtype,
) -> None:
    """The signals one matmul or operation contributes to its layer."""
    # The format of a matmul's output and cotangent is its operands' (the compute dtype): its
    # float32 accumulator is rounded to it at once, and the gradient of a compute-dtype operand
    # is produced in it. An operation's is its output's dtype. (The cotangent itself comes out
    # in float32, through the observer's float32 probe, holding that format's values.)
    matmul = site.primitive == boundary.DOT_GENERAL
    gdt = ts["lhs"].dtype if matmul else ts["out"].dtype
    for k in ("lhs", "rhs", "out"):
        if k in ts:
            a = _amax(ts[k])
            if matmul:  # the GEMM's tensors: what a recipe scales, where growth shows first
                acc.add("max", "amax", layer, a)
            fmt = gdt if k == "out" else ts[k].dtype
            acc.add("min", "headroom", layer, _log2_headroom(_fmax(fmt), a))
    if "grad" in ts:
        acc.add("min", "grad_headroom", layer, _log2_headroom(_fmax(gdt), _amax(ts["grad"])))
    if site.primitive != boundary.DOT_GENERAL:
        return
    g = ts.get("grad")
    if g is not None:
        # zero in the format: the float32 cotangent rounded to it (a float32 accumulator's
        # output is rounded to the compute dtype right after the matmul)
        low = jnp.sum(_cast(g, gdt) == 0, dtype=jnp.float32)
        acc.add("sum", "grad_underflow", layer, jnp.stack([low, jnp.float32(g.size)]))
    lhs, rhs = ts["lhs"], ts["rhs"]
    linear = _is_linear(site)
    if linear:
        acc.add("max", "kurtosis", layer, kurtosis(lhs))
    scales = (None, None, None)
    if replaced and rstate is not None and "scale" in rstate:
        scales = tuple(rstate["scale"][i] for i in range(3))
    if replaced and linear:  # attention products: their operands are activations only
        g2 = None if g is None else g.reshape(-1, g.shape[-1])
        for kind, t, s in (("x", lhs, scales[0]), ("w", rhs, scales[1]), ("g", g2, scales[2])):
            if t is None:
                continue
            tf = t.astype(jnp.float32)
            q = _qdq(rq, tf, kind, s)
            nz = (tf != 0) & jnp.isfinite(tf)
            under = jnp.sum(nz & (q == 0)) / jnp.maximum(jnp.sum(nz), 1)
            err = jnp.where(jnp.isfinite(tf) & jnp.isfinite(q), (tf - q) ** 2, 0.0)
            acc.add("max", "q_underflow", layer, under)
            acc.add("max", "q_mse", layer, jnp.sum(err) / max(tf.size, 1))
            if rq.stateful and s is not None:  # delayed scaling: the scale of past amaxes
                fmax = float(rq.fmt(kind).max)
                acc.add("min", "scaled_headroom", layer, _log2_headroom(fmax, _amax(tf) * s))
    if linear and g is not None and g.size:
        rows = lhs.shape[0]
        g2 = g.reshape(-1, g.shape[-1])
        if g2.shape[0] == rows:
            x32, g32 = lhs.astype(jnp.float32), g2.astype(jnp.float32)
            grad_w = x32.T @ g32  # (K, N), float32
            if replaced:
                qx = _qdq(rq, x32.T, "x", scales[0])
                qg = _qdq(rq, g32.T, "g", scales[2])
                grad_q = qx @ qg.T
            else:
                grad_q = _cast(grad_w, gdt)
            acc.add("min", "noise_ratio", layer, noise_ratio(grad_w, grad_q))


def _state_signals(
    acc: _Acc,
    state: _StepState,
    new_params: Any,
    g32: Any,
    opt: optax.GradientTransformation,
    predictors: Predictors,
    rq: Any,
    cd: np.dtype,
    seen_layers: list[str],
) -> None:
    """The signals of the params, gradients and update (no extra forward pass)."""
    layers = predictors.layers
    p_old = jax.tree_util.tree_flatten_with_path(state.params)[0]
    p_new = jax.tree_util.tree_leaves(new_params)
    grads = jax.tree_util.tree_leaves(g32)
    p32 = cast_floating(state.params, jnp.float32)
    updates, _ = opt.update(g32, state.opt_state, p32)
    ups = jax.tree_util.tree_leaves(updates)
    by_layer: dict[str, dict[str, Any]] = {}
    for (path, w0), w1, g, u in zip(p_old, p_new, grads, ups, strict=True):
        if not jnp.issubdtype(jnp.asarray(w0).dtype, jnp.floating):
            continue
        key = jax.tree_util.keystr(path)
        layer = _layer_of_param(key, layers) if layers else _top_key(key)
        if layer not in seen_layers:
            seen_layers.append(layer)
        a0, a1 = w0.astype(jnp.float32), w1.astype(jnp.float32)
        gf, uf = g.astype(jnp.float32), u.astype(jnp.float32)
        acc.add("sum", "grad_norm", layer, jnp.sum(gf * gf)[None])
        acc.add("sum", "update_ratio", layer, jnp.stack([jnp.sum(uf * uf), jnp.sum(a0 * a0)]))
        acc.add(
            "sum", "update_applied", layer, jnp.stack([jnp.sum((a1 - a0) ** 2), jnp.sum(uf * uf)])
        )
        if w0.ndim == 2:
            if rq is not None:  # the fprop layout: (out, in), contraction last
                q0, q1 = _qdq(rq, a0.T, "w", codes=True), _qdq(rq, a1.T, "w", codes=True)
            else:
                q0, q1 = _cast(a0, cd), _cast(a1, cd)
            flips = jnp.sum(q0 != q1, dtype=jnp.float32)
            acc.add("sum", "flip_rate", layer, jnp.stack([flips, jnp.float32(w0.size)]))
        if predictors.norm_format and any(
            fnmatch.fnmatchcase(key, p) for p in predictors.norm_params
        ):
            qa = fake_quant(a0, predictors.norm_format, axis=-1)
            acc.add("max", "ln_bias", layer, ln_weight_bias(a0, qa))
        by_layer.setdefault(layer, {})[key] = a0
    for layer, leaves in by_layer.items():
        for key, w in leaves.items():
            if key.endswith("['w_gate']"):
                up = leaves.get(key[: -len("['w_gate']")] + "['w_up']")
                if up is not None:
                    acc.add("max", "swiglu_align", layer, swiglu_alignment(w, up))


def _top_key(path: str) -> str:
    """A layer name from a param path without a layer map: its first key."""
    head = path.split("]")[0].lstrip("[").strip("'\"")
    return head or "other"


# --- host side ----------------------------------------------------------------------------


def run_meta(policy: Policy, params_dtype: Any, recipe: Any = None) -> dict[str, Any]:
    """What the forecaster needs to know about a run besides its rows: the compute and
    params dtypes, the recipe's name and its weights' element bits."""
    rq = None if recipe is None else recipe.recipe
    bits = 16
    if rq is not None:
        fmt = getattr(rq, "fmt", None)
        bits = 4 if rq.name == "nvfp4" else (fmt("w").bits if fmt is not None else 8)
    name = None
    if rq is not None:
        name = rq.name
        if rq.name == "mx":
            name = {4: "mxfp4", 6: "mxfp6", 8: "mxfp8"}.get(bits, "mx")
    return {
        "compute": str(np.dtype(policy.compute_dtype)),
        "params": str(np.dtype(params_dtype)),
        "recipe": name,
        "weight_bits": bits,
    }


def _num(v: Any) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


def predictor_row(values: dict[str, dict[str, Any]], step: int) -> dict[str, Any]:
    """One JSON row of a step's host predictor values: ``{"step", "layers": [...],
    "signals": {signal: [value per layer or None]}}`` (non-finite values are None)."""
    layers: list[str] = []
    for per in values.values():
        for layer in per:
            if layer not in layers:
                layers.append(layer)
    return {
        "step": step,
        "layers": layers,
        "signals": {
            s: [_num(values[s][layer]) if layer in values[s] else None for layer in layers]
            for s in values
        },
    }


class PredictorHook:
    """Calls ``callback(row)`` for every step record holding predictors (see
    :func:`predictor_row`), with the step's ``loss``, ``loss_scale``, ``skipped`` and
    ``grad_norm`` added, and ``meta`` (see :func:`run_meta`) when given."""

    def __init__(
        self, callback: Callable[[dict[str, Any]], None], meta: dict[str, Any] | None = None
    ) -> None:
        self.callback, self.meta = callback, meta

    def on_step(self, end: Any) -> None:
        row = end.record.get("predictors")
        if row is None:
            return
        out = dict(row)
        if self.meta is not None:
            out["meta"] = self.meta
        for k in ("loss", "loss_scale", "skipped", "grad_norm"):
            if k in end.record:
                out[k] = end.record[k]
        self.callback(out)

    def close(self) -> None:
        pass
