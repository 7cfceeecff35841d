"""Plain-value configuration of a training run (one TOML table maps onto :class:`TrainConfig`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from precisionlab._schema import (
    FLOAT32_MAX,
    INT32_MAX,
    ConfigError,
    Field,
    coerce,
    validate_table,
    with_docs,
)
from precisionlab.mixed._loss_scale import LossScale, parse_loss_scale
from precisionlab.mixed._policy import FP32_OPS, Policy, get_policy, parse_dtype
from precisionlab.mixed._storage import Storage
from precisionlab.train._data import DATASETS, data_kind
from precisionlab.train._layers import REMAT_POLICIES, check_scan_options
from precisionlab.train._models import MODELS, layer_names, model_data_kind, resolve_layers
from precisionlab.train._optim import OPTIMIZER_FIELDS, OPTIMIZERS, SCHEDULES
from precisionlab.train._predictors import PREDICTOR_FIELDS, parse_predictors
from precisionlab.train._recipe import TrainRecipe, parse_recipe
from precisionlab.train._telemetry import TELEMETRY_FIELDS, parse_telemetry

__all__ = [
    "BATCH_SIZE_MAX",
    "DIVERGENCE_ACTIONS",
    "TRAIN_FIELDS",
    "UPDATE_ROUNDINGS",
    "Precision",
    "TrainConfig",
    "TrainResult",
    "check_loss_weight",
]

#: How updates are rounded into low-precision parameters.
UPDATE_ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "kahan")
#: What a run does when the loss diverges.
DIVERGENCE_ACTIONS: tuple[str, ...] = ("stop", "continue")
#: Largest batch accepted: a batch of the built-in data is at least 4 bytes x 2**24 = 64 MiB
#: per feature; beyond that it cannot be a laptop-scale experiment.
BATCH_SIZE_MAX = 2**24


def _parses(parse: Callable[[Any], object]) -> Callable[[Any], Any]:
    """A field's check: ``parse`` the value (its ValueError is the message) and keep the
    value as written (the config holds what the user wrote; the build parses it again)."""

    def check(value: Any) -> Any:
        parse(value)
        return value

    return check


_policy = _parses(get_policy)
_loss_scale_spec = _parses(parse_loss_scale)
_dtype = _parses(parse_dtype)
_recipe = _parses(parse_recipe)


def _telemetry(table: dict[str, Any]) -> dict[str, Any]:
    validate_table(table, TELEMETRY_FIELDS, "telemetry", defaults=False)
    return table


def _predictors(table: dict[str, Any]) -> dict[str, Any]:
    validate_table(table, PREDICTOR_FIELDS, "predictors", defaults=False)
    return table


def _steps(n: int, why: str = "the step counter is an int32") -> Field:
    return Field(int, n, low=0, high=INT32_MAX, why=why)


_F32 = "the float32 max"
#: The ``[train]`` keys: type, default, allowed values and range of every TrainConfig field.
#: Smallest ``loss_weight``: 2^-64 (see its field).
LOSS_WEIGHT_MIN = 2.0**-64

TRAIN_FIELDS: dict[str, Field] = {
    "model": Field(str, "mlp", choices=MODELS),
    "model_kwargs": Field(dict, {}),
    "data": Field(str, "teacher", choices=DATASETS),
    "data_kwargs": Field(dict, {}),
    "optimizer": Field(str, "adam", choices=OPTIMIZERS),
    "lr": Field(float, 1e-3, above=0.0, high=FLOAT32_MAX, why=_F32),
    "schedule": Field(str, "constant", choices=SCHEDULES),
    "warmup_steps": _steps(0),
    "weight_decay": Field(float, 0.0, low=0.0, high=FLOAT32_MAX, why=_F32),
    "grad_clip": Field(float, None, nullable=True, above=0.0, high=FLOAT32_MAX, why=_F32),
    "optimizer_kwargs": Field(dict, {}),
    "policy": Field(str, "p=f32,c=f32,o=f32", check=_policy),
    "fp32_ops": Field(list, None, item=str, choices=FP32_OPS, nullable=True),
    "loss_scale": Field(str, "none", check=_loss_scale_spec),
    "loss_scale_kwargs": Field(dict, {}),
    "params_dtype": Field(str, None, check=_dtype, nullable=True),
    "grads_dtype": Field(str, "float32", check=_dtype),
    "opt_state_dtype": Field(str, "float32"),
    "update_rounding": Field(str, "nearest", choices=UPDATE_ROUNDINGS),
    "enforce_numerics": Field(bool, True),
    # a name or a table: one Field type cannot say "str or table", the check does
    "recipe": Field(object, None, nullable=True, check=_recipe, doc="a recipe name or table"),
    "high_precision_layers": Field(list, [], item=str, doc="layer names or globs kept in float32"),
    "steps": Field(int, 500, low=1, high=INT32_MAX, why="the step counter is an int32"),
    "seed": Field(int, 0, low=0, high=2**32 - 1, why="a uint32 PRNG seed"),
    "batch_size": Field(int, 128, low=1, high=BATCH_SIZE_MAX, why="2**24"),
    "microbatches": Field(int, 1, low=1, high=BATCH_SIZE_MAX, why="2**24"),
    "eval_interval": _steps(0),
    "eval_batches": Field(int, 8, low=1, high=2**16, why="2**16"),
    "checkpoint_interval": _steps(0),
    "divergence_k": Field(float, None, nullable=True, above=1.0, high=FLOAT32_MAX, why=_F32),
    "divergence_action": Field(str, "stop", choices=DIVERGENCE_ACTIONS),
    "hist_interval": _steps(0),
    "shadow": Field(bool, False),
    "shadow_interval": _steps(0),
    "data_parallel": Field(bool, False),
    "allreduce_dtype": Field(str, None, check=_dtype, nullable=True),
    "zero_stage": Field(int, 0, choices=(0, 1, 2, 3), doc="ZeRO stage; needs data_parallel"),
    "remat": Field(bool, False),
    "scan_layers": Field(bool, False),
    "remat_every": Field(int, 0, low=0, high=2**16, why="2**16 layers"),
    "remat_policy": Field(str, "nothing_saveable", choices=REMAT_POLICIES),
    "report_leaves": Field(bool, False),
    "deterministic": Field(
        bool,
        False,
        doc="matmuls and sums in a fixed pairwise order: the same bits on any CPU, at a cost "
        "(precisionlab.train._deterministic)",
    ),
    "chunk_steps": Field(
        int,
        0,
        low=0,
        high=INT32_MAX,
        why="the step counter is an int32",
        doc="steps per compiled call (0: from the intervals; 1: one step per call)",
    ),
    "progress": Field(bool, None, nullable=True),
    "loss_weight": Field(
        float,
        1.0,
        # below 2^-64 (a loss averaged over 1.8e19 times more tokens) the weighted loss and
        # its gradients fall out of float32's normal range: every step records 0
        low=LOSS_WEIGHT_MIN,
        high=FLOAT32_MAX,
        why="the float32 max: it scales a float32 loss",
    ),
    "telemetry": Field(dict, None, nullable=True, check=_telemetry, doc="numerics telemetry"),
    "predictors": Field(dict, None, nullable=True, check=_predictors, doc="divergence predictors"),
}

# What each key means: the one description, shown by the experiment-file reference.
TRAIN_FIELDS = with_docs(
    TRAIN_FIELDS,
    {
        "model": "the built-in model (``MODELS``)",
        "model_kwargs": "the model's keyword arguments (see ``make_model``); its input and "
        "output sizes are taken from the data unless given",
        "data": "the built-in dataset (``DATASETS``)",
        "data_kwargs": "the dataset's keyword arguments (see ``make_data``)",
        "optimizer": "the optax optimizer (``OPTIMIZERS``)",
        "lr": "peak learning rate",
        "schedule": "learning-rate schedule (``SCHEDULES``)",
        "warmup_steps": "steps of linear warm-up to the peak rate",
        "weight_decay": "decoupled weight decay (adamw, sgd, lion; 0 = off)",
        "grad_clip": "global-norm gradient clip (off when absent)",
        "optimizer_kwargs": "extra keywords for the optax constructor (e.g. b1, b2, eps, "
        "momentum; see optimizer_kwargs below)",
        "policy": 'jmp-style precision policy, e.g. "p=f32,c=bf16,o=f32"',
        "fp32_ops": "ops kept in float32 (absent: the default list, "
        "``precisionlab.mixed.DEFAULT_FP32_OPS``)",
        "loss_scale": '"none", "static:S" or "dynamic"',
        "loss_scale_kwargs": "the loss scale's options: init_scale, growth_interval, "
        "backoff_factor, growth_factor, min_scale, max_scale, dtype",
        "params_dtype": "storage dtype of the params (absent: the policy's param dtype)",
        "grads_dtype": "dtype the gradients are stored in and handed to the optimizer in",
        "opt_state_dtype": 'optimizer-state storage: "float32", "bfloat16", "float16", '
        '"float8_e4m3fn" or "float8_e5m2" (fp8 with a per-tensor float32 scale)',
        "update_rounding": "how updates are applied to params stored below float32 "
        "(``UPDATE_ROUNDINGS``)",
        "enforce_numerics": "force the compute dtype's rounding and overflow at op boundaries "
        "(``lax.reduce_precision``), so CPU runs round where a GPU would (the policy's "
        "``Policy.enforce``)",
        "recipe": "a low-precision recipe for every matmul and convolution (off when absent): a "
        'name ("mxfp8", ``precisionlab.recipes.RECIPE_NAMES``) or a table with ``name``, the '
        "recipe's fields, ``include``/``exclude`` (positions, names, parameter paths, globs or "
        '"re:" regular expressions) and ``attention`` (true: the products of two activations, '
        "attention's QK^T and PV, too; default false, as Transformer Engine)",
        "high_precision_layers": 'layer names or glob patterns (["layer3", "block*"]) computed '
        "in float32 with float32 params and gradients, excluded from the recipe; a pattern "
        "matching no layer is an error",
        "steps": "training steps",
        "seed": "PRNG seed (parameters, data, stochastic rounding)",
        "batch_size": "examples per step",
        "microbatches": "gradient accumulation: micro-batches per step (must divide batch_size)",
        "eval_interval": "evaluate every N steps (0 = only at the end)",
        "eval_batches": "batches per evaluation",
        "checkpoint_interval": "checkpoint every N steps (0 = off; needs a checkpoint directory)",
        "divergence_k": "loss > k x running minimum (or non-finite) marks divergence (absent: "
        "only non-finite)",
        "divergence_action": 'on divergence: "stop" or "continue"',
        "hist_interval": "histograms of log2|grad| and log2|activation| every N steps (0 = off)",
        "shadow": "an fp32 shadow pass at histogram steps (or every shadow_interval steps)",
        "shadow_interval": "shadow pass every N steps when > 0",
        "data_parallel": "shard the batch over all local devices",
        "allreduce_dtype": "dtype of the gradient all-reduce (absent: float32)",
        "zero_stage": "ZeRO over the data-parallel devices (needs data_parallel): 1 shards the "
        "optimizer state, 2 also the gradients, 3 also the params",
        "remat": "``jax.checkpoint`` each model block",
        "scan_layers": "identical layers stacked under ``lax.scan`` (mlp, transformer)",
        "remat_every": "with scan_layers: checkpoint groups of K layers (0 = off): activation "
        "memory O(N/K) + O(K)",
        "remat_policy": "what a checkpointed group saves (``REMAT_POLICIES``)",
        "report_leaves": "name the non-finite gradient leaves of skipped steps",
        "progress": "tqdm progress bar (absent: only on a terminal)",
        "loss_weight": "multiplies the training loss before differentiation, as a loss "
        "averaged over 1/loss_weight times more tokens would; recorded and evaluated losses "
        "stay plain; 1.0 = off",
        "telemetry": "numerics telemetry (see [train.telemetry]); off when absent in Python, "
        "on by default in experiment files",
        "predictors": "per-layer divergence predictors every N steps (see "
        "[train.predictors] and ``precisionlab diagnose --forecast``); off when absent",
    },
)


#: The same fields without the parsing checks: a TrainConfig parses its policy, loss scale and
#: dtype names once, into :class:`Precision` (the checks in TRAIN_FIELDS serve the experiment
#: files' grids and overrides, validated before any config is made).
_TYPES_ONLY: dict[str, Field] = {
    k: dataclasses.replace(f, check=None) for k, f in TRAIN_FIELDS.items()
}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The precision objects a TrainConfig names, parsed once (when the config is made).

    policy: the Policy (with ``fp32_ops``; ``enforce`` from ``enforce_numerics``).
    loss_scale: the initial LossScale (a pytree).
    storage: dtypes of the stored params / grads / optimizer state and the update rounding.
    allreduce_dtype: dtype of the data-parallel gradient all-reduce (float32 by default).
    recipe: the low-precision matmul recipe (None: the policy's matmuls).
    """

    policy: Policy
    loss_scale: LossScale
    storage: Storage
    allreduce_dtype: np.dtype
    recipe: TrainRecipe | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything :func:`precisionlab.train.train` needs, as plain values.

    One field per key of an experiment file's ``[train]`` table, in the same order: its type,
    default, allowed values, range and meaning are declared once, in :data:`TRAIN_FIELDS`
    (the experiment-file reference of the documentation renders that table). The fields are
    grouped as model and data (model, data and their kwargs), optimizer (optimizer to
    optimizer_kwargs), precision (policy to high_precision_layers), loop (steps to progress),
    loss (loss_weight), telemetry and predictors. Making a config validates every field and
    parses the policy, loss scale, storage dtypes and recipe once into :attr:`precision`.
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
    recipe: str | dict[str, Any] | None = None
    # a list in the table (as TRAIN_FIELDS declares it), kept as a tuple once made
    high_precision_layers: tuple[str, ...] = dataclasses.field(default_factory=list)  # type: ignore[arg-type]
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
    zero_stage: int = 0
    remat: bool = False
    scan_layers: bool = False
    remat_every: int = 0
    remat_policy: str = "nothing_saveable"
    report_leaves: bool = False
    deterministic: bool = False
    chunk_steps: int = 0
    progress: bool | None = None
    loss_weight: float = 1.0
    telemetry: dict[str, Any] | None = None
    predictors: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # The one validation of a config: every field against TRAIN_FIELDS, then the rules that
        # join fields; the precision objects are parsed here once and kept (``.precision``).
        for name, field in _TYPES_ONLY.items():
            value = getattr(self, name)
            if name in ("fp32_ops", "high_precision_layers") and isinstance(value, tuple):
                value = list(value)
            coerce(value, field, name)
        if self.fp32_ops is not None:
            object.__setattr__(self, "fp32_ops", tuple(self.fp32_ops))
        object.__setattr__(self, "high_precision_layers", tuple(self.high_precision_layers))
        names = layer_names(self.model, self.model_kwargs)
        hp = resolve_layers(self.high_precision_layers, names, "high_precision_layers pattern")
        object.__setattr__(self, "_high_precision", hp)
        if self.batch_size % self.microbatches:
            raise ConfigError(
                f"batch_size {self.batch_size} is not divisible by microbatches {self.microbatches}"
            )
        if self.zero_stage and not self.data_parallel:
            raise ConfigError(
                f"zero_stage {self.zero_stage} shards over the data-parallel devices: it needs "
                "data_parallel = true"
            )
        if self.schedule != "constant" and self.steps <= self.warmup_steps:
            raise ConfigError(f"schedule {self.schedule!r} needs steps > warmup_steps")
        needs, has = model_data_kind(self.model), data_kind(self.data)
        if needs != has:
            raise ConfigError(
                f"model {self.model!r} needs a {needs} dataset, but data {self.data!r} is {has}; "
                f"allowed: {', '.join(d for d in DATASETS if data_kind(d) == needs)}"
            )
        self._check_scan()
        fields = OPTIMIZER_FIELDS[self.optimizer]
        validate_table(self.optimizer_kwargs, fields, "optimizer_kwargs", defaults=False)
        parse_telemetry(self.telemetry, self.steps)  # a ConfigError naming telemetry.KEY
        parse_predictors(self.predictors, self.steps)  # a ConfigError naming predictors.KEY
        object.__setattr__(self, "_precision", self._parse_precision())

    def _check_scan(self) -> None:
        # Checked here, not only when the model is built, so a bad file fails before any run.
        try:
            check_scan_options(
                scan=self.scan_layers,
                remat_every=self.remat_every,
                policy=self.remat_policy,
                remat=self.remat,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.scan_layers and self.model not in ("mlp", "transformer"):
            raise ConfigError(
                f"scan_layers: the {self.model!r} model's layers differ in shape; "
                "allowed: mlp, transformer"
            )
        if self.scan_layers and self.recipe is not None:
            raise ConfigError(
                "scan_layers with a recipe: a recipe scales each layer's matmuls separately "
                "(its sites and state are per layer), under scan one site serves all layers; "
                "use the unrolled layers"
            )

    def _parse_precision(self) -> Precision:
        def parse(key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"{key}: {str(err).splitlines()[0]}") from None

        for key in ("params_dtype", "grads_dtype", "allreduce_dtype"):
            if getattr(self, key) is not None:
                parse(key, parse_dtype, getattr(self, key))
        policy = parse("policy", get_policy, self.policy, fp32_ops=self.fp32_ops)
        if "enforce" in self.policy.lower():  # one key says it: the config's, not the string's
            raise ConfigError(
                f"policy: {self.policy!r} sets enforce; in a config say enforce_numerics = "
                f"{str(policy.enforce).lower()} instead"
            )
        policy = policy.with_enforce(self.enforce_numerics)
        key = "loss_scale_kwargs" if self.loss_scale_kwargs else "loss_scale"
        loss_scale = parse(key, parse_loss_scale, self.loss_scale, **self.loss_scale_kwargs)
        storage = parse(
            "opt_state_dtype",
            Storage,
            params=self.params_dtype,
            grads=self.grads_dtype,
            opt_state=self.opt_state_dtype,
            update=self.update_rounding,
        )
        red = np.float32 if self.allreduce_dtype is None else parse_dtype(self.allreduce_dtype)
        recipe = None if self.recipe is None else parse("recipe", parse_recipe, self.recipe)
        return Precision(
            policy=policy,
            loss_scale=loss_scale,
            storage=storage,
            allreduce_dtype=np.dtype(red),
            recipe=recipe,
        )

    @property
    def high_precision(self) -> tuple[str, ...]:
        """The layers ``high_precision_layers`` names (resolved, in program order)."""
        return self._high_precision  # type: ignore[attr-defined]

    @property
    def precision(self) -> Precision:
        """Policy, initial loss scale, storage and all-reduce dtype, parsed when made."""
        return self._precision  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, table: dict[str, Any], where: str = "train") -> TrainConfig:
        """Build from a TOML-like dict; an unknown key or bad value raises ValueError (a
        :class:`~precisionlab._schema.ConfigError`) naming ``where.key``."""
        values = validate_table(table, _TYPES_ONLY, where, defaults=False)
        if values.get("fp32_ops") is not None:
            values["fp32_ops"] = tuple(values["fp32_ops"])
        if "high_precision_layers" in values:
            values["high_precision_layers"] = tuple(values["high_precision_layers"])
        try:
            return cls(**values)
        except (ValueError, TypeError) as err:
            message = str(err).splitlines()[0]
            key = message.split(":")[0].split(".")[0]
            sep = "." if key in TRAIN_FIELDS else ": "
            raise ConfigError(f"{where}{sep}{message}") from err

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the inverse of :meth:`from_dict`)."""
        out = dataclasses.asdict(self)
        if out["fp32_ops"] is not None:
            out["fp32_ops"] = list(out["fp32_ops"])
        out["high_precision_layers"] = list(out["high_precision_layers"])
        return out


def check_loss_weight(value: Any) -> float:
    """``value`` if it is a valid ``TrainConfig.loss_weight`` (a number in [2^-64, largest
    float32]), else ValueError."""
    return coerce(value, TRAIN_FIELDS["loss_weight"], "loss_weight")


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
      recipe_metrics: with a recipe and ``hist_interval``: per tensor group (``x``
        activations, ``w`` weights, ``g`` output gradients) the mean over the histogram steps
        of ``saturated``, ``underflow`` and ``sqnr_db`` and the extremes of
        ``log2_scale_min`` / ``log2_scale_max`` (see :mod:`precisionlab.train._recipe_metrics`);
        None otherwise, and for the FP4 recipes (a warning says why).
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
    recipe_metrics: dict[str, dict[str, float]] | None = None

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (everything but ``state`` and ``metrics``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("state", "metrics")
        }
