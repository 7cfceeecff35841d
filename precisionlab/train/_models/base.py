"""The model interface (:class:`Model`) and the helpers every built-in model shares: option
checks, the host-side initialiser (no compilation), stacking of identical layers."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab._schema import check_fits, check_int
from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy, get_policy
from precisionlab.train._layers import (
    check_scan_options,
    per_layer_options,
    stack_layers,
)
from precisionlab.train._models._activation import check_activation, fp32_compute

__all__ = ["MAX_DEPTH", "MODELS", "Classifier", "Model"]

#: The built-in models :func:`make_model` builds.
MODELS: tuple[str, ...] = ("mlp", "transformer", "conv")


#: Most layers a built-in model has (as ``precisionlab.memory``'s presets): beyond it the layer
#: names alone would take seconds to list, and the model could not be a lab experiment.
MAX_DEPTH = 2**16


def _check_fits(model: Model) -> None:
    """ValueError when the model's float32 params alone, which ``init`` draws on the host,
    exceed this machine's memory (:func:`~precisionlab._schema.check_fits`)."""
    n = sum(math.prod(s.shape) for s in jax.tree.leaves(model.param_shapes()))
    check_fits(f"model {model.name!r} ({n:,.4g} parameters)", 4 * n, "in float32")


def _check_pos(name: str, value: Any) -> None:
    # finite and within float32: inf (or 1e300, inf once cast) makes every activation inf
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value <= 3.4028234663852886e38
    ):
        raise ValueError(
            f"{name} must be a finite number > 0 (at most float32's max), got {value!r}"
        )


def _check_layers(model: Model, names: Any) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"high_precision must be a tuple of layer names, got {names!r}")
    allowed = model.layer_names()
    unknown = [n for n in names if n not in allowed]
    if unknown:
        raise ValueError(
            f"high_precision: unknown layer(s) {', '.join(map(repr, unknown))} of model "
            f"{model.name!r}; layers: {', '.join(allowed)}"
        )
    return tuple(names)


def _check_scan(model: Any, n_stacked: int) -> None:
    check_scan_options(
        scan=model.scan_layers,
        remat_every=model.remat_every,
        policy=model.remat_policy,
        remat=model.remat,
        n_layers=n_stacked if model.scan_layers else None,
    )
    per_layer = per_layer_options(model) if model.scan_layers else []
    if per_layer:
        raise ValueError(
            f"scan_layers stacks identical layers, but {', '.join(per_layer)} set per-layer "
            "options; use the unrolled layers (scan_layers=False)"
        )


def stack_init(layers: list[Any], what: str) -> Any:
    # Stacked on the host (numpy), so init still needs no compilation.
    def host(a: Any) -> Any:
        return a if isinstance(a, jax.ShapeDtypeStruct) else np.asarray(a)

    def device(a: Any) -> Any:
        return a if isinstance(a, jax.ShapeDtypeStruct) else jnp.asarray(a)

    stacked = stack_layers([jax.tree_util.tree_map(host, x) for x in layers], what)
    return jax.tree_util.tree_map(device, stacked)


class Gen:
    """Host-side initialiser: a numpy SeedSequence derived from a JAX key (no compilation)."""

    def __init__(self, seq: np.random.SeedSequence, shapes_only: bool = False):
        self.seq, self.shapes_only = seq, shapes_only

    @classmethod
    def from_key(cls, key: jax.Array, shapes_only: bool = False) -> Gen:
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        words = [int(w) for w in np.asarray(key, np.uint32).reshape(-1)]
        return cls(np.random.SeedSequence(words), shapes_only)

    def split(self, n: int) -> list[Gen]:
        return [Gen(child, self.shapes_only) for child in self.seq.spawn(n)]

    def normal(self, shape: tuple[int, ...], std: float) -> Any:
        """float32 normal draws of standard deviation ``std`` (a ShapeDtypeStruct when
        ``shapes_only``)."""
        if self.shapes_only:
            return jax.ShapeDtypeStruct(shape, jnp.float32)
        draw = np.random.default_rng(self.seq).standard_normal(shape, dtype=np.float32)
        return jnp.asarray(draw * np.float32(std), jnp.float32)

    def zeros(self, shape: tuple[int, ...]) -> Any:
        """float32 zeros (a ShapeDtypeStruct when ``shapes_only``: nothing allocated); draws
        nothing, so the generator's random stream is unchanged."""
        return (
            jax.ShapeDtypeStruct(shape, jnp.float32)
            if self.shapes_only
            else jnp.zeros(shape, jnp.float32)
        )

    def ones(self, shape: tuple[int, ...]) -> Any:
        """float32 ones, as :meth:`zeros`."""
        return (
            jax.ShapeDtypeStruct(shape, jnp.float32)
            if self.shapes_only
            else jnp.ones(shape, jnp.float32)
        )


class Model:
    """Interface of the built-in models.

    ``init(key) -> params`` (float32 pytree); ``apply(params, inputs, policy=None, *,
    capture=False)`` -> logits in the policy's output dtype (and with ``capture`` a dict name ->
    activation in the compute dtype); ``loss_fn(policy=None, *, capture=False)`` ->
    ``loss_fn(params, batch) -> (loss, aux)`` with aux ``{"metric": accuracy}`` (+
    ``"activations"`` with capture); ``activation_shapes(batch_size, policy=None)``. The ops round
    at their boundaries when ``policy.enforce`` (``policy.with_enforce(False)`` turns it off).
    """

    name: str = ""
    #: The kind of dataset the model reads (``Dataset.kind``): "classification" or "lm".
    data_kind: ClassVar[str] = ""
    remat: bool = False
    #: Layers computed in float32 (each model's field; checked by ``_check_layout``).
    high_precision: tuple[str, ...] = ()

    def init(self, key: jax.Array) -> Any:
        """Float32 params, a deterministic function of ``key`` (drawn on the host with numpy,
        so no compilation is needed)."""
        return self._init(Gen.from_key(key))

    def param_shapes(self) -> Any:
        """The params pytree as ``jax.ShapeDtypeStruct`` leaves (no random draws, nothing
        allocated: any size the options pass is cheap to describe)."""
        return self._init(Gen(np.random.SeedSequence(0), shapes_only=True))

    def _init(self, gen: Gen) -> Any:
        raise NotImplementedError

    def layer_names(self) -> tuple[str, ...]:
        """The model's layers in program order (the names of their ``jax.named_scope``)."""
        raise NotImplementedError

    def layer_params(self, name: str) -> str:
        """The ``jax.tree_util.keystr`` prefix of layer ``name``'s params (``"['hidden'][3]"``)."""
        raise NotImplementedError

    def _check_sizes(self, *names: str) -> None:
        """The checks every built-in model starts with: the fields ``names`` ints >= 1,
        ``num_classes`` (a classifier's) >= 2 and ``depth`` in 1..:data:`MAX_DEPTH`."""
        for n in names:
            check_int(n, getattr(self, n), 1)
        if hasattr(self, "num_classes"):
            check_int("num_classes", self.num_classes, 2)
        check_int("depth", getattr(self, "depth", None), 1, MAX_DEPTH)

    def _check_scales(self, *extra: str) -> None:
        """The positive scales every model has (``init_scale``, ``act_scale``) and ``extra``."""
        for n in ("init_scale", "act_scale", *extra):
            _check_pos(n, getattr(self, n))

    def _check_layout(self, n_stacked: int | None) -> None:
        """``high_precision`` (normalized to a tuple of layer names), unless ``n_stacked`` is
        None (a model without ``scan_layers``) the scan options over ``n_stacked`` layers, and
        last the size of the params against this machine's memory."""
        object.__setattr__(self, "high_precision", _check_layers(self, self.high_precision))
        if n_stacked is not None:
            _check_scan(self, n_stacked)
        _check_fits(self)

    def _layer_policy(self, name: str, pol: Policy) -> Policy:
        return fp32_compute(pol) if name in self.high_precision else pol

    def apply(
        self, params: Any, inputs: jax.Array, policy: Policy | None = None, *, capture: bool = False
    ) -> Any:
        """Logits in the policy's output dtype; with ``capture`` ``(logits, acts)``, ``acts`` a
        dict name -> activation in the compute dtype, ending with ``"logits"``."""
        pol = policy or Policy()
        logits, acts = self._forward(params, inputs, pol, capture)
        acts["logits"] = logits
        out = pol.cast_to_output(logits)
        return (out, acts) if capture else out

    def _forward(
        self, params: Any, inputs: jax.Array, pol: Policy, capture: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The logits in the compute dtype and the activations (those only ``capture`` asks
        for may be left out when it is False)."""
        raise NotImplementedError

    def _inputs_labels(self, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def loss_fn(
        self, policy: Policy | str | None = None, *, capture: bool = False
    ) -> Callable[[Any, dict[str, Any]], tuple[jax.Array, dict[str, Any]]]:
        """``loss_fn(params, batch) -> (loss, aux)``; params may already be in compute dtype."""
        pol = get_policy(policy) if policy is not None else Policy()

        def loss_fn(params: Any, batch: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
            inputs, labels = self._inputs_labels(batch)
            out = self.apply(params, inputs, pol, capture=capture)
            logits, acts = out if capture else (out, None)
            loss = ops.cross_entropy(logits, labels, policy=pol)
            aux: dict[str, Any] = {"metric": ops.accuracy(logits, labels)}
            if capture:
                aux["activations"] = acts
            return loss, aux

        return loss_fn

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        raise NotImplementedError

    def activation_shapes(
        self, batch_size: int, policy: Policy | str | None = None
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes and dtypes of the per-block activations (no computation: ``jax.eval_shape``)."""
        pol = get_policy(policy) if policy is not None else Policy()
        params = jax.tree_util.tree_map(
            lambda p: jax.ShapeDtypeStruct(p.shape, pol.compute_dtype), self.param_shapes()
        )
        _, acts = jax.eval_shape(
            lambda p, b: self.apply(p, self._inputs_labels(b)[0], pol, capture=True),
            params,
            self.example_batch(batch_size),
        )
        return dict(acts)

    @staticmethod
    def param_count(params: Any) -> int:
        return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Classifier(Model):
    """The options and data interface the classifiers of flat inputs share (``mlp``,
    ``conv``): ``x f32[B, in_dim]`` -> logits [B, num_classes]; ``width`` and ``depth`` of the
    hidden layers, their ``activation``, the scales of the initial weights and activations."""

    in_dim: int = 32
    num_classes: int = 10
    width: int = 256
    depth: int = 2
    activation: str = "relu"
    init_scale: float = 1.0
    act_scale: float = 1.0

    data_kind = "classification"

    def _check_options(self, *extra_scales: str) -> None:
        """The sizes, the positive scales (and ``extra_scales``) and the activation."""
        self._check_sizes("in_dim", "width")
        self._check_scales(*extra_scales)
        check_activation(self.activation)

    def _inputs_labels(self, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        return batch["x"], batch["y"]

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.in_dim), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }
