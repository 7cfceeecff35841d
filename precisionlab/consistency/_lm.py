"""Language models the consistency lab runs both ways: a full-sequence call (the trainer) and
token-by-token decoding with a KV cache (the sampler).

:class:`LM` is the interface: a subclass computes one pass in ``forward`` (and one decoding
step in ``decode_step``), handing each named layer output to the pass's :class:`Taps`;
``LM.logits`` and ``LM.decode`` check the options against the layers the model names.
:class:`TransformerLM` implements it for the built-in transformer
(:class:`precisionlab.train._models.Transformer`), computing exactly what its ``apply``
computes in ``"full"`` mode (tested bit for bit), with layer outputs that can be captured and
patched (the attribution). :class:`FunctionLM` wraps a plain ``logits_fn(params, tokens)``:
full-sequence only, no layers to patch.

A patch is ``{layer: (flag, value)}``: where the boolean scalar ``flag`` is true, the layer's
output is replaced by ``value`` (same shape; in decode, the row of the current position), so
one compiled program serves every patched layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.mixed import ops
from precisionlab.mixed._policy import Policy
from precisionlab.train._models import Transformer

__all__ = ["LM", "FunctionLM", "Taps", "TransformerLM", "as_lm"]

Patch = dict[str, tuple[jax.Array, jax.Array]]


@dataclasses.dataclass
class Taps:
    """The options and named layer outputs of one pass: ``taps(name, x)`` returns ``x``
    patched by ``patch`` (where it names ``name``) and, with ``capture``, keeps it in
    ``acts``; ``lm_head_fp32``: the unembedding in float32 (float32 logits)."""

    lm_head_fp32: bool = False
    patch: Patch | None = None
    capture: bool = False
    acts: dict[str, jax.Array] = dataclasses.field(default_factory=dict)

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        x = _apply_patch(name, x, self.patch)
        if self.capture:
            self.acts[name] = x
        return x


class LM:
    """The interface of a language model for the consistency lab.

    Attributes:
      layers: names of the layer outputs that can be captured and patched, in program order
        (empty: no attribution).
      takes_policy: True when the model computes under the policy it is given (it casts its
        params and rounds its results); False for a plain function, which the lab runs on
        params cast to the compute dtype (native) or under ``emulate`` with the policy.
      decodes: True when the model implements :meth:`LM.init_cache` and
        :meth:`LM.decode_step` (:meth:`LM.decode` refuses a model that does not).
    """

    layers: tuple[str, ...] = ()
    takes_policy: bool = True
    decodes: bool = False

    def logits(self, params: Any, tokens: jax.Array, policy: Policy, *,
               lm_head_fp32: bool = False, patch: Patch | None = None,
               capture: bool = False) -> Any:  # fmt: skip
        """Logits [B, T, V] of int32 ``tokens`` [B, T] (with ``capture``: and a dict layer ->
        output [B, T, ...]); ``lm_head_fp32``: the unembedding in float32, float32 logits;
        ``patch``: see the module docstring."""
        taps = self.taps(lm_head_fp32=lm_head_fp32, patch=patch, capture=capture)
        logits = self.forward(params, tokens, policy, taps)
        return (logits, taps.acts) if capture else logits

    def decode(self, params: Any, cache: Any, token: jax.Array, pos: jax.Array,
               policy: Policy, *, kv_block: int | None = None, lm_head_fp32: bool = False,
               patch: Patch | None = None, capture: bool = False) -> Any:  # fmt: skip
        """One decoding step: ``token`` int32 [B] at position ``pos`` (an int32 scalar,
        traced) -> (logits [B, V], the updated cache, a dict layer -> output [B, ...] (empty
        without ``capture``)); ``kv_block``: keys attended in blocks of this many."""
        if not self.decodes:
            raise ValueError(
                f"{type(self).__name__} has no KV-cache decoding; a model that decodes token "
                "by token is an LM such as TransformerLM"
            )
        taps = self.taps(lm_head_fp32=lm_head_fp32, patch=patch, capture=capture)
        logits, cache = self.decode_step(params, cache, token, pos, policy, taps, kv_block)
        return logits, cache, taps.acts

    def taps(
        self, *, lm_head_fp32: bool = False, patch: Patch | None = None, capture: bool = False
    ) -> Taps:
        """The :class:`Taps` of one pass with these options; ValueError where they name a
        layer this model does not (a float32 LM head needs ``"lm_head"`` among its layers)."""
        name = type(self).__name__
        if lm_head_fp32 and "lm_head" not in self.layers:
            raise ValueError(
                "lm_head_fp32 needs a model that names its LM head (an LM such as "
                f"TransformerLM); {name} has no 'lm_head' layer to keep in float32"
            )
        if (patch or capture) and not self.layers:
            raise ValueError(
                f"{name} has no layers to capture or patch; wrap the model as an LM that names "
                "them (see TransformerLM)"
            )
        unknown = [k for k in patch or () if k not in self.layers]
        if unknown:
            raise ValueError(
                f"cannot patch {unknown[0]!r}: {name}'s layers are {', '.join(self.layers)}"
            )
        return Taps(lm_head_fp32, patch, capture)

    def forward(self, params: Any, tokens: jax.Array, policy: Policy, taps: Taps) -> jax.Array:
        """The logits [B, T, V] of one full-sequence pass, each named layer output ``x``
        passed on as ``taps(name, x)``."""
        raise NotImplementedError

    def decode_step(self, params: Any, cache: Any, token: jax.Array, pos: jax.Array,
                    policy: Policy, taps: Taps, kv_block: int | None) -> Any:  # fmt: skip
        """(logits [B, V], the updated cache) of one decoding step (see :meth:`decode`)."""
        raise NotImplementedError

    def init_cache(self, params: Any, batch: int, length: int, policy: Policy) -> Any:
        """An empty KV cache for ``batch`` rows of up to ``length`` tokens (a pytree)."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class FunctionLM(LM):
    """A plain ``fn(params, tokens) -> logits [B, T, V]`` as an :class:`LM`: full-sequence
    evaluation only, no layers (see :func:`precisionlab.consistency.logprob_gap`)."""

    fn: Callable[[Any, jax.Array], jax.Array]
    takes_policy = False

    def forward(self, params: Any, tokens: jax.Array, policy: Policy, taps: Taps) -> jax.Array:
        return self.fn(params, tokens)


def as_lm(model: Any) -> LM:
    """``model`` as an :class:`LM`: an LM is returned; the built-in transformer becomes a
    :class:`TransformerLM`; any other callable a :class:`FunctionLM`."""
    if isinstance(model, LM):
        return model

    if isinstance(model, Transformer):
        return TransformerLM(model)
    if callable(model):
        return FunctionLM(model)
    raise TypeError(
        f"expected a logits_fn(params, tokens), an LM or a built-in Transformer; got "
        f"{type(model).__name__}"
    )


def _apply_patch(name: str, x: jax.Array, patch: Patch | None) -> jax.Array:
    if not patch or name not in patch:
        return x
    flag, value = patch[name]
    return jnp.where(flag, jnp.asarray(value).astype(x.dtype), x)


def _fp32(pol: Policy) -> Policy:
    return dataclasses.replace(pol, compute_dtype=np.dtype(np.float32))


@dataclasses.dataclass(frozen=True)
class TransformerLM(LM):
    """The built-in :class:`~precisionlab.train._models.Transformer` as an :class:`LM`.

    ``logits`` computes what ``Transformer.apply`` computes (the same operations in the same
    order: bit for bit, tested), with the layer outputs ``embed``, ``block{i}.attn`` (the
    residual stream after block i's attention), ``block{i}.mlp`` (after its MLP: the block's
    output), ``final_norm`` and ``lm_head`` (the logits). ``decode`` runs one token through
    the same layers with a KV cache: the cache holds each block's keys and values in the
    compute dtype; attention takes the cached keys up to ``pos`` (one softmax over them, or
    blocks of ``kv_block`` keys combined with an online softmax: FlashDecoding's split-KV).
    ``lm_head_fp32`` computes the unembedding in float32 and returns float32 logits.
    """

    model: Any
    decodes = True

    def __post_init__(self) -> None:
        if not isinstance(self.model, Transformer):
            raise TypeError(f"TransformerLM needs a built-in Transformer; got "
                            f"{type(self.model).__name__}")  # fmt: skip

    @property
    def layers(self) -> tuple[str, ...]:  # type: ignore[override]
        """``embed``, ``block{i}.attn``, ``block{i}.mlp`` for each block, ``final_norm``,
        ``lm_head``."""
        blocks = [f"block{i}.{s}" for i in range(self.model.depth) for s in ("attn", "mlp")]
        return ("embed", *blocks, "final_norm", "lm_head")

    # --- pieces shared by both modes --------------------------------------------------
    def _pol(self, name: str, pol: Policy) -> Policy:
        return _fp32(pol) if name in self.model.high_precision else pol

    def _norm(self, x: jax.Array, p: dict[str, Any], name: str, pol: Policy) -> jax.Array:
        if not self.model.use_layernorm:
            return x
        return ops.layer_norm(x, p[f"{name}_scale"], p[f"{name}_bias"], policy=pol)

    def _outliers(self, h: jax.Array, pol: Policy) -> jax.Array:
        m = self.model
        if not m.outlier_channels:
            return h
        scale = np.ones((m.d_model,), np.float32)
        scale[: m.outlier_channels] = m.outlier_scale
        return ops.boundary(h * jnp.asarray(scale, h.dtype), pol)

    def _mlp(self, blk: dict[str, Any], x: jax.Array, pol: Policy) -> jax.Array:
        h = self._outliers(self._norm(x, blk, "ln2", pol), pol)
        u = ops.dense(h, blk["fc1"], blk["fc1_b"], policy=pol)
        u = ops.gelu(u, policy=pol)
        return ops.boundary(x + ops.dense(u, blk["fc2"], blk["fc2_b"], policy=pol), pol)

    def _head(self, params: Any, x: jax.Array, pol: Policy) -> jax.Array:
        if self.model.use_layernorm:
            x = ops.layer_norm(x, params["ln_f_scale"], params["ln_f_bias"], policy=pol)
        return x

    def _unembed(self, params: Any, x: jax.Array, pol: Policy, lm_head_fp32: bool) -> jax.Array:
        hp = _fp32(pol) if lm_head_fp32 else self._pol("unembed", pol)
        logits = ops.matmul(x, params["unembed"], policy=hp)
        return logits if lm_head_fp32 else pol.cast_to_output(logits)

    def _top(self, params: Any, x: jax.Array, pol: Policy, taps: Taps) -> jax.Array:
        """The final norm and the unembedding of the residual stream ``x``: the logits."""
        x = taps("final_norm", self._head(params, x, pol))
        return taps("lm_head", self._unembed(params, x, pol, taps.lm_head_fp32))

    def _blocks(self, params: Any) -> list:
        return list(self.model.unstack_params(params)["blocks"])

    # --- full sequence ----------------------------------------------------------------
    def forward(self, params: Any, tokens: jax.Array, policy: Policy, taps: Taps) -> jax.Array:
        m, pol = self.model, policy
        b, t = tokens.shape
        d, nh = m.d_model, m.heads
        dh = d // nh
        cd = pol.compute_dtype
        emb = jnp.asarray(params["embed"]).astype(cd)
        x = emb[tokens] + jnp.asarray(params["pos"]).astype(cd)[:t]
        x = taps("embed", ops.boundary(x, pol))
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i, blk in enumerate(self._blocks(params)):
            bp = self._pol(f"block{i}", pol)
            cdb = bp.compute_dtype
            h = self._outliers(self._norm(x, blk, "ln1", bp), bp)
            qkv = ops.matmul(h, blk["qkv"], policy=bp)
            q, k, v = jnp.split(qkv.reshape(b, t, 3, nh, dh), 3, axis=2)
            q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
            scale = jnp.asarray(m.act_scale / math.sqrt(dh), cdb)
            acc = bp.op_dtype("matmul_accumulate")
            s = ops.boundary(
                jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=acc).astype(cdb) * scale,
                bp,
            )
            probs = ops.softmax(s, axis=-1, policy=bp, where=causal)
            probs = jnp.where(causal, probs, jnp.zeros((), cdb))
            att = ops.boundary(
                jnp.einsum("bhqk,bkhd->bqhd", probs, v, preferred_element_type=acc), bp
            ).reshape(b, t, d)
            x = ops.boundary(x + ops.matmul(att, blk["proj"], policy=bp), bp)
            x = taps(f"block{i}.attn", x)
            x = taps(f"block{i}.mlp", self._mlp(blk, x, bp))
        return self._top(params, x, pol, taps)

    # --- token-by-token decoding -------------------------------------------------------
    def init_cache(self, params: Any, batch: int, length: int, policy: Policy) -> Any:
        m = self.model
        dh = m.d_model // m.heads
        if length > m.seq_len:
            raise ValueError(f"decoding {length} tokens needs seq_len >= {length} (the model's "
                             f"position table has {m.seq_len})")  # fmt: skip
        shape = (batch, length, m.heads, dh)
        caches = []
        for i in range(m.depth):
            cd = self._pol(f"block{i}", policy).compute_dtype
            caches.append({"k": jnp.zeros(shape, cd), "v": jnp.zeros(shape, cd)})
        return caches

    def decode_step(
        self,
        params: Any,
        cache: Any,
        token: jax.Array,
        pos: jax.Array,
        policy: Policy,
        taps: Taps,
        kv_block: int | None,
    ) -> tuple[jax.Array, Any]:
        m, pol = self.model, policy
        b = token.shape[0]
        d, nh = m.d_model, m.heads
        dh = d // nh
        cd = pol.compute_dtype
        emb = jnp.asarray(params["embed"]).astype(cd)
        posv = jax.lax.dynamic_index_in_dim(jnp.asarray(params["pos"]).astype(cd), pos, 0,
                                            keepdims=False)  # fmt: skip
        x = taps("embed", ops.boundary(emb[token] + posv, pol))  # [B, D]
        new_cache = []
        for i, blk in enumerate(self._blocks(params)):
            bp = self._pol(f"block{i}", pol)
            cdb = bp.compute_dtype
            h = self._outliers(self._norm(x, blk, "ln1", bp), bp)
            qkv = ops.matmul(h, blk["qkv"], policy=bp).reshape(b, 3, nh, dh)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [B, H, Dh]
            kc = jax.lax.dynamic_update_slice(cache[i]["k"], k[:, None].astype(cdb),
                                              (0, pos, 0, 0))  # fmt: skip
            vc = jax.lax.dynamic_update_slice(cache[i]["v"], v[:, None].astype(cdb),
                                              (0, pos, 0, 0))  # fmt: skip
            new_cache.append({"k": kc, "v": vc})
            att = _attend(q, kc, vc, pos, bp, m.act_scale / math.sqrt(dh), kv_block)
            x = ops.boundary(x + ops.matmul(att.reshape(b, d), blk["proj"], policy=bp), bp)
            x = taps(f"block{i}.attn", x)
            x = taps(f"block{i}.mlp", self._mlp(blk, x, bp))
        return self._top(params, x, pol, taps), new_cache


def _attend(
    q: jax.Array,
    kc: jax.Array,
    vc: jax.Array,
    pos: jax.Array,
    pol: Policy,
    scale: float,
    kv_block: int | None,
) -> jax.Array:
    """One query per row against the cache: q [B, H, Dh], kc/vc [B, L, H, Dh] -> [B, H, Dh]
    in the compute dtype, keys after ``pos`` masked."""
    cd = pol.compute_dtype
    acc = pol.op_dtype("matmul_accumulate")
    length = kc.shape[1]
    s = ops.boundary(
        jnp.einsum("bhd,bkhd->bhk", q, kc, preferred_element_type=acc).astype(cd)
        * jnp.asarray(scale, cd),
        pol,
    )
    valid = jnp.arange(length) <= pos  # [L]
    if kv_block is None or kv_block >= length:
        probs = ops.softmax(s, axis=-1, policy=pol, where=valid)
        probs = jnp.where(valid, probs, jnp.zeros((), cd))
        return ops.boundary(jnp.einsum("bhk,bkhd->bhd", probs, vc, preferred_element_type=acc), pol)
    # split-KV: per block of keys a max, unnormalised probabilities (rounded to the compute
    # dtype before their matmul with V, as a flash kernel does), a sum and a partial output;
    # the blocks are then rescaled to the common max and combined (in the softmax's dtype).
    nb = -(-length // kv_block)
    pad = nb * kv_block - length
    sd = pol.op_dtype("softmax")
    b, h = s.shape[:2]
    sp = jnp.pad(s.astype(sd), ((0, 0), (0, 0), (0, pad))).reshape(b, h, nb, kv_block)
    vp = jnp.pad(valid, (0, pad)).reshape(nb, kv_block)
    vcp = jnp.pad(vc, ((0, 0), (0, pad), (0, 0), (0, 0)))
    vcp = vcp.reshape(b, nb, kv_block, *vc.shape[2:])
    neg = jnp.asarray(-jnp.inf, sd)
    mj = jnp.max(jnp.where(vp, sp, neg), axis=-1)  # [B, H, nb]
    live = jnp.isfinite(mj)
    mj_safe = jnp.where(live, mj, jnp.zeros((), sd))
    p = jnp.where(vp, jnp.exp(sp - mj_safe[..., None]), jnp.zeros((), sd))
    lj = jnp.sum(p, axis=-1)
    pc = ops.boundary(p, pol)  # the kernel's P tile in the compute dtype
    oj = jnp.einsum("bhnc,bnchd->bhnd", pc, vcp, preferred_element_type=acc).astype(sd)
    mx = jnp.max(mj, axis=-1, keepdims=True)
    w = jnp.where(live, jnp.exp(mj_safe - mx), jnp.zeros((), sd))
    total = jnp.sum(w * lj, axis=-1)
    o = jnp.sum(w[..., None] * oj, axis=-2) / total[..., None]
    return ops.boundary(o, pol)
