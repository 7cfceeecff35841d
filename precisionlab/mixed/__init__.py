"""Mixed precision: policies, loss scaling, storage precision, float32-kept ops, forced numerics.

Public API:

- :class:`Policy`, :func:`get_policy` (jmp syntax ``"p=f32,c=bf16,o=f32"``), ``FP32_OPS``.
- Loss scaling: :class:`NoLossScale`, :class:`StaticLossScale`, :class:`DynamicLossScale`
  (PyTorch GradScaler's rule), :func:`all_finite`, :func:`select_tree`,
  :func:`parse_loss_scale` (``"none" | "static:S" | "dynamic"``).
- Storage: :class:`Storage` (params / grads / opt_state dtypes, update rounding),
  :func:`store_opt_state` (any optax transformation), :func:`apply_updates`.
- Ops honouring the float32 list: ``ops.softmax``, ``ops.layer_norm``, ``ops.cross_entropy``, ...
- Numerics: :func:`enforce` forces the compute dtype's rounding and overflow at op boundaries.
- Models with non-array leaves (Equinox): :func:`filter_value_and_grad`, :func:`filter_jit`,
  :func:`is_inexact_array`;
  every function here that takes a model or gradients passes such leaves through.
"""

from precisionlab.mixed import ops
from precisionlab.mixed._filtering import filter_jit, filter_value_and_grad, is_inexact_array
from precisionlab.mixed._loss_scale import (
    LOSS_SCALE_KINDS,
    DynamicLossScale,
    LossScale,
    NoLossScale,
    StaticLossScale,
    all_finite,
    leaf_finite,
    nonfinite_leaf_names,
    parse_loss_scale,
    select_tree,
)
from precisionlab.mixed._numerics import enforce, enforce_tree
from precisionlab.mixed._policy import (
    DEFAULT_FP32_OPS,
    FP32_OPS,
    Policy,
    cast_floating,
    get_policy,
    parse_dtype,
)
from precisionlab.mixed._storage import (
    OPT_STATE_DTYPES,
    UPDATE_MODES,
    ScaledArray,
    Storage,
    StorageState,
    apply_updates,
    init_storage_state,
    round_to_storage,
    store_opt_state,
)

__all__ = [
    "DEFAULT_FP32_OPS",
    "FP32_OPS",
    "LOSS_SCALE_KINDS",
    "OPT_STATE_DTYPES",
    "UPDATE_MODES",
    "DynamicLossScale",
    "LossScale",
    "NoLossScale",
    "Policy",
    "ScaledArray",
    "StaticLossScale",
    "Storage",
    "StorageState",
    "all_finite",
    "apply_updates",
    "cast_floating",
    "enforce",
    "enforce_tree",
    "filter_jit",
    "filter_value_and_grad",
    "get_policy",
    "init_storage_state",
    "is_inexact_array",
    "leaf_finite",
    "nonfinite_leaf_names",
    "ops",
    "parse_dtype",
    "parse_loss_scale",
    "round_to_storage",
    "select_tree",
    "store_opt_state",
]
