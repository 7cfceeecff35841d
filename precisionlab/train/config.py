"""Plain-value configuration of a training run (one TOML table maps onto :class:`TrainConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "DIVERGENCE_ACTIONS",
    "UPDATE_ROUNDINGS",
    "TrainConfig",
    "TrainResult",
    "check_loss_weight",
]

UPDATE_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "kahan")
DIVERGENCE_ACTIONS: tuple[str, ...] = ("stop", "continue")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything :func:`precisionlab.train.train` needs, as plain values.

    Model and data:
      model: a name in ``MODELS`` ("mlp", "transformer"); model_kwargs: its keyword arguments
        (see ``make_model``). data: a name in ``DATASETS``; data_kwargs: its keyword arguments
        (see ``make_data``). The model's input/output sizes are taken from the data unless given.
    Optimizer:
      optimizer: a name in ``OPTIMIZERS``; lr: peak learning rate; schedule: a name in
      ``SCHEDULES``; warmup_steps; weight_decay (decoupled, for adamw/sgd/lion; 0 = off);
      grad_clip: global-norm clip (None = off); optimizer_kwargs: extra keywords for the optax
      constructor (e.g. b1, b2, eps, momentum).
    Precision:
      policy: jmp-style policy string ("p=f32,c=bf16,o=f32"); fp32_ops: ops kept in float32
        (None = the default list, see ``precisionlab.mixed.FP32_OPS``).
      loss_scale: "none" | "static:S" | "dynamic"; loss_scale_kwargs: e.g. init_scale,
        growth_interval, backoff_factor, growth_factor, min_scale, max_scale, dtype.
      params_dtype: storage dtype of the params (None = the policy's param dtype);
      grads_dtype: dtype the gradients are stored/handed to the optimizer in;
      opt_state_dtype: "float32" | "bfloat16" | "float16" | "float8_e4m3fn" | "float8_e5m2"
        (fp8 stored with a per-tensor float32 scale);
      update_rounding: how updates are applied to params stored below float32: one of
        ``UPDATE_ROUNDINGS``.
      enforce_numerics: force the compute dtype's rounding and overflow at op boundaries
        (``lax.reduce_precision``), so CPU runs round where a GPU would.
    Loop:
      steps, seed, batch_size, microbatches (gradient accumulation; batch_size must divide),
      eval_interval (0 = only at the end), eval_batches, checkpoint_interval (0 = off; needs a
      checkpoint_dir), divergence_k (loss > k * running min, or non-finite, marks divergence;
      None = only non-finite), divergence_action ("stop" | "continue"), hist_interval (0 = off:
      histograms of log2|grad| and log2|activation| every N steps), shadow (fp32 shadow pass at
      hist steps, or every ``shadow_interval`` steps if > 0), data_parallel (shard the batch over
      all local devices), allreduce_dtype (dtype of the gradient all-reduce, None = float32),
      remat (jax.checkpoint each model block), report_leaves (name the non-finite gradient
      leaves of skipped steps), progress (tqdm bar; None = only on a tty).
    Loss:
      loss_weight: multiplies the training loss before differentiation, as a loss averaged over
        1/loss_weight times more tokens would (this puts a small model's gradients where a large
        model's are, e.g. below float16's range; Adam is invariant to it up to its ``eps``);
        recorded losses (per-step ``loss``, ``final_loss``) stay the plain loss; evaluation uses
        the plain loss. 1.0 = off (bitwise the unweighted run).
    """

    model: str = "mlp"
    model_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: str = "teacher"
    data_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: str = "adam"
    lr: float = 1e-3
    schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float | None = None
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    policy: str = "p=f32,c=f32,o=f32"
    fp32_ops: tuple[str, ...] | None = None
    loss_scale: str = "none"
    loss_scale_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    params_dtype: str | None = None
    grads_dtype: str = "float32"
    opt_state_dtype: str = "float32"
    update_rounding: str = "nearest"
    enforce_numerics: bool = True
    steps: int = 500
    seed: int = 0
    batch_size: int = 128
    microbatches: int = 1
    eval_interval: int = 0
    eval_batches: int = 8
    checkpoint_interval: int = 0
    divergence_k: float | None = None
    divergence_action: str = "stop"
    hist_interval: int = 0
    shadow: bool = False
    shadow_interval: int = 0
    data_parallel: bool = False
    allreduce_dtype: str | None = None
    remat: bool = False
    report_leaves: bool = False
    progress: bool | None = None
    loss_weight: float = 1.0

    def __post_init__(self) -> None:
        from precisionlab.train.validate import validate_config

        validate_config(self)
        check_loss_weight(self.loss_weight)

    @classmethod
    def from_dict(cls, table: dict[str, Any], where: str = "train") -> TrainConfig:
        """Build from a TOML-like dict; an unknown key raises ValueError naming ``where.key``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - names)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}"
            )
        kw = dict(table)
        if kw.get("fp32_ops") is not None:
            kw["fp32_ops"] = tuple(kw["fp32_ops"])
        try:
            return cls(**kw)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{where}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the inverse of :meth:`from_dict`)."""
        out = dataclasses.asdict(self)
        if out["fp32_ops"] is not None:
            out["fp32_ops"] = list(out["fp32_ops"])
        return out


def check_loss_weight(value: Any) -> float:
    """``value`` if it is a valid ``TrainConfig.loss_weight`` (a finite number > 0), else
    ValueError."""
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
    if not ok:
        raise ValueError(f"loss_weight must be a finite number > 0, got {value!r}")
    return value


@dataclasses.dataclass(kw_only=True)
class TrainResult:
    """What :func:`precisionlab.train.train` returns.

    Attributes:
      state: the final ``TrainState`` (params in storage dtype, optimizer state, loss scale...).
      steps_done: number of steps run (< config.steps if stopped on divergence).
      final_loss: training loss of the last step (float; may be nan/inf; the plain loss, not
        multiplied by ``loss_weight``).
      eval_loss, eval_metric: last evaluation (metric: accuracy for both built-in models).
      evals: every evaluation, as dicts {step, eval_loss, eval_metric}.
      skipped_steps: count of steps skipped on non-finite gradients.
      diverged, divergence_step: divergence detection outcome (step is None when not diverged).
      min_loss_scale, max_loss_scale: extremes of the loss scale over the run.
      mean_underflow_fraction: mean over steps of the underflow meter.
      wall_time_s: wall-clock seconds of the loop (this process only).
      metrics: per-step metric dicts (the same dicts the callback received).
    """

    state: Any
    steps_done: int
    final_loss: float
    eval_loss: float | None
    eval_metric: float | None
    evals: list[dict[str, Any]]
    skipped_steps: int
    diverged: bool
    divergence_step: int | None
    min_loss_scale: float
    max_loss_scale: float
    mean_underflow_fraction: float
    wall_time_s: float
    metrics: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (everything but ``state`` and ``metrics``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("state", "metrics")
        }
