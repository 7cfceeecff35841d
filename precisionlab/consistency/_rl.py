"""The consequence: on-policy REINFORCE whose sampler and trainer differ only in numerics.

A small transformer policy learns a toy sequence task: after a start token it writes
``length`` tokens and is rewarded by the share of them equal to a fixed target sequence
(``target[t] = (3 t + 1) mod vocab``). Every step the sampler draws a batch of sequences token
by token and records its log-probabilities; the trainer recomputes them (one full-sequence
call, with gradients) and takes a REINFORCE step, ``-mean_b (R_b - mean R) sum_t w_bt log
p_trainer(x_bt)``, with Adam. Three samplers per format:

- ``matched``: the trainer's own full-sequence program, run on the prefix at each position
  (the exact on-policy baseline: the sampled distribution is the trainer's);
- ``decode``: KV-cache decoding with the split-KV attention (the inference engine);
- ``decode+tis``: the same, with truncated importance sampling (Yao et al., *Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training*, 2025): each token's weight
  ``w = min(p_trainer / p_sampler, cap)``, not differentiated.

Everything else is identical across the runs: the initial weights, the Gumbel noise that
draws each token (same seed, same step, same position), the optimizer. What differs between
``matched`` and ``decode`` is only the sampler's arithmetic. A difference in the arithmetic
changes a sampled token now and then, and from there the runs follow other paths: single
runs differ by that chaos, so :func:`reinforce` runs several seeds, and every step also
measures the mismatch's effect on the update itself, on the same batch: how much the
truncated importance weights change the gradient (``tis_change``, ``||g_w - g||/||g||``)
against the batch's own sampling noise (``noise``, ``||g_1 - g_2||/||g||`` of its halves).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from precisionlab.consistency._lm import TransformerLM
from precisionlab.consistency._stack import Stack
from precisionlab.train import make_model

__all__ = ["SAMPLERS", "RLConfig", "reinforce"]

#: The samplers of :func:`reinforce`.
SAMPLERS = ("matched", "decode", "decode+tis")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The toy task and its training (see the module docstring)."""

    vocab: int = 8
    length: int = 8
    d_model: int = 32
    depth: int = 2
    heads: int = 4
    batch: int = 64
    steps: int = 150
    lr: float = 3e-3
    seed: int = 0
    tis_cap: float = 2.0
    kv_block: int = 4

    def __post_init__(self) -> None:
        for f in ("vocab", "length", "d_model", "depth", "heads", "batch", "steps", "kv_block"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RLConfig.{f} must be a positive int; got {v!r}")
        if self.vocab < 2:
            raise ValueError(f"RLConfig.vocab must be >= 2; got {self.vocab}")
        for f in ("lr", "tis_cap"):
            v = getattr(self, f)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 < v < 1e6:
                raise ValueError(f"RLConfig.{f} must be a number in (0, 1e6); got {v!r}")


def _target(cfg: RLConfig) -> np.ndarray:
    return (3 * np.arange(cfg.length) + 1) % cfg.vocab


def _logp_of(logits: jax.Array, tok: jax.Array) -> jax.Array:
    """float32 log-softmax of the stack's logits, at ``tok``."""
    lp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tok[..., None], axis=-1)[..., 0]


def _draw(logits: jax.Array, key: jax.Array) -> jax.Array:
    """Gumbel-max in float32: the same noise for every run."""
    g = jax.random.gumbel(key, logits.shape, jnp.float32)
    return jnp.argmax(jnp.asarray(logits, jnp.float32) + g, axis=-1).astype(jnp.int32)


@functools.cache
def _programs(fmt: str, cfg: RLConfig) -> tuple:
    """The model and the jitted programs of one format: every sampler and seed shares them
    (the truncation is an argument of ``update``, not a program of its own)."""
    # Stack parses a format name into a Policy in __post_init__ (as documented); its field's
    # type says what it holds after that
    pol = Stack(policy=fmt).policy  # type: ignore[arg-type]
    L, B = cfg.length, cfg.batch
    model = make_model("transformer", vocab_size=cfg.vocab, seq_len=L, d_model=cfg.d_model,
                       depth=cfg.depth, heads=cfg.heads)  # fmt: skip
    lm = TransformerLM(model)
    opt = optax.adam(cfg.lr)
    target = jnp.asarray(_target(cfg))

    @jax.jit
    def full(params: Any, tokens: jax.Array) -> jax.Array:
        # the trainer's program: inputs [B, L] -> logits [B, L, V]
        return lm.logits(params, tokens, pol)

    @jax.jit
    def step_decode(
        params: Any, cache: Any, tok: jax.Array, pos: jax.Array
    ) -> tuple[jax.Array, Any]:
        logits, cache, _ = lm.decode(params, cache, tok, pos, pol, kv_block=cfg.kv_block)
        return logits, cache

    @jax.jit
    def update(
        params: Any, state: Any, seq: jax.Array, lp_sampler: jax.Array, tis: jax.Array
    ) -> tuple[Any, Any, tuple[jax.Array, ...]]:
        out = seq[:, 1:]
        reward = jnp.mean((out == target).astype(jnp.float32), axis=1)
        adv = reward - jnp.mean(reward)

        def weighted(
            p: Any, weights: jax.Array
        ) -> jax.Array:  # per-token weights w [B, L] (not differentiated)
            lp = _logp_of(full(p, seq[:, :L]), out)
            return -jnp.mean(adv[:, None] * weights * lp)

        lp = _logp_of(full(params, seq[:, :L]), out)
        delta = lp - lp_sampler
        w_tis = jnp.minimum(jnp.exp(delta), cfg.tis_cap)
        half = (jnp.arange(B) < B // 2).astype(jnp.float32)[:, None] * jnp.ones_like(lp)
        g_1 = jax.grad(weighted)(params, half)  # the two halves of the batch
        g_2 = jax.grad(weighted)(params, 1 - half)
        g_plain = jax.tree.map(jnp.add, g_1, g_2)  # the whole batch's gradient
        g_tis = jax.grad(weighted)(params, w_tis)

        def norm(t: Any) -> jax.Array:
            return jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(t)))

        def dist(a: Any, b: Any) -> jax.Array:
            return norm(jax.tree.map(jnp.subtract, a, b))

        gn = jnp.maximum(norm(g_plain), 1e-30)
        g = jax.tree.map(lambda a, b: jnp.where(tis, a, b), g_tis, g_plain)
        upd, state = opt.update(g, state, params)
        stats = (jnp.mean(reward), delta, dist(g_tis, g_plain) / gn, dist(g_1, g_2) / gn)
        return optax.apply_updates(params, upd), state, stats

    return model, lm, opt, pol, full, step_decode, update


def reinforce(fmt: str, sampler: str, cfg: RLConfig | None = None,
              seeds: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:  # fmt: skip
    """Runs of one policy format ``fmt`` (``"bf16"``, ``"fp16"``, ``"fp32"``) and one sampler
    of :data:`SAMPLERS`, one per seed (``cfg.seed + seed``; the programs compile once).
    Each run: ``{"format", "sampler", "seed", "reward": [per step], "mismatch_rms",
    "mismatch_max", "clip_share", "tis_change", "noise": [per step], "final_reward"}`` (the
    mismatch: log p_trainer - log p_sampler of the sampled tokens, nats; the clip share:
    importance ratios outside [0.8, 1.2]; ``final_reward``: the mean of the last 10 steps)."""
    cfg = cfg or RLConfig()
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; allowed: {', '.join(SAMPLERS)}")
    if cfg.batch < 2 or cfg.batch % 2:
        raise ValueError(f"RLConfig.batch must be even (the noise compares its halves); got "
                         f"{cfg.batch}")  # fmt: skip
    model, lm, opt, pol, full, step_decode, update = _programs(fmt, cfg)
    L, B = cfg.length, cfg.batch

    def sample(params: Any, step: int, seed: int) -> tuple[jax.Array, jax.Array]:
        seq = jnp.zeros((B, L + 1), jnp.int32)  # token 0 starts every sequence
        lps = []
        cache = lm.init_cache(params, B, L, pol) if sampler != "matched" else None
        for t in range(L):
            key = jax.random.fold_in(jax.random.PRNGKey(seed + 7919), step * 1000 + t)
            if sampler == "matched":
                logits = full(params, seq[:, :L])[:, t]
            else:
                logits, cache = step_decode(params, cache, seq[:, t], jnp.int32(t))
            tok = _draw(logits, key)
            lps.append(_logp_of(logits, tok))
            seq = seq.at[:, t + 1].set(tok)
        return seq, jnp.stack(lps, axis=1)

    tis = jnp.asarray(sampler == "decode+tis")
    lo, hi = np.log(0.8), np.log(1.2)
    runs = []
    for seed in seeds:
        params = model.init(jax.random.PRNGKey(cfg.seed + seed))
        state = opt.init(params)
        keys = ("reward", "mismatch_rms", "mismatch_max", "clip_share", "tis_change", "noise")
        hist: dict[str, list[float]] = {k: [] for k in keys}
        for step in range(cfg.steps):
            seq, lp_s = sample(params, step, cfg.seed + seed)
            params, state, (reward, delta, change, noise) = update(params, state, seq, lp_s,
                                                                   tis)  # fmt: skip
            d = np.asarray(delta, np.float64)
            hist["reward"].append(float(reward))
            hist["mismatch_rms"].append(float(np.sqrt(np.mean(d * d))))
            hist["mismatch_max"].append(float(np.max(np.abs(d))))
            hist["clip_share"].append(float(np.mean((d < lo) | (d > hi))))
            hist["tis_change"].append(float(change))
            hist["noise"].append(float(noise))
        runs.append({"format": fmt, "sampler": sampler, "seed": cfg.seed + seed, **hist,
                     "final_reward": float(np.mean(hist["reward"][-10:]))})  # fmt: skip
    return runs
