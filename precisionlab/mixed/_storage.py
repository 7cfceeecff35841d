"""The precision of every stored tensor: params, gradients, optimizer state, and update rounding.

- :class:`Storage` names the dtypes: ``params`` (None: the policy's param dtype), ``grads``,
  ``opt_state`` (float32, bfloat16, float16, or float8_e4m3fn / float8_e5m2 stored with a
  per-tensor float32 scale) and ``update``: how an update is applied to params stored below
  float32 (``"nearest"``; ``"stochastic"`` rounding through ``precisionlab.bits``; ``"kahan"``:
  compensated summation with the compensation stored in the param dtype).
- :func:`store_opt_state` wraps any optax ``GradientTransformation`` so that its state is kept in
  ``opt_state`` dtype between steps and computed in float32 inside a step.
- :func:`apply_updates` adds float32 updates to stored params with the chosen rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab import bits
from precisionlab.mixed._policy import parse_dtype

__all__ = [
    "OPT_STATE_DTYPES",
    "UPDATE_MODES",
    "ScaledArray",
    "Storage",
    "StorageState",
    "apply_updates",
    "compress",
    "decompress",
    "init_storage_state",
    "round_to_storage",
    "store_opt_state",
]

#: How an update is applied to low-precision parameters.
UPDATE_MODES: tuple[str, ...] = ("nearest", "stochastic", "kahan")
#: The dtypes optimizer state may be stored in.
OPT_STATE_DTYPES: tuple[str, ...] = (
    "float32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
)
_FP8 = ("float8_e4m3fn", "float8_e5m2")
_F32 = np.dtype("float32")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Storage:
    """Storage dtypes of the training state (hashable: a static argument of ``jit``).

    Attributes:
      params: dtype params are stored in; None means the policy's ``param_dtype``.
      grads: dtype gradients are rounded to before the optimizer sees them.
      opt_state: dtype of the optimizer state's floating leaves (see :data:`OPT_STATE_DTYPES`).
      update: ``"nearest" | "stochastic" | "kahan"`` (matters only for params below float32).
    """

    params: str | None = None
    grads: str = "float32"
    opt_state: str = "float32"
    update: str = "nearest"

    def __post_init__(self) -> None:
        if self.params is not None:
            object.__setattr__(self, "params", parse_dtype(self.params).name)
        object.__setattr__(self, "grads", parse_dtype(self.grads).name)
        opt = parse_dtype(self.opt_state).name
        if opt not in OPT_STATE_DTYPES:
            raise ValueError(
                f"opt_state dtype {self.opt_state!r} not supported; allowed: "
                f"{', '.join(OPT_STATE_DTYPES)}"
            )
        object.__setattr__(self, "opt_state", opt)
        if self.update not in UPDATE_MODES:
            raise ValueError(
                f"unknown update rounding {self.update!r}; allowed: {', '.join(UPDATE_MODES)}"
            )

    def param_dtype(self, policy_param_dtype: Any) -> np.dtype:
        """The storage dtype of params given the policy's param dtype."""
        if self.params is None:
            return np.dtype(policy_param_dtype)
        return np.dtype(getattr(jnp, self.params))

    @property
    def grads_dtype(self) -> np.dtype:
        """``grads`` as a numpy dtype (the fields hold canonical names, parsed when made)."""
        return np.dtype(getattr(jnp, self.grads))

    @property
    def opt_state_dtype(self) -> np.dtype:
        """``opt_state`` as a numpy dtype."""
        return np.dtype(getattr(jnp, self.opt_state))


class ScaledArray(NamedTuple):
    """A tensor stored as ``values * scale`` (values in fp8, scale a float32 scalar)."""

    values: jax.Array
    scale: jax.Array


class StorageState(NamedTuple):
    """Per-param state of the update rule: Kahan compensation (param dtype) or None."""

    compensation: Any


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _values(tree: Any) -> Any:
    """``tree`` with its non-array leaves (an Equinox module's activation function, its
    Python numbers) replaced by None, as ``eqx.filter(model, eqx.is_array)`` gives a model to
    an optax transformation (which cannot make zeros of a function)."""

    def keep(x: Any) -> Any:
        return x if hasattr(x, "dtype") and hasattr(x, "shape") else None

    return jax.tree_util.tree_map(keep, tree)


def compress(tree: Any, dtype: Any) -> Any:
    """Store the floating leaves of ``tree`` in ``dtype`` (fp8: as :class:`ScaledArray` with a
    per-tensor scale mapping the largest finite magnitude to the format's max; NaN and inf do
    not set it)."""
    dt = parse_dtype(dtype)
    if dt.name in _FP8:
        fmax = float(jnp.finfo(dt).max)

        def to_fp8(x: Any) -> Any:
            if not _is_float(x) or x.ndim == 0:
                return x
            xf = x.astype(jnp.float32)
            # The largest finite magnitude, taken on the bits: XLA's CPU float max reduce
            # drops NaN only on larger arrays (openxla/xla#21461), so a float reduce would make
            # the scale depend on the array's size when a leaf holds NaN.
            b = jax.lax.bitcast_convert_type(xf, jnp.uint32) & np.uint32(0x7FFFFFFF)
            b = jnp.where(b < np.uint32(0x7F800000), b, np.uint32(0))
            amax = jax.lax.bitcast_convert_type(jnp.max(b), jnp.float32)
            scale = jnp.where((amax > 0) & jnp.isfinite(amax), amax / fmax, 1.0).astype(jnp.float32)
            return ScaledArray((xf / scale).astype(dt), scale)

        return jax.tree_util.tree_map(to_fp8, tree)
    # Scalars (step counts, learning rates of inject_hyperparams) stay as they are.
    return jax.tree_util.tree_map(
        lambda x: x.astype(dt) if _is_float(x) and jnp.ndim(x) > 0 else x, tree
    )


def decompress(tree: Any, dtype: Any = jnp.float32) -> Any:
    """Inverse of :func:`compress`: floating leaves (and ScaledArrays) back to ``dtype``."""

    def back(x: Any) -> Any:
        if isinstance(x, ScaledArray):
            return (x.values.astype(jnp.float32) * x.scale).astype(dtype)
        return x.astype(dtype) if _is_float(x) else x

    return jax.tree_util.tree_map(back, tree, is_leaf=lambda x: isinstance(x, ScaledArray))


def store_opt_state(
    optimizer: optax.GradientTransformation, dtype: Any
) -> optax.GradientTransformation:
    """Wrap ``optimizer`` so its state is stored in ``dtype`` between steps.

    Inside ``update`` the state is decompressed to float32, the wrapped optimizer runs in float32
    on float32 gradients and params, and the new state is compressed again. Scalars (step counts,
    per-tensor statistics) stay as they are. float32 keeps the state as the optimizer makes it.

    Params and updates may be a whole model: its non-array leaves (an Equinox module's
    activation function, its Python numbers) reach the optimizer as None, as
    ``eqx.filter(model, eqx.is_array)`` would give them (their updates are None).
    """
    dt = parse_dtype(dtype)
    if dt == _F32:

        def init32(params: Any) -> Any:
            return optimizer.init(_values(params))

        def update32(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
            params = None if params is None else _values(params)
            return optimizer.update(_values(updates), state, params, **extra)

        return optax.GradientTransformationExtraArgs(init32, update32)

    def init(params: Any) -> Any:
        return compress(optimizer.init(decompress(_values(params))), dt)

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        updates32 = decompress(_values(updates))
        params32 = None if params is None else decompress(_values(params))
        new_updates, new_state = optimizer.update(updates32, decompress(state), params32, **extra)
        return new_updates, compress(new_state, dt)

    return optax.GradientTransformationExtraArgs(init, update)


def init_storage_state(params: Any, update: str) -> StorageState:
    """Initial :class:`StorageState` for ``update`` mode (zeros compensation for Kahan)."""
    if update not in UPDATE_MODES:
        raise ValueError(f"unknown update rounding {update!r}; allowed: {', '.join(UPDATE_MODES)}")
    if update == "kahan":
        return StorageState(
            jax.tree_util.tree_map(lambda p: jnp.zeros_like(p) if _is_float(p) else None, params)
        )
    return StorageState(None)


def round_to_storage(
    x: jax.Array, dtype: Any, *, rounding: str = "nearest", key: jax.Array | None = None
) -> jax.Array:
    """Round float32 ``x`` to ``dtype`` by nearest-even or stochastic rounding; returns ``dtype``.

    Stochastic rounding uses ``precisionlab.bits.encode(..., rounding="stochastic", key=key)``: the
    result is one of the two neighbours of ``x`` in ``dtype``, the upper one with probability
    proportional to the distance from the lower one (unbiased).
    """
    dt = np.dtype(dtype)
    if dt.itemsize >= 4 or rounding == "nearest":
        return x.astype(dt)
    if rounding != "stochastic":
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    if key is None:
        raise ValueError("stochastic rounding needs a PRNG key")

    return bits.round_to_format(
        x.astype(jnp.float32), dt.name, rounding="stochastic", key=key
    ).astype(dt)


def apply_updates(
    params: Any,
    updates: Any,
    state: StorageState,
    *,
    update: str = "nearest",
    key: jax.Array | None = None,
) -> tuple[Any, StorageState]:
    """Apply float32 ``updates`` to ``params`` (any storage dtype) with the chosen rounding.

    - nearest: ``round_nearest(p + u)`` (p + u computed in float32, rounded once).
    - stochastic: ``round_stochastic(p + u)``; one key per leaf from ``key``.
    - kahan: ``y = u - c; t = round(p + y); c = round((t - p) - y); p = t`` with float32
      arithmetic and ``c`` stored in the param dtype (Zamirai et al. 2020).

    Params at float32 or wider are updated as ``p + u`` whatever the mode. Leaves that are not
    floating arrays (an Equinox module's activation function) and leaves whose update is None
    (``eqx.filter_grad``'s gradient of a non-array leaf) are returned as they are.
    Returns the new params (same dtypes) and storage state.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    ups = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]  # PyTreeDef: no stub
    if update == "kahan":
        comps = treedef.flatten_up_to(state.compensation)  # type: ignore[attr-defined]  # no stub
    else:
        comps = [None] * len(leaves)
    if update == "stochastic":
        if key is None:
            raise ValueError("stochastic update rounding needs a PRNG key")
        keys = list(jax.random.split(key, max(len(leaves), 1)))
    new_p, new_c = [], []
    for i, (p, u, c) in enumerate(zip(leaves, ups, comps, strict=True)):
        if not _is_float(p) or u is None:  # a static leaf, or one the update leaves alone
            new_p.append(p)
            new_c.append(c)
            continue
        dt = p.dtype
        wide = jnp.promote_types(dt, _F32)
        pf, uf = p.astype(wide), u.astype(wide)
        if np.dtype(dt).itemsize >= 4:
            new_p.append((pf + uf).astype(dt))
            new_c.append(c)
        elif update == "nearest":
            new_p.append((pf + uf).astype(dt))
            new_c.append(c)
        elif update == "stochastic":
            new_p.append(round_to_storage(pf + uf, dt, rounding="stochastic", key=keys[i]))
            new_c.append(c)
        elif update == "kahan":
            y = uf - c.astype(wide)
            t = (pf + y).astype(dt)
            new_c.append(((t.astype(wide) - pf) - y).astype(dt))
            new_p.append(t)
        else:
            raise ValueError(f"unknown update rounding {update!r}; allowed: {UPDATE_MODES}")
    new_state = StorageState(
        jax.tree.unflatten(treedef, new_c) if update == "kahan" else state.compensation
    )
    return jax.tree.unflatten(treedef, new_p), new_state
