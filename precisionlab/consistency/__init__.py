"""The consistency lab: why a trainer and an inference engine disagree.

- :class:`Stack`: a numerics stack (compute format, GPU model or native, full-sequence or
  KV-cache decoding with a batch size, float32 LM head);
- :func:`logprob_gap`: per-token log-probability gaps of two stacks, with the summaries an RL
  run cares about (:class:`Gap`);
- :func:`attribute`: which layer injects the gap, by activation patching;
- :class:`TransformerLM`: the built-in transformer with a KV cache, patchable layers; a model
  of one's own is an :class:`LM` subclass whose ``forward`` hands each layer output to its
  :class:`Taps`;
- batch invariance (:mod:`~precisionlab.consistency._invariance`): :func:`measure_gemm` and
  :func:`measure_model` on the running backend, :func:`predict` for a named GPU;
- order discovery (:mod:`~precisionlab.consistency._order`): :func:`reveal` the summation
  tree of a black-box reduction (FPRev's probes), :func:`schedule_tree` of a hardware
  preset's model, reference orders;
- the consequence (:mod:`~precisionlab.consistency._rl`): :func:`reinforce`, on-policy
  REINFORCE whose sampler and trainer differ only in numerics, with and without truncated
  importance sampling.
"""

from precisionlab.consistency._attribution import Attribution, LayerShare, attribute
from precisionlab.consistency._gap import CLIP, Gap, gap_from_logits, logprob_gap
from precisionlab.consistency._invariance import (
    GemmInvariance,
    ModelInvariance,
    Prediction,
    backend_name,
    measure_gemm,
    measure_model,
    predict,
)
from precisionlab.consistency._lm import LM, FunctionLM, Taps, TransformerLM, as_lm
from precisionlab.consistency._order import (
    Tree,
    blocked_tree,
    masking_values,
    pairwise_tree,
    reveal,
    schedule_tree,
    sequential_tree,
)
from precisionlab.consistency._rl import RLConfig, reinforce
from precisionlab.consistency._run import Result, Runner
from precisionlab.consistency._stack import MODES, Stack, hardware_names, parse_stack

__all__ = [
    "CLIP",
    "LM",
    "MODES",
    "Attribution",
    "FunctionLM",
    "Gap",
    "GemmInvariance",
    "LayerShare",
    "ModelInvariance",
    "Prediction",
    "RLConfig",
    "Result",
    "Runner",
    "Stack",
    "Taps",
    "TransformerLM",
    "Tree",
    "as_lm",
    "attribute",
    "backend_name",
    "blocked_tree",
    "gap_from_logits",
    "hardware_names",
    "logprob_gap",
    "masking_values",
    "measure_gemm",
    "measure_model",
    "pairwise_tree",
    "parse_stack",
    "predict",
    "reinforce",
    "reveal",
    "schedule_tree",
    "sequential_tree",
]
