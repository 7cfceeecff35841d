"""Hardware-exact GEMMs: what a tensor core and its library compute, bit for bit, anywhere.

- :class:`Step`: one tensor-core step as data; :data:`PROFILES`: each device's steps with
  their sources (Hopper checked against H100 captures);
- :class:`Schedule`: how a library runs steps over K (one chain, restart every N, split-K,
  upcast); :data:`PRESETS`: names ``<device>-<library>[-fast]`` (``"h100-cublaslt-fast"``,
  ``"h100-cublaslt"``, ``"h100-xla"``, ...), :data:`PRESET_ALIASES` (``"h100-fast"``, ...);
- :func:`gemm` / :func:`dot_general`: the vectorized model under ``jit``/``vmap``, within
  :data:`MEMORY_BUDGET` (:func:`check_gemm_size`);
  :func:`conv_general_dilated`: a convolution as the implicit GEMM over its patches
  (:class:`ConvGemm`, :func:`conv_gemm`; K = kernel taps, then input channels fastest);
- :func:`mma`: one tensor-core instruction ``D = A @ B + C`` with a float32 ``C`` going in
  (the published feature tests' vectors);
- :func:`fma_pow2`: a GPU's float32 FFMA by a power-of-two scale, exact on any backend
  (DeepGEMM's promotion of a block's partial into its accumulator);
- :func:`step_reference`, :func:`chain_reference`, :func:`block_step_reference`: the scalar
  references, in exact arithmetic apart from the vectorized model (its tests' oracle).
"""

from precisionlab.hardware._conv import ConvGemm, conv_gemm, conv_general_dilated
from precisionlab.hardware._fma import fma_pow2
from precisionlab.hardware._gemm import MEMORY_BUDGET, check_gemm_size, dot_general, gemm
from precisionlab.hardware._mma import mma
from precisionlab.hardware._presets import (
    AMBIGUOUS_PRESETS,
    LIBRARIES,
    PRESET_ALIASES,
    PRESETS,
    canonical_preset,
    preset,
    resolve,
    xla_split,
)
from precisionlab.hardware._profiles import PROFILES, Profile, get_profile
from precisionlab.hardware._reference import block_step_reference, chain_reference, step_reference
from precisionlab.hardware._schedule import Schedule
from precisionlab.hardware._step import Step

__all__ = [
    "AMBIGUOUS_PRESETS",
    "LIBRARIES",
    "MEMORY_BUDGET",
    "PRESETS",
    "PRESET_ALIASES",
    "PROFILES",
    "ConvGemm",
    "Profile",
    "Schedule",
    "Step",
    "block_step_reference",
    "canonical_preset",
    "chain_reference",
    "check_gemm_size",
    "conv_gemm",
    "conv_general_dilated",
    "dot_general",
    "fma_pow2",
    "gemm",
    "get_profile",
    "mma",
    "preset",
    "resolve",
    "step_reference",
    "xla_split",
]
