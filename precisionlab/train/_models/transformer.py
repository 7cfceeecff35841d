"""``transformer``: decoder-only LM; token + learned position embedding, ``depth`` pre-LayerNorm
blocks (causal softmax attention, GELU MLP), final LayerNorm, unembedding; tokens i32[B, T] ->
logits [B, T, vocab_size] (options: see :mod:`precisionlab.train._models`).

Two options for the divergence forecast's mechanisms (off by default; the default model is
unchanged): ``mlp = "swiglu"`` replaces each block's GELU MLP by SwiGLU (``silu(h @ w_gate) *
(h @ w_up) @ fc2``, no biases; Shazeer 2020), whose gate and up projections can align under
weight decay (Fishman et al. 2024); ``norm_format`` (an MX format name, ``"mxfp4"``) quantizes
every LayerNorm's affine weight and bias to that format before use (blocks of 32 along the
channels, straight-through gradient), as MX training libraries do (Su et al. 2025), except in
the layers ``high_precision`` keeps in float32 (the final norm counts as the unembedding's).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab._schema import check_int
from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy
from precisionlab.quant import MX_FORMATS, fake_quant, get_mx_format
from precisionlab.train._layers import scan_layers, unstack_layers
from precisionlab.train._models.base import Gen, Model, stack_init

__all__ = ["Transformer"]


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
    mlp: str = "gelu"
    norm_format: str | None = None

    name = "transformer"
    data_kind = "lm"

    def __post_init__(self) -> None:
        self._check_sizes("vocab_size", "seq_len", "d_model", "heads", "mlp_ratio")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be divisible by heads {self.heads}")
        self._check_scales("outlier_scale")
        check_int("outlier_channels", self.outlier_channels, 0)
        if self.outlier_channels > self.d_model:
            raise ValueError(f"outlier_channels {self.outlier_channels} > d_model {self.d_model}")
        if self.mlp not in ("gelu", "swiglu"):
            raise ValueError(f"unknown mlp {self.mlp!r}; allowed: gelu, swiglu")
        if self.norm_format is not None:
            if get_mx_format(self.norm_format) is None:
                raise ValueError(
                    f"unknown norm_format {self.norm_format!r}; allowed: {', '.join(MX_FORMATS)}"
                )
            if self.d_model % 32:
                raise ValueError(
                    f"norm_format quantizes blocks of 32 channels: d_model {self.d_model} "
                    "must be a multiple of 32"
                )
        self._check_layout(self.depth)

    def layer_names(self) -> tuple[str, ...]:
        return (*(f"block{i}" for i in range(self.depth)), "unembed")

    def layer_params(self, name: str) -> str:
        return "['unembed']" if name == "unembed" else f"['blocks'][{int(name[5:])}]"

    def _outliers(self, h: jax.Array, pol: Policy) -> jax.Array:
        # A few channels x outlier_scale in every token (LLM.int8(): systematic outlier features).
        if not self.outlier_channels:
            return h
        m = np.ones((self.d_model,), np.float32)
        m[: self.outlier_channels] = self.outlier_scale
        return ops.boundary(h * jnp.asarray(m, h.dtype), pol)

    def _init(self, gen: Gen) -> dict[str, Any]:
        d, f = self.d_model, self.d_model * self.mlp_ratio
        s = self.init_scale
        keys = gen.split(3 + 4 * self.depth)
        blocks = []
        for i in range(self.depth):
            k = keys[3 + 4 * i : 7 + 4 * i]
            # Output projections scaled by 1/sqrt(2 * depth) (GPT-2) to keep the residual tame.
            out_std = s / math.sqrt(d) / math.sqrt(2 * self.depth)
            blk = {
                "qkv": k[0].normal((d, 3 * d), s / math.sqrt(d)),
                "proj": k[1].normal((d, d), out_std),
                "fc1": k[2].normal((d, f), s / math.sqrt(d)),
                "fc1_b": k[2].zeros((f,)),
                "fc2": k[3].normal((f, d), s / math.sqrt(f) / math.sqrt(2 * self.depth)),
                "fc2_b": k[3].zeros((d,)),
            }
            if self.mlp == "swiglu":  # fc1's draw becomes the gate; the up projection's own
                gate, up = k[2].split(2)
                del blk["fc1"], blk["fc1_b"], blk["fc2_b"]
                blk["w_gate"] = gate.normal((d, f), s / math.sqrt(d))
                blk["w_up"] = up.normal((d, f), s / math.sqrt(d))
            if self.use_layernorm:
                for n in ("ln1", "ln2"):
                    blk[f"{n}_scale"] = k[0].ones((d,))
                    blk[f"{n}_bias"] = k[0].zeros((d,))
            blocks.append(blk)
        params = {
            "embed": keys[0].normal((self.vocab_size, d), s * 0.5),
            "pos": keys[1].normal((self.seq_len, d), s * 0.1),
            "blocks": stack_init(blocks, "block") if self.scan_layers else blocks,
            "unembed": keys[2].normal((d, self.vocab_size), s / math.sqrt(d)),
        }
        if self.use_layernorm:
            params["ln_f_scale"] = keys[0].ones((d,))
            params["ln_f_bias"] = keys[0].zeros((d,))
        return params

    def stack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """Params in the ``scan_layers`` layout: ``"blocks"`` one dict of leaves
        ``[depth, ...]`` instead of a list of ``depth`` dicts."""
        if not isinstance(params["blocks"], list | tuple):
            return params
        return {**params, "blocks": stack_init(list(params["blocks"]), "block")}

    def unstack_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """The inverse of :meth:`stack_params`: ``"blocks"`` a list of per-block dicts."""
        if isinstance(params["blocks"], list | tuple):
            return params
        return {**params, "blocks": unstack_layers(params["blocks"])}

    def _norm(self, x: jax.Array, p: Any, name: str, pol: Policy, layer: str = "") -> jax.Array:
        if not self.use_layernorm:
            return x
        scale, bias = p[f"{name}_scale"], p[f"{name}_bias"]
        if self.norm_format is not None and layer not in self.high_precision:
            q = lambda v: fake_quant(v, self.norm_format, axis=-1, ste="identity")  # noqa: E731
            scale, bias = q(jnp.asarray(scale, jnp.float32)), q(jnp.asarray(bias, jnp.float32))
        return ops.layer_norm(x, scale, bias, policy=pol)

    def _forward(
        self, params: Any, inputs: jax.Array, pol: Policy, capture: bool
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        b, t = inputs.shape
        d, nh = self.d_model, self.heads
        dh = d // nh
        cd = pol.compute_dtype
        acts: dict[str, jax.Array] = {}
        emb = jnp.asarray(params["embed"]).astype(cd)
        x = emb[inputs] + jnp.asarray(params["pos"]).astype(cd)[:t]
        x = ops.boundary(x, pol)
        causal = jnp.tril(jnp.ones((t, t), bool))

        def block(
            blk: Any, x: jax.Array, pol: Policy = pol, layer: str = ""
        ) -> tuple[jax.Array, dict[str, jax.Array]]:
            cd = pol.compute_dtype
            a = {}
            h = self._outliers(self._norm(x, blk, "ln1", pol, layer), pol)
            qkv = ops.matmul(h, blk["qkv"], policy=pol)
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
            )
            probs = ops.softmax(logits_BHTT, axis=-1, policy=pol, where=causal)
            probs = jnp.where(causal, probs, jnp.zeros((), cd))
            att = ops.boundary(
                jnp.einsum(
                    "bhqk,bkhd->bqhd",
                    probs,
                    v,
                    preferred_element_type=pol.op_dtype("matmul_accumulate"),
                ),
                pol,
            ).reshape(b, t, d)
            x = ops.boundary(x + ops.matmul(att, blk["proj"], policy=pol), pol)
            h = self._outliers(self._norm(x, blk, "ln2", pol, layer), pol)
            if self.mlp == "swiglu":
                gate = ops.matmul(h, blk["w_gate"], policy=pol)
                up = ops.matmul(h, blk["w_up"], policy=pol)
                u = ops.boundary(jax.nn.silu(gate) * up, pol)
                out = ops.matmul(u, blk["fc2"], policy=pol)
            else:
                u = ops.dense(h, blk["fc1"], blk["fc1_b"], policy=pol)
                u = ops.gelu(u, policy=pol)
                out = ops.dense(u, blk["fc2"], blk["fc2_b"], policy=pol)
            x = ops.boundary(x + out, pol)
            a["attn_logits"] = logits_BHTT
            a["mlp_hidden"] = u
            a["resid"] = x
            return x, a

        if self.scan_layers:

            def body(blk: Any, x_in: jax.Array) -> tuple[jax.Array, Any]:
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
                fn = partial(block, pol=self._layer_policy(f"block{i}", pol), layer=f"block{i}")
                with jax.named_scope(f"block{i}"):
                    x, a = (jax.checkpoint(fn) if self.remat else fn)(blk, x)
                for n, v in a.items():
                    acts[f"block{i}/{n}"] = v
        if self.use_layernorm:
            x = self._norm(x, params, "ln_f", pol, "unembed")
        with jax.named_scope("unembed"):
            lp = self._layer_policy("unembed", pol)
            logits = ops.matmul(x, params["unembed"], policy=lp)
        return logits, acts

    def _inputs_labels(self, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        tokens = batch["tokens"]
        return tokens[:, :-1], tokens[:, 1:]

    def example_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        return {"tokens": jax.ShapeDtypeStruct((batch_size, self.seq_len + 1), jnp.int32)}
