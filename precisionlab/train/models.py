"""Built-in models in plain JAX with an explicit dtype flow that honours a Policy.

Params are float32 pytrees of dicts and lists (cast by the train step to the storage and compute
dtypes). Every op goes through :mod:`precisionlab.mixed.ops`, so the compute dtype's rounding and
overflow are forced at op boundaries and the policy's float32 list is honoured.

- ``mlp``: classifier ``x -> [dense -> (LayerNorm) -> * act_scale -> relu|gelu|tanh] * depth ->
  dense``. Shapes: x f32[B, in_dim] -> logits [B, num_classes].
- ``transformer``: decoder-only LM; token + learned position embedding, ``depth`` pre-LayerNorm
  blocks (causal softmax attention with ``heads`` heads, GELU MLP of ``mlp_ratio * d_model``),
  final LayerNorm, unembedding. Shapes: tokens i32[B, T] -> logits [B, T, vocab_size].
- ``conv``: small CNN classifier (:mod:`precisionlab.train.conv`): x f32[B, in_dim] read as an
  S x S one-channel image -> [3x3 conv -> act -> 2x2 max pool] * depth -> dense. Convolutions
  in the compute dtype with the same per-op rounding (``ops.conv2d``).

Knobs for precision experiments: ``init_scale`` (multiplies every initial weight's std),
``use_layernorm`` (False removes the normalisation: activations can grow), ``act_scale``
(multiplies pre-activations), ``remat`` (``jax.checkpoint`` around each block),
``scan_layers`` / ``remat_every`` / ``remat_policy`` (mlp, transformer: the identical layers
stacked and run under ``lax.scan``, checkpointed every K layers, see
:mod:`precisionlab.train.layers`; the mlp's first layer, of another shape, stays unrolled),
``outlier_channels`` / ``outlier_scale`` (transformer: the first channels of every block's
normalised inputs to the qkv and fc1 matmuls multiplied by the scale, the outlier features
LLM.int8() reports in large models, for low-precision matmul recipes). The loss is
weighted by the trainer (``TrainConfig.loss_weight``), not by the model.

Layers: every model names its layers (:meth:`Model.layer_names`: ``layer0``.. and ``out`` for
the MLP, ``block0``.. and ``unembed`` for the transformer, ``conv0``.. and ``out`` for the CNN)
and runs each under ``jax.named_scope(name)``, so the interception layer's sites carry the
layer's name as their scope. ``high_precision`` (a tuple of layer names) computes those layers
in float32 whatever the policy's compute dtype (their inputs are cast up, their outputs go on in
float32 to the next layer, which casts them down): the "return a layer to high precision" of
``precisionlab diagnose`` (``TrainConfig.high_precision_layers``). ``overflow_layer`` /
``overflow_scale`` (MLP, a diagnose test knob): that hidden layer's pre-activations are
multiplied by the scale and its activations divided by it (exact with relu and a power-of-two
scale: the identity in float32; past float16's max in float16).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed import ops
from precisionlab.mixed.policy import Policy, get_policy
from precisionlab.train import conv as _conv
from precisionlab.train.layers import (
    check_scan_options,
    per_layer_options,
    scan_layers,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "MLP",
    "MODELS",
    "Model",
    "Transformer",
    "layer_names",
    "make_model",
    "model_data_kind",
    "resolve_layers",
]

#: The built-in models :func:`make_model` builds.
MODELS: tuple[str, ...] = ("mlp", "transformer", "conv")
_ACTIVATIONS = ("relu", "gelu", "tanh")


#: Most layers a built-in model has (as ``precisionlab.memory``'s presets): beyond it the layer
#: names alone would take seconds to list, and the model could not be a lab experiment.
MAX_DEPTH = 2**16


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be an int <= {high}, got {value!r}")


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


def _fp32(pol: Policy) -> Policy:
    """``pol`` with a float32 compute dtype (a layer kept in high precision)."""
    return dataclasses.replace(pol, compute_dtype=np.dtype(np.float32))


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


def _check_scales(model: Model, *extra: str) -> None:
    """The positive scales every model has (``init_scale``, ``act_scale``) and ``extra``."""
    for n in ("init_scale", "act_scale", *extra):
        _check_pos(n, getattr(model, n))


def _check_layout(model: Model, n_stacked: int | None) -> None:
    """``high_precision`` (normalized to a tuple of layer names) and, unless ``n_stacked`` is
    None (a model without ``scan_layers``), the scan options over ``n_stacked`` layers."""
    object.__setattr__(model, "high_precision", _check_layers(model, model.high_precision))
    if n_stacked is not None:
        _check_scan(model, n_stacked)


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


def _stack_init(layers: list[Any], what: str) -> Any:
    # Stacked on the host (numpy), so init still needs no compilation.
    def host(a: Any) -> Any:
        return a if isinstance(a, jax.ShapeDtypeStruct) else np.asarray(a)

    def device(a: Any) -> Any:
        return a if isinstance(a, jax.ShapeDtypeStruct) else jnp.asarray(a)

    stacked = stack_layers([jax.tree_util.tree_map(host, x) for x in layers], what)
    return jax.tree_util.tree_map(device, stacked)


class _Gen:
    """Host-side initialiser: a numpy SeedSequence derived from a JAX key (no compilation)."""

    def __init__(self, seq: np.random.SeedSequence, shapes_only: bool = False):
        self.seq, self.shapes_only = seq, shapes_only

    @classmethod
    def from_key(cls, key: jax.Array, shapes_only: bool = False) -> _Gen:
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        words = [int(w) for w in np.asarray(key, np.uint32).reshape(-1)]
        return cls(np.random.SeedSequence(words), shapes_only)

    def split(self, n: int) -> list[_Gen]:
        return [_Gen(child, self.shapes_only) for child in self.seq.spawn(n)]


def _normal(gen: _Gen, shape: tuple[int, ...], std: float) -> Any:
    if gen.shapes_only:
        return jax.ShapeDtypeStruct(shape, jnp.float32)
    draw = np.random.default_rng(gen.seq).standard_normal(shape, dtype=np.float32)
    return jnp.asarray(draw * np.float32(std), jnp.float32)


class Model:
    """Interface of the built-in models.

    ``init(key) -> params`` (float32 pytree); ``apply(params, inputs, policy=None, *,
    capture=False, enforce=True)`` -> logits in the policy's output dtype (and with ``capture`` a
    dict name -> activation in the compute dtype); ``loss_fn(policy=None, *, capture=False,
    enforce=True)`` -> ``loss_fn(params, batch) -> (loss, aux)`` with aux ``{"metric": accuracy}``
    (+ ``"activations"`` with capture); ``activation_shapes(batch_size, policy=None)``.
    """

    name: str = ""
    #: The kind of dataset the model reads (``Dataset.kind``): "classification" or "lm".
    data_kind: ClassVar[str] = ""
    remat: bool = False

    def init(self, key: jax.Array) -> Any:
        """Float32 params, a deterministic function of ``key`` (drawn on the host with numpy,
        so no compilation is needed)."""
        return self._init(_Gen.from_key(key))

    def param_shapes(self) -> Any:
        """The params pytree as ``jax.ShapeDtypeStruct`` leaves (no random draws)."""
        params = self._init(_Gen(np.random.SeedSequence(0), shapes_only=True))
        return jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)

    def _init(self, gen: _Gen) -> Any:
        raise NotImplementedError

    def layer_names(self) -> tuple[str, ...]:
        """The model's layers in program order (the names of their ``jax.named_scope``)."""
        raise NotImplementedError

    def layer_params(self, name: str) -> str:
        """The ``jax.tree_util.keystr`` prefix of layer ``name``'s params (``"['hidden'][3]"``)."""
        raise NotImplementedError

    def _layer_policy(self, name: str, pol: Policy) -> Policy:
        hp = getattr(self, "high_precision", ())
        return _fp32(pol) if name in hp else pol

    def apply(
        self,
        params: Any,
        inputs: jax.Array,
        policy: Policy | None = None,
        *,
        capture: bool = False,
        enforce: bool = True,
    ) -> Any:
        raise NotImplementedError

    def _inputs_labels(self, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        raise NotImplementedError

    def loss_fn(
        self, policy: Policy | str | None = None, *, capture: bool = False, enforce: bool = True
    ):
        """``loss_fn(params, batch) -> (loss, aux)``; params may already be in compute dtype."""
        pol = get_policy(policy) if policy is not None else Policy()

        def loss_fn(params: Any, batch: dict[str, Any]) -> tuple[jax.Array, dict[str, Any]]:
            inputs, labels = self._inputs_labels(batch)
            out = self.apply(params, inputs, pol, capture=capture, enforce=enforce)
            logits, acts = out if capture else (out, None)
            loss = ops.cross_entropy(logits, labels, policy=pol, enforce=enforce)
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
class MLP(Model):
    """MLP classifier (see module docstring)."""

    in_dim: int = 32
    num_classes: int = 10
    width: int = 256
    depth: int = 2
    activation: str = "relu"
    init_scale: float = 1.0
    act_scale: float = 1.0
    use_layernorm: bool = False
    remat: bool = False
    high_precision: tuple[str, ...] = ()
    overflow_layer: int = -1
    overflow_scale: float = 2.0**20
    scan_layers: bool = False
    remat_every: int = 0
    remat_policy: str = "nothing_saveable"

    name = "mlp"
    data_kind = "classification"

    def __post_init__(self) -> None:
        for n in ("in_dim", "width"):
            _check_int(n, getattr(self, n), 1)
        _check_int("num_classes", self.num_classes, 2)
        _check_int("depth", self.depth, 1, MAX_DEPTH)
        _check_scales(self, "overflow_scale")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown activation {self.activation!r}; allowed: {', '.join(_ACTIVATIONS)}"
            )
        if (
            isinstance(self.overflow_layer, bool)  # true was silently layer 1
            or not isinstance(self.overflow_layer, int)
            or not -1 <= self.overflow_layer < self.depth
        ):
            raise ValueError(
                f"overflow_layer must be -1 (off) or a hidden layer 0..{self.depth - 1}, "
                f"got {self.overflow_layer!r}"
            )
        _check_layout(self, self.depth - 1)  # layer 0 (in_dim -> width) is not stacked
        if self.scan_layers and self.overflow_layer >= 1:
            raise ValueError(
                f"overflow_layer {self.overflow_layer} is a stacked layer under scan_layers; "
                "use the unrolled layers (scan_layers=False)"
            )

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"layer{i}" for i in range(self.depth)), "out")

    def layer_params(self, name: str) -> str:
        return "['out']" if name == "out" else f"['hidden'][{int(name[5:])}]"

    def _init(self, gen: _Gen) -> dict[str, Any]:
        keys = gen.split(self.depth + 1)
        gain = math.sqrt(2.0) if self.activation == "relu" else 1.0
        hidden = []
        fan_in = self.in_dim
        for i in range(self.depth):
            layer = {
                "w": _normal(
                    keys[i], (fan_in, self.width), self.init_scale * gain / math.sqrt(fan_in)
                ),
                "b": jnp.zeros((self.width,), jnp.float32),
            }
            if self.use_layernorm:
                layer["ln_scale"] = jnp.ones((self.width,), jnp.float32)
                layer["ln_bias"] = jnp.zeros((self.width,), jnp.float32)
            hidden.append(layer)
            fan_in = self.width
        out = {
            "w": _normal(keys[-1], (fan_in, self.num_classes), self.init_scale / math.sqrt(fan_in)),
            "b": jnp.zeros((self.num_classes,), jnp.float32),
        }
        params = {"hidden": hidden, "out": out}
        return self.stack_params(params) if self.scan_layers else params

    def stack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params in the ``scan_layers`` layout: hidden layers 1.. stacked under
        ``"hidden_stack"`` (leaves ``[depth - 1, ...]``); layer 0 stays in ``"hidden"``."""
        if "hidden_stack" in params or len(params["hidden"]) < 2:
            return params
        rest = _stack_init(list(params["hidden"][1:]), "hidden layer")
        return {**params, "hidden": list(params["hidden"][:1]), "hidden_stack": rest}

    def unstack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`stack_params`: one dict per hidden layer in ``"hidden"``."""
        if "hidden_stack" not in params:
            return params
        out = {k: v for k, v in params.items() if k != "hidden_stack"}
        out["hidden"] = list(params["hidden"]) + unstack_layers(params["hidden_stack"])
        return out

    def _act(self, h: jax.Array, pol: Policy, enforce: bool) -> jax.Array:
        if self.activation == "relu":
            return ops.relu(h, policy=pol, enforce=enforce)
        if self.activation == "gelu":
            return ops.gelu(h, policy=pol, enforce=enforce)
        return ops.boundary(jnp.tanh(h), pol, enforce=enforce)

    def apply(self, params, inputs, policy=None, *, capture=False, enforce=True):
        pol = policy or Policy()
        acts: dict[str, jax.Array] = {}
        h = ops.boundary(inputs, pol, enforce=enforce)

        def block(layer, h, pol=pol, overflow=False):
            z = ops.dense(h, layer["w"], layer["b"], policy=pol, enforce=enforce)
            if self.use_layernorm:
                z = ops.layer_norm(
                    z, layer["ln_scale"], layer["ln_bias"], policy=pol, enforce=enforce
                )
            if self.act_scale != 1.0:
                z = ops.boundary(z * jnp.asarray(self.act_scale, z.dtype), pol, enforce=enforce)
            if overflow:  # the diagnose test knob: z * S, then act(z * S) / S, in float32
                s = jnp.float32(self.overflow_scale)  # each product rounded to the compute dtype
                z = ops.boundary(z.astype(jnp.float32) * s, pol, enforce=enforce)
                a = self._act(z, pol, enforce).astype(jnp.float32) / s
                return z, ops.boundary(a, pol, enforce=enforce)
            return z, self._act(z, pol, enforce)

        def record(i: int, z: jax.Array, h: jax.Array) -> None:
            acts[f"layer{i}/pre"] = z
            if self.activation == "gelu":  # tanh-GELU's x**3 overflows float16 first (|x| > 40)
                acts[f"layer{i}/gelu_cubic"] = z**3
            acts[f"layer{i}/out"] = h

        if self.scan_layers:
            unrolled = params["hidden"][:1]
            stacked = params.get("hidden_stack", list(params["hidden"][1:]))
        else:
            unrolled = self.unstack_params(params)["hidden"]
        for i, layer in enumerate(unrolled):
            lp = self._layer_policy(f"layer{i}", pol)
            fn = partial(block, pol=lp, overflow=i == self.overflow_layer)
            with jax.named_scope(f"layer{i}"):
                z, h = (jax.checkpoint(fn) if self.remat else fn)(layer, h)
            record(i, z, h)
        if self.scan_layers and self.depth > 1:

            def body(layer, h):
                z, h = block(layer, h)
                return h, ((z, h) if capture else None)

            h, ys = scan_layers(
                body,
                stacked,
                h,
                remat_every=self.remat_every,
                policy=self.remat_policy,
                what="hidden layer",
                scope="layer",
                first=1,
            )
            for i in range(1, self.depth if capture else 1):
                record(i, ys[0][i - 1], ys[1][i - 1])
        with jax.named_scope("out"):
            lp = self._layer_policy("out", pol)
            logits = ops.dense(
                h, params["out"]["w"], params["out"]["b"], policy=lp, enforce=enforce
            )
        acts["logits"] = logits
        logits = pol.cast_to_output(logits)
        return (logits, acts) if capture else logits

    def _inputs_labels(self, batch):
        return batch["x"], batch["y"]

    def example_batch(self, batch_size):
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.in_dim), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class Transformer(Model):
    """Decoder-only transformer LM (see module docstring)."""

    vocab_size: int = 32
    seq_len: int = 64
    d_model: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    init_scale: float = 1.0
    act_scale: float = 1.0
    use_layernorm: bool = True
    remat: bool = False
    outlier_channels: int = 0
    outlier_scale: float = 100.0
    high_precision: tuple[str, ...] = ()
    scan_layers: bool = False
    remat_every: int = 0
    remat_policy: str = "nothing_saveable"

    name = "transformer"
    data_kind = "lm"

    def __post_init__(self) -> None:
        for n in ("vocab_size", "seq_len", "d_model", "heads", "mlp_ratio"):
            _check_int(n, getattr(self, n), 1)
        _check_int("depth", self.depth, 1, MAX_DEPTH)
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by heads {self.heads}")
        _check_scales(self, "outlier_scale")
        _check_int("outlier_channels", self.outlier_channels, 0)
        if self.outlier_channels > self.d_model:
            raise ValueError(f"outlier_channels {self.outlier_channels} > d_model {self.d_model}")
        _check_layout(self, self.depth)

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"block{i}" for i in range(self.depth)), "unembed")

    def layer_params(self, name: str) -> str:
        return "['unembed']" if name == "unembed" else f"['blocks'][{int(name[5:])}]"

    def _outliers(self, h: jax.Array, pol: Policy, enforce: bool) -> jax.Array:
        # A few channels x outlier_scale in every token (LLM.int8(): systematic outlier features).
        if not self.outlier_channels:
            return h
        m = np.ones((self.d_model,), np.float32)
        m[: self.outlier_channels] = self.outlier_scale
        return ops.boundary(h * jnp.asarray(m, h.dtype), pol, enforce=enforce)

    def _init(self, gen: _Gen) -> dict[str, Any]:
        d, f = self.d_model, self.d_model * self.mlp_ratio
        s = self.init_scale
        keys = gen.split(3 + 4 * self.depth)
        blocks = []
        for i in range(self.depth):
            k = keys[3 + 4 * i : 7 + 4 * i]
            # Output projections scaled by 1/sqrt(2 * depth) (GPT-2) to keep the residual tame.
            out_std = s / math.sqrt(d) / math.sqrt(2 * self.depth)
            blk = {
                "qkv": _normal(k[0], (d, 3 * d), s / math.sqrt(d)),
                "proj": _normal(k[1], (d, d), out_std),
                "fc1": _normal(k[2], (d, f), s / math.sqrt(d)),
                "fc1_b": jnp.zeros((f,), jnp.float32),
                "fc2": _normal(k[3], (f, d), s / math.sqrt(f) / math.sqrt(2 * self.depth)),
                "fc2_b": jnp.zeros((d,), jnp.float32),
            }
            if self.use_layernorm:
                for n in ("ln1", "ln2"):
                    blk[f"{n}_scale"] = jnp.ones((d,), jnp.float32)
                    blk[f"{n}_bias"] = jnp.zeros((d,), jnp.float32)
            blocks.append(blk)
        params = {
            "embed": _normal(keys[0], (self.vocab_size, d), s * 0.5),
            "pos": _normal(keys[1], (self.seq_len, d), s * 0.1),
            "blocks": _stack_init(blocks, "block") if self.scan_layers else blocks,
            "unembed": _normal(keys[2], (d, self.vocab_size), s / math.sqrt(d)),
        }
        if self.use_layernorm:
            params["ln_f_scale"] = jnp.ones((d,), jnp.float32)
            params["ln_f_bias"] = jnp.zeros((d,), jnp.float32)
        return params

    def stack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params in the ``scan_layers`` layout: ``"blocks"`` one dict of leaves
        ``[depth, ...]`` instead of a list of ``depth`` dicts."""
        if not isinstance(params["blocks"], list | tuple):
            return params
        return {**params, "blocks": _stack_init(list(params["blocks"]), "block")}

    def unstack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`stack_params`: ``"blocks"`` a list of per-block dicts."""
        if isinstance(params["blocks"], list | tuple):
            return params
        return {**params, "blocks": unstack_layers(params["blocks"])}

    def _norm(self, x, p, name, pol, enforce):
        if not self.use_layernorm:
            return x
        return ops.layer_norm(x, p[f"{name}_scale"], p[f"{name}_bias"], policy=pol, enforce=enforce)

    def apply(self, params, inputs, policy=None, *, capture=False, enforce=True):
        pol = policy or Policy()
        b, t = inputs.shape
        d, nh = self.d_model, self.heads
        dh = d // nh
        cd = pol.compute_dtype
        acts: dict[str, jax.Array] = {}
        emb = jnp.asarray(params["embed"]).astype(cd)
        x = emb[inputs] + jnp.asarray(params["pos"]).astype(cd)[:t]
        x = ops.boundary(x, pol, enforce=enforce)
        causal = jnp.tril(jnp.ones((t, t), bool))

        def block(blk, x, pol=pol):
            cd = pol.compute_dtype
            a = {}
            h = self._outliers(self._norm(x, blk, "ln1", pol, enforce), pol, enforce)
            qkv = ops.matmul(h, blk["qkv"], policy=pol, enforce=enforce)
            q, k, v = jnp.split(qkv.reshape(b, t, 3, nh, dh), 3, axis=2)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, T, H, Dh]
            scale = jnp.asarray(self.act_scale / math.sqrt(dh), cd)
            logits_BHTT = ops.boundary(
                jnp.einsum(
                    "bqhd,bkhd->bhqk",
                    q,
                    k,
                    preferred_element_type=pol.op_dtype("matmul_accumulate"),
                ).astype(cd)
                * scale,
                pol,
                enforce=enforce,
            )
            probs = ops.softmax(logits_BHTT, axis=-1, policy=pol, where=causal, enforce=enforce)
            probs = jnp.where(causal, probs, jnp.zeros((), cd))
            att = ops.boundary(
                jnp.einsum(
                    "bhqk,bkhd->bqhd",
                    probs,
                    v,
                    preferred_element_type=pol.op_dtype("matmul_accumulate"),
                ),
                pol,
                enforce=enforce,
            ).reshape(b, t, d)
            x = ops.boundary(
                x + ops.matmul(att, blk["proj"], policy=pol, enforce=enforce), pol, enforce=enforce
            )
            h = self._outliers(self._norm(x, blk, "ln2", pol, enforce), pol, enforce)
            u = ops.dense(h, blk["fc1"], blk["fc1_b"], policy=pol, enforce=enforce)
            u = ops.gelu(u, policy=pol, enforce=enforce)
            x = ops.boundary(
                x + ops.dense(u, blk["fc2"], blk["fc2_b"], policy=pol, enforce=enforce),
                pol,
                enforce=enforce,
            )
            a["attn_logits"] = logits_BHTT
            a["mlp_hidden"] = u
            a["resid"] = x
            return x, a

        if self.scan_layers:

            def body(blk, x_in):
                x_out, a = block(blk, x_in)
                return x_out, ({"input": x_in, **a} if capture else None)

            x, ys = scan_layers(
                body,
                params["blocks"],
                x,
                remat_every=self.remat_every,
                policy=self.remat_policy,
                what="block",
                scope="block",
            )
            for i in range(len(params["blocks"]) if capture else 0):
                for n, v in ys.items():
                    acts[f"block{i}/{n}"] = v[i]
        else:
            for i, blk in enumerate(self.unstack_params(params)["blocks"]):
                acts[f"block{i}/input"] = x
                fn = partial(block, pol=self._layer_policy(f"block{i}", pol))
                with jax.named_scope(f"block{i}"):
                    x, a = (jax.checkpoint(fn) if self.remat else fn)(blk, x)
                for n, v in a.items():
                    acts[f"block{i}/{n}"] = v
        if self.use_layernorm:
            x = ops.layer_norm(
                x, params["ln_f_scale"], params["ln_f_bias"], policy=pol, enforce=enforce
            )
        with jax.named_scope("unembed"):
            lp = self._layer_policy("unembed", pol)
            logits = ops.matmul(x, params["unembed"], policy=lp, enforce=enforce)
        acts["logits"] = logits
        logits = pol.cast_to_output(logits)
        return (logits, acts) if capture else logits

    def _inputs_labels(self, batch):
        tokens = batch["tokens"]
        return tokens[:, :-1], tokens[:, 1:]

    def example_batch(self, batch_size):
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), jnp.int32)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvNet(Model):
    """Small convolutional classifier of square one-channel images given flat as ``x f32[B,
    in_dim]`` (the math lives in :mod:`precisionlab.train.conv`); logits [B, num_classes]."""

    in_dim: int = 64
    num_classes: int = 10
    width: int = 16
    depth: int = 2
    activation: str = "relu"
    init_scale: float = 1.0
    act_scale: float = 1.0
    remat: bool = False
    high_precision: tuple[str, ...] = ()

    name = "conv"
    data_kind = "classification"

    def __post_init__(self) -> None:
        for n in ("in_dim", "width"):
            _check_int(n, getattr(self, n), 1)
        _check_int("depth", self.depth, 1, MAX_DEPTH)
        _check_int("num_classes", self.num_classes, 2)
        _check_scales(self)
        _conv.check(self)
        _check_layout(self, None)  # no scan_layers

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"conv{i}" for i in range(self.depth)), "out")

    def layer_params(self, name: str) -> str:
        return "['out']" if name == "out" else f"['convs'][{int(name[4:])}]"

    def _init(self, gen: _Gen) -> dict[str, Any]:
        return _conv.init_params(self, gen.split(self.depth + 1), _normal)

    def apply(self, params, inputs, policy=None, *, capture=False, enforce=True):
        return _conv.apply(self, params, inputs, policy, capture=capture, enforce=enforce)

    def _inputs_labels(self, batch):
        return batch["x"], batch["y"]

    def example_batch(self, batch_size):
        return {
            "x": jax.ShapeDtypeStruct((batch_size, self.in_dim), jnp.float32),
            "y": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
        }


_BUILDERS = {"mlp": MLP, "transformer": Transformer, "conv": ConvNet}


def make_model(name: str, **kwargs: Any) -> Model:
    """Build a model by name (see :data:`MODELS`); unknown options raise ValueError."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    cls = _BUILDERS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for model {name!r}; allowed: "
            f"{', '.join(allowed)}"
        )
    return cls(**kwargs)


def model_data_kind(name: str) -> str:
    """The kind of dataset (``"classification"`` or ``"lm"``) the model ``name`` reads."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    kind = _BUILDERS[name].data_kind
    if not kind:
        raise ValueError(f"model {name!r} does not declare the data_kind it reads")
    return kind


def layer_names(name: str, model_kwargs: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The layer names of model ``name`` with ``model_kwargs`` (only ``depth`` matters; the
    data's sizes need not be known)."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    fields = {f.name: f.default for f in dataclasses.fields(_BUILDERS[name])}
    depth = (model_kwargs or {}).get("depth", fields["depth"])
    _check_int("depth", depth, 1, MAX_DEPTH)
    prefix, last = {"mlp": ("layer", "out"), "transformer": ("block", "unembed")}.get(
        name, ("conv", "out")
    )
    return (*(f"{prefix}{i}" for i in range(depth)), last)


def resolve_layers(
    patterns: Any, names: tuple[str, ...], what: str = "layer filter"
) -> tuple[str, ...]:
    """The layers of ``names`` matched by any glob of ``patterns`` (``"layer*"``), in program
    order; a pattern matching no layer is a ValueError naming the layers."""
    import fnmatch

    if isinstance(patterns, str):
        patterns = [patterns]
    if not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"{what} must be a list of layer names or glob patterns, got {patterns!r}")
    for p in patterns:
        if not fnmatch.filter(names, p):
            raise ValueError(f"{what} {p!r} matches no layer; layers: {', '.join(names)}")
    return tuple(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
