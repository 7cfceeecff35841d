"""``logprob_gap``: how far two numerics stacks' log-probabilities of the same tokens are.

For tokens [B, T] each stack computes logits [B, T, V]; position t predicts token t + 1. The
log-probabilities are computed from each stack's logits in float64 (the gap is the model's,
not that of a log-softmax done in low precision), and

    delta[b, t] = log p_a(tokens[b, t+1] | tokens[b, :t+1]) - log p_b(...)      [B, T-1], nats

with the summaries an RL practitioner reads: mean, RMS and max |delta|; the share of
importance ratios ``exp(delta)`` outside PPO's clip range [0.8, 1.2]; the mean per-token
KL(p_a || p_b) over the whole vocabulary; the greedy-token flip rate (argmax differs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from precisionlab.consistency._run import Result, Runner
from precisionlab.consistency._stack import Stack, parse_stack

__all__ = ["CLIP", "Gap", "gap_from_logits", "logprob_gap"]

#: PPO's clip range of the importance ratio, the default of :func:`logprob_gap`.
CLIP = (0.8, 1.2)


def _logp(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits).astype(np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


@dataclasses.dataclass(frozen=True)
class Gap:
    """The per-token gap of stack ``a`` against stack ``b`` (see the module docstring).

    Attributes:
      a, b: the two stacks.
      delta: float64 [B, T-1], nats (NaN where either stack's logits are not finite).
      kl_tokens: float64 [B, T-1], KL(p_a || p_b) per position, nats.
      flips: bool [B, T-1], the greedy (argmax) next token differs.
      clip: the importance-ratio range counted by :attr:`Gap.clip_share`.
    """

    a: Stack
    b: Stack
    delta: np.ndarray
    kl_tokens: np.ndarray
    flips: np.ndarray
    clip: tuple[float, float] = CLIP

    @property
    def _finite(self) -> np.ndarray:
        return self.delta[np.isfinite(self.delta)]

    @property
    def nonfinite(self) -> int:
        """Tokens whose delta is not finite (a stack's logits overflowed); the summaries
        are over the others."""
        return int(np.sum(~np.isfinite(self.delta)))

    @property
    def mean_nats(self) -> float:
        """Mean delta (the bias of log p_a against log p_b), nats."""
        d = self._finite
        return float(np.mean(d)) if d.size else math.nan

    @property
    def rms_nats(self) -> float:
        """Root-mean-square delta, nats."""
        d = self._finite
        return float(np.sqrt(np.mean(d * d))) if d.size else math.nan

    @property
    def max_nats(self) -> float:
        """Largest |delta|, nats."""
        d = self._finite
        return float(np.max(np.abs(d))) if d.size else math.nan

    @property
    def clip_share(self) -> float:
        """Share of tokens whose importance ratio exp(delta) is outside ``clip``."""
        d = self._finite
        lo, hi = math.log(self.clip[0]), math.log(self.clip[1])
        return float(np.mean((d < lo) | (d > hi))) if d.size else math.nan

    @property
    def kl(self) -> float:
        """Mean per-token KL(p_a || p_b), nats."""
        k = self.kl_tokens[np.isfinite(self.kl_tokens)]
        return float(np.mean(k)) if k.size else math.nan

    @property
    def flip_rate(self) -> float:
        """Share of positions whose greedy next token differs."""
        return float(np.mean(self.flips)) if self.flips.size else math.nan

    def by_position(self) -> np.ndarray:
        """RMS delta at each position (over the rows), float64 [T-1], nats."""
        d = np.where(np.isfinite(self.delta), self.delta, np.nan)
        with np.errstate(invalid="ignore"):
            return np.sqrt(np.nanmean(d * d, axis=0))

    def summary(self) -> dict[str, Any]:
        """The summaries as plain values: ``a``, ``b`` (labels), ``a_stack``, ``b_stack``
        (their fields), ``mean_nats``, ``rms_nats``, ``max_nats``, ``clip_share``,
        ``flip_rate``, ``kl``, ``tokens``, ``nonfinite``."""
        return {
            "a": self.a.label,
            "b": self.b.label,
            "a_stack": self.a.to_dict(),
            "b_stack": self.b.to_dict(),
            "mean_nats": self.mean_nats,
            "rms_nats": self.rms_nats,
            "max_nats": self.max_nats,
            "clip_share": self.clip_share,
            "flip_rate": self.flip_rate,
            "kl": self.kl,
            "tokens": int(self.delta.size),
            "nonfinite": self.nonfinite,
        }

    def text(self) -> str:
        """Two lines (under 100 columns for the stacks' usual labels): the stacks and the
        log-probability gap, then the ratio, KL and greedy-flip summaries."""
        s = self.summary()
        tail = f", {s['nonfinite']} non-finite" if s["nonfinite"] else ""
        return (
            f"{s['a']} vs {s['b']}: mean {s['mean_nats']:.3g}, rms {s['rms_nats']:.3g}, "
            f"max {s['max_nats']:.3g} nats\n"
            f"  ratio outside [{self.clip[0]}, {self.clip[1]}] {s['clip_share']:.2%}; "
            f"KL {s['kl']:.3g}; greedy flips {s['flip_rate']:.2%} ({s['tokens']} tokens{tail})"
        )


def gap_from_logits(tokens: Any, logits_a: np.ndarray, logits_b: np.ndarray, a: Any = "fp32",
                    b: Any = "fp32", *, clip: tuple[float, float] = CLIP) -> Gap:  # fmt: skip
    """The :class:`Gap` of two logits arrays [B, T, V] of the same ``tokens`` [B, T] (from
    any source: two engines' outputs, saved runs)."""
    tok = np.asarray(tokens)
    la, lb = np.asarray(logits_a), np.asarray(logits_b)
    if tok.ndim != 2 or tok.shape[1] < 2:
        raise ValueError(f"tokens must be [B, T] with T >= 2; got shape {tok.shape}")
    if la.shape != lb.shape or la.shape[:2] != tok.shape:
        raise ValueError(f"logits must both be [B, T, V] for tokens {tok.shape}; got "
                         f"{la.shape} and {lb.shape}")  # fmt: skip
    lo, hi = clip
    if not 0 < lo < 1 < hi:
        raise ValueError(f"clip must be (low, high) with 0 < low < 1 < high; got {clip!r}")
    pa, pb = _logp(la)[:, :-1], _logp(lb)[:, :-1]
    nxt = tok[:, 1:, None].astype(np.int64)
    with np.errstate(invalid="ignore"):
        delta = (np.take_along_axis(pa, nxt, -1) - np.take_along_axis(pb, nxt, -1))[..., 0]
        kl = np.sum(np.exp(pa) * (pa - pb), axis=-1)
    flips = np.argmax(pa, axis=-1) != np.argmax(pb, axis=-1)
    return Gap(parse_stack(a), parse_stack(b), delta, kl, flips, (float(lo), float(hi)))


def logprob_gap(
    logits_fn: Any,
    params: Any,
    tokens: Any,
    a: Any,
    b: Any,
    *,
    clip: tuple[float, float] = CLIP,
    runner: Runner | None = None,
) -> Gap:
    """Per-token ``log p_a - log p_b`` of ``tokens`` under two numerics stacks.

    Args:
      logits_fn: ``logits_fn(params, tokens) -> logits [B, T, V]``, an
        :class:`~precisionlab.consistency._lm.LM`, or a built-in Transformer (run as a
        :class:`~precisionlab.consistency.TransformerLM`, which can also decode). A plain
        function runs in ``mode="full"`` only: natively on params cast to the compute
        dtype (refused if it then computes nothing in that dtype), or under ``emulate``
        with the stack's policy and hardware.
      params: the model's float32 params.
      tokens: int [B, T], T >= 2.
      a, b: the stacks: a :class:`~precisionlab.consistency.Stack`, a format or policy
        string (``"bf16"``: native, full sequence) or a dict of Stack fields.
      clip: the importance-ratio range of :attr:`Gap.clip_share` (PPO's [0.8, 1.2]).
      runner: a :class:`~precisionlab.consistency.Runner` for this model and params, to
        reuse compiled programs across calls.

    Returns:
      A :class:`Gap`. Two identical stacks give exactly 0 (every program is deterministic).
    """
    sa, sb = parse_stack(a), parse_stack(b)
    if runner is not None and runner.params is not params:
        raise ValueError("runner was made for other params; pass the same params object or "
                         "no runner")  # fmt: skip
    run = runner if runner is not None else Runner(logits_fn, params)
    ra: Result = run.run(sa, tokens)
    rb: Result = run.run(sb, tokens)
    return gap_from_logits(tokens, ra.logits, rb.logits, sa, sb, clip=clip)
