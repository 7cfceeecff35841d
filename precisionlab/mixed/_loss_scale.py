"""Loss scaling as pytrees, updated inside ``jit`` without a host round trip.

Three scales share one interface: ``.loss_scale`` (the current scale, an array), ``.scale(tree)``,
``.unscale(tree)`` and ``.adjust(grads_finite) -> new instance``.

:class:`DynamicLossScale` follows PyTorch's ``GradScaler`` rule exactly (``_amp_update_scale_``):
a step with any non-finite gradient is skipped, the scale is multiplied by ``backoff_factor`` and
the growth counter reset; otherwise the counter grows, and when it reaches ``growth_interval`` the
scale is multiplied by ``growth_factor`` (kept only if the product is finite in the scale's dtype)
and the counter reset. ``min_scale`` / ``max_scale`` clamp the scale (jmp's floor of 1 is
``min_scale=1.0``).

The one default that differs from GradScaler's: ``min_scale`` is the smallest normal number of
the scale's dtype (2^-126 in float32, 2^-14 in float16), not none. GradScaler's scale, after about
150 consecutive overflowing steps from 2^16, halves into the subnormals and then to exactly 0,
where no growth can lift it (0 x 2 = 0): the run silently trains on zero gradients for ever.
Every value above that floor is GradScaler's bit for bit; ``min_scale=None`` gives GradScaler
exactly, collapse included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed._policy import parse_dtype

__all__ = [
    "LOSS_SCALE_KINDS",
    "DynamicLossScale",
    "LossScale",
    "NoLossScale",
    "StaticLossScale",
    "all_finite",
    "leaf_finite",
    "nonfinite_leaf_names",
    "parse_loss_scale",
    "select_tree",
]

T = TypeVar("T")
#: The loss-scale kinds a config names (``static`` also as a number).
LOSS_SCALE_KINDS: tuple[str, ...] = ("none", "static", "dynamic")


def _scale_dtype(dtype: Any) -> np.dtype:
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"loss scale dtype must be floating, got {dtype.name}")
    return dtype


def _work_dtype(x: jax.Array, scale: jax.Array) -> np.dtype:
    # Multiply in the wider of the two dtypes so a float16 scale on float32 grads loses nothing.
    return jnp.promote_types(jnp.promote_types(x.dtype, scale.dtype), np.float32)


def _scale_leaf(x: Any, scale: jax.Array) -> Any:
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    wide = _work_dtype(x, scale)
    return (x.astype(wide) * scale.astype(wide)).astype(x.dtype)


def _unscale_leaf(x: Any, scale: jax.Array) -> Any:
    if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)):
        return x
    wide = _work_dtype(x, scale)
    return (x.astype(wide) / scale.astype(wide)).astype(x.dtype)


def _registered(*data_fields: str) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as a pytree: ``data_fields`` are its (traced) leaves, every other
    field is static (part of the treedef). Derived from the dataclass's fields, so no field can
    be forgotten through ``jit`` (jmp's hand-written flatten drops ``min_loss_scale``)."""

    def register(cls: type[T]) -> type[T]:
        fields = dataclasses.fields(cast(Any, cls))  # a dataclass: what it registers
        meta = [f.name for f in fields if f.name not in data_fields]
        return jax.tree_util.register_dataclass(
            cls, data_fields=list(data_fields), meta_fields=meta
        )

    return register


class LossScale:
    """Interface shared by the loss scales (a base class for isinstance checks only).

    The scales are frozen dataclasses registered as pytrees. Their constructors check the values
    a user gives; JAX rebuilds a pytree (after ``jit``, ``tree_map``...) through the same
    constructor with ``_trusted=True``, which takes the fields as they are: a rebuilt state is
    not re-checked (a collapsed dynamic scale may legitimately reach 0).
    """

    loss_scale: jax.Array

    def scale(self, tree: T) -> T:
        """Multiply every floating leaf by the scale (in at least float32; dtype preserved)."""
        return jax.tree_util.tree_map(lambda x: _scale_leaf(x, self.loss_scale), tree)

    def unscale(self, tree: T) -> T:
        """Divide every floating leaf by the scale (in at least float32; dtype preserved)."""
        return jax.tree_util.tree_map(lambda x: _unscale_leaf(x, self.loss_scale), tree)

    def adjust(self, grads_finite: jax.Array) -> LossScale:  # pragma: no cover - interface
        raise NotImplementedError


def _set(obj: Any, **fields: Any) -> None:
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


@_registered()
@dataclasses.dataclass(frozen=True, eq=False)
class NoLossScale(LossScale):
    """No scaling: ``scale`` and ``unscale`` return the tree unchanged; ``loss_scale`` is 1."""

    dtype: Any = np.float32

    def __post_init__(self) -> None:
        _set(self, dtype=_scale_dtype(self.dtype))

    @property
    def loss_scale(self) -> jax.Array:  # type: ignore[override]
        return jnp.ones((), self.dtype)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoLossScale:
        del grads_finite
        return self

    def __repr__(self) -> str:
        return f"NoLossScale(dtype={self.dtype.name})"


@_registered("loss_scale")
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale(LossScale):
    """A fixed scale ``s`` (an array of ``dtype``; must be finite and > 0 in that dtype)."""

    loss_scale: jax.Array
    _trusted: bool = False

    def __init__(self, loss_scale: Any, dtype: Any = jnp.float32, *, _trusted: bool = False):
        if _trusted:  # JAX rebuilding the pytree: the fields as they are
            _set(self, loss_scale=loss_scale, _trusted=True)
            return
        dtype = _scale_dtype(dtype)
        # Check every concrete value (numbers and arrays alike); only a traced scale, built
        # inside jit, cannot be checked here.
        if not isinstance(loss_scale, jax.core.Tracer):
            if isinstance(loss_scale, bool) or np.ndim(loss_scale) != 0:
                raise ValueError(f"static loss scale must be a scalar number, got {loss_scale!r}")
            with np.errstate(over="ignore"):
                cast = float(np.asarray(loss_scale).astype(dtype))
            if not (math.isfinite(cast) and cast > 0):
                raise ValueError(
                    f"static loss scale must be finite and > 0 in {dtype.name}, got {loss_scale!r}"
                )
        _set(self, loss_scale=jnp.asarray(loss_scale, dtype), _trusted=True)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite
        return self

    def __repr__(self) -> str:
        return f"StaticLossScale({self.loss_scale!r})"


def _checked_dynamic(
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    min_scale: Any,
    max_scale: Any,
    dtype: np.dtype,
) -> float | None:
    """ValueError unless the dynamic scale's options are valid; returns ``min_scale`` as a
    number or None (``"normal"``: the smallest normal number of ``dtype``, never 0)."""
    if isinstance(min_scale, str):
        if min_scale != "normal":
            raise ValueError(f"min_scale must be a number, 'normal' or None, got {min_scale!r}")
        min_scale = float(jnp.finfo(dtype).tiny)
    if not float(growth_factor) > 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
    if not 0.0 < float(backoff_factor) < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if (
        isinstance(growth_interval, bool)
        or not isinstance(growth_interval, int | np.integer)
        or int(growth_interval) < 1
    ):
        raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
    for name, value in (("min_scale", min_scale), ("max_scale", max_scale)):
        if value is not None and not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"{name} must be finite and > 0 or None, got {value!r}")
    if min_scale is not None and max_scale is not None and float(min_scale) > float(max_scale):
        raise ValueError(f"min_scale {min_scale!r} > max_scale {max_scale!r}")
    return min_scale


def _initial_scale(init_scale: Any, dtype: np.dtype) -> jax.Array:
    """``init_scale`` as a scalar of ``dtype``; ValueError unless finite and > 0 there."""
    with np.errstate(over="ignore"):
        init = float(np.asarray(init_scale, dtype))
    if not (math.isfinite(init) and init > 0):
        raise ValueError(
            f"init_scale must be finite and > 0 in {dtype.name}, got {init_scale!r}"
            + (" (float16 holds at most 65504)" if dtype == np.float16 else "")
        )
    return jnp.asarray(init_scale, dtype)


@_registered("loss_scale", "counter")
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale(LossScale):
    """PyTorch GradScaler's dynamic loss scale, as a pytree.

    Args:
      init_scale: initial scale; must be finite in ``dtype``.
      growth_factor: factor (> 1) applied after ``growth_interval`` consecutive finite steps.
      backoff_factor: factor (in (0, 1)) applied on a step with a non-finite gradient.
      growth_interval: consecutive finite steps before growing (an int >= 1, not a bool).
      min_scale, max_scale: clamps of the scale (None: unclamped, as in PyTorch). The default
        ``min_scale="normal"`` is the smallest normal number of ``dtype``, so the scale never
        decays to 0 (see the module docstring).
      dtype: dtype of the scale array (float32 by default; float16 works).

    Data fields (traced): ``loss_scale`` (scalar of ``dtype``), ``counter`` (int32 scalar: finite
    steps since the last change). The other fields are static (part of the treedef).
    """

    loss_scale: jax.Array
    counter: jax.Array
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float | None
    max_scale: float | None
    _trusted: bool

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | str | None = "normal",
        max_scale: float | None = None,
        dtype: Any = jnp.float32,
        *,
        loss_scale: Any = None,
        counter: Any = None,
        _trusted: bool = False,
    ):
        # JAX rebuilding the pytree (or dataclasses.replace) passes the fields as they are:
        # only a user's call is checked and starts from init_scale.
        if not _trusted:
            dtype = _scale_dtype(dtype)
            min_scale = _checked_dynamic(growth_factor, backoff_factor, growth_interval,
                                         min_scale, max_scale, dtype)  # fmt: skip
            loss_scale = _initial_scale(init_scale, dtype)
            counter = jnp.zeros((), jnp.int32)
        _set(
            self,
            loss_scale=loss_scale,
            counter=counter,
            growth_factor=float(growth_factor),
            backoff_factor=float(backoff_factor),
            growth_interval=int(growth_interval),
            min_scale=None if min_scale is None else float(min_scale),
            max_scale=None if max_scale is None else float(max_scale),
            _trusted=True,
        )
        if not _trusted and (self.min_scale is not None or self.max_scale is not None):
            _set(self, loss_scale=self._clamp(self.loss_scale))

    def _clamp(self, s: jax.Array) -> jax.Array:
        # Clamp in float32 so a bound beyond the scale dtype's range (2**20 in float16) is inert.
        wide = jnp.promote_types(s.dtype, jnp.float32)
        x = s.astype(wide)
        if self.min_scale is not None:
            x = jnp.maximum(x, jnp.asarray(self.min_scale, wide))
        if self.max_scale is not None:
            x = jnp.minimum(x, jnp.asarray(self.max_scale, wide))
        return x.astype(s.dtype)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """The next scale after a step whose gradients were (not) all finite. Jittable."""
        s = self.loss_scale
        grads_finite = jnp.asarray(grads_finite, bool)
        grown = s * jnp.asarray(self.growth_factor, s.dtype)
        backed = s * jnp.asarray(self.backoff_factor, s.dtype)
        counter = self.counter + 1
        at_interval = counter >= self.growth_interval
        new_scale = jnp.where(
            grads_finite,
            jnp.where(at_interval & jnp.isfinite(grown), grown, s),
            backed,
        )
        new_counter = jnp.where(grads_finite & ~at_interval, counter, 0).astype(jnp.int32)
        return dataclasses.replace(self, loss_scale=self._clamp(new_scale), counter=new_counter)

    def __repr__(self) -> str:
        return (
            f"DynamicLossScale(loss_scale={self.loss_scale!r}, counter={self.counter!r}, "
            f"growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}, "
            f"growth_interval={self.growth_interval}, min_scale={self.min_scale}, "
            f"max_scale={self.max_scale})"
        )


def _floating_leaf(x: Any) -> bool:
    """A floating array leaf; functions, Python numbers and other static leaves of a model (an
    Equinox module's activation, a max pool's ``init``) are not, as ``eqx.is_array`` says."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and not isinstance(x, type) and jnp.issubdtype(dtype, jnp.floating)


def leaf_finite(tree: Any) -> list[jax.Array]:
    """One boolean scalar per floating array leaf (in ``tree_leaves`` order): all elements
    finite. Other leaves (an Equinox module's functions, Python numbers) are skipped."""
    return [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree) if _floating_leaf(x)]


def all_finite(tree: Any) -> jax.Array:
    """Boolean scalar: every element of every floating leaf is finite (True for no leaves)."""
    flags = leaf_finite(tree)
    if not flags:
        return jnp.asarray(True)
    return jnp.stack(flags).all()


def nonfinite_leaf_names(tree: Any, flags: Any) -> list[str]:
    """Host-side: key paths (``"['w1']"``-style strings) of the floating leaves whose flag is
    False; ``flags`` is the (fetched) output of :func:`leaf_finite` on ``tree``."""
    paths = [
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if _floating_leaf(x)
    ]
    return [p for p, ok in zip(paths, np.asarray(flags).reshape(-1), strict=True) if not ok]


_NUMBERS = (bool, int, float, complex)


def _selectable(x: Any) -> bool:
    """A leaf ``jnp.where`` can choose: an array (or tracer) or a Python number."""
    if isinstance(x, _NUMBERS):
        return True
    return hasattr(x, "dtype") and hasattr(x, "shape") and not isinstance(x, type)


def select_tree(pred: jax.Array, on_true: T, on_false: T) -> T:
    """Leafwise ``jnp.where(pred, on_true, on_false)`` for a boolean scalar ``pred``.

    Array leaves are selected; other leaves (an Equinox module's activation function, a
    string, a size) pass through and must be equal in both trees, as a traced ``pred`` cannot
    choose between them (a ValueError names the first that differs). Python numbers equal in
    both trees pass through as they are.
    """
    pred = jnp.asarray(pred)
    if pred.shape != () or pred.dtype != bool:
        raise ValueError(f"pred must be a boolean scalar, got {pred.dtype}{list(pred.shape)}")

    def pick(path: Any, a: Any, b: Any) -> Any:
        if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS) and a == b:
            return a  # the leaf as it is (an Equinox hyperparameter stays a Python number)
        if _selectable(a) and _selectable(b):
            return jnp.where(pred, a, b)
        if a is b or _static_equal(a, b):
            return a
        raise ValueError(
            f"select_tree: the non-array leaf at {jax.tree_util.keystr(path) or 'the root'} "
            f"differs between on_true ({a!r}) and on_false ({b!r}); a traced predicate chooses "
            "between arrays only"
        )

    return jax.tree_util.tree_map_with_path(pick, on_true, on_false)


def _static_equal(a: Any, b: Any) -> bool:
    if _selectable(a) or _selectable(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a bool
        return False


def parse_loss_scale(spec: str | LossScale, **kwargs: Any) -> LossScale:
    """Build a loss scale from a spec string.

    ``"none"`` -> NoLossScale; ``"static:S"`` (or ``"static"`` with ``scale=S``) ->
    StaticLossScale(S); ``"dynamic"`` -> DynamicLossScale(**kwargs) (``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``min_scale``, ``max_scale``,
    ``dtype``). ``S`` may be written ``65536``, ``2**16`` or ``2^16``.
    """
    if isinstance(spec, LossScale):
        if kwargs:
            raise ValueError("keyword arguments need a spec string, not a LossScale instance")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"loss-scale spec must be a string, got {type(spec).__name__}")
    kind, _, arg = spec.strip().lower().partition(":")
    kind = kind.strip()
    dtype = kwargs.pop("dtype", jnp.float32)
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if kind == "none":
        if arg or kwargs:
            raise ValueError(f"loss scale 'none' takes no arguments, got {spec!r} {kwargs}")
        return NoLossScale(dtype)
    if kind == "static":
        if arg and "scale" in kwargs:
            raise ValueError(f"static scale given twice: {spec!r} and scale={kwargs['scale']!r}")
        unknown = set(kwargs) - {"scale"}
        if unknown:
            raise ValueError(f"unknown static loss-scale options {sorted(unknown)}; allowed: scale")
        value = arg.strip() if arg else kwargs.get("scale")
        if value is None or value == "":
            raise ValueError("static loss scale needs a value: 'static:S', e.g. 'static:1024'")
        return StaticLossScale(_parse_number(value), dtype)
    if kind == "dynamic":
        if arg:
            raise ValueError(f"dynamic loss scale takes keyword options, not {spec!r}")
        allowed = {
            "init_scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "min_scale",
            "max_scale",
        }
        unknown = set(kwargs) - allowed
        if unknown:
            raise ValueError(
                f"unknown dynamic loss-scale options {sorted(unknown)}; allowed: "
                f"{', '.join(sorted(allowed))}"
            )
        kw: dict[str, Any] = {
            k: (_parse_number(v) if k != "growth_interval" and v is not None else v)
            for k, v in kwargs.items()
        }
        return DynamicLossScale(dtype=dtype, **kw)
    raise ValueError(f"unknown loss-scale spec {spec!r}; allowed: 'none', 'static:S', 'dynamic'")


def _parse_number(value: Any) -> float:
    if isinstance(value, int | float | np.number):
        return float(value)
    text = str(value).strip().replace("^", "**")
    if "**" in text:
        base, _, exp = text.partition("**")
        try:
            return float(base) ** float(exp)
        except OverflowError as err:
            raise ValueError(f"loss-scale number {value!r} is too large for float32") from err
        except ValueError:
            pass
    try:
        return float(text)
    except ValueError as err:
        raise ValueError(f"bad loss-scale number {value!r}; expected e.g. 1024 or 2**16") from err
