"""Low-precision matmul recipes (FP8, MX, NVFP4) emulated exactly on any XLA backend.

- Recipes (frozen dataclasses, the source rule in each docstring): :class:`Delayed`,
  :class:`Current`, :class:`Rowwise`, :class:`Blockwise`, :class:`MX`, :class:`NVFP4`,
  :class:`Reference`; by name with :func:`get_recipe` (:data:`RECIPE_NAMES`: ``delayed``,
  ``current``, ``rowwise``, ``rowwise_with_gw_hp``, ``blockwise``, ``mxfp8``, ``mxfp6``,
  ``mxfp4``, ``nvfp4``, ``bf16``, ``fp32``), and the published 4-bit training recipes, each
  exact to its paper (:class:`NvidiaFP4`, :class:`TsengFP4`, :class:`Quartet`,
  :class:`QuartetII`, :class:`FourOverSix`, :class:`TetraJet`, :class:`TetraJetV2`,
  :class:`FP4AllTheWay`: ``nvidia_fp4``, ``tseng_fp4``, ``quartet``, ``quartet2``,
  ``four_over_six``, ``tetrajet``, ``tetrajet_v2``, ``fp4_all_the_way``; :func:`osci_reset`,
  TetraJet-v2's OsciReset, an optax transformation).
- :func:`dot_general` (``lax.dot_general``'s signature), :func:`matmul`, :func:`einsum`:
  custom VJP quantizing the fprop, dgrad and wgrad GEMMs' operands as the recipe says;
  :func:`conv_general_dilated`: a convolution quantized as the GEMM over its patches
  (K = kernel taps, then input channels fastest).
- :func:`apply`: any JAX function with its matmuls and convolutions quantized (a jaxpr
  interpreter, :mod:`precisionlab.intercept`), each site named by the parameter it multiplies
  (include/exclude by path, glob or regular expression), products of two activations
  (attention) left out unless ``attention=True``, and delayed-scaling state.
- :class:`RecipeSpec` / :class:`AppliedRecipe`: the contract a training recipe and its applied
  form keep (``stateful``, ``apply``; ``sites``, ``init_state``, ``value_and_grad``,
  ``update_state``), kept by ``train.TrainRecipe`` and ``diagnose``'s ``AutoSwitchRecipe``.
- :func:`fprop_gemm`, :func:`vjp_gemms`, :func:`operand_gemm`, :class:`GemmRecord`: the
  steps of :func:`dot_general` one by one, with a ``tap`` receiving what each GEMM computed
  (:mod:`precisionlab.verify` records and recomputes them).
- :func:`accumulate`: the sequential m-bit accumulator, a study model, not hardware
  (``accumulate_bits``, ``promote_every`` on every recipe); ``accumulate="h100-fast"``,
  ``"h100-cublaslt"``, ... on every recipe computes the GEMMs as that device does instead
  (:mod:`precisionlab.hardware`); the block-scaled recipes (``mxfp8``, ``mxfp4``, ``nvfp4``)
  take Blackwell's presets (``"b200"``): its block-scaled MMA on their elements and scales.
"""

from precisionlab.recipes._accumulate import accumulate
from precisionlab.recipes._apply import (
    Applied,
    apply,
    combine_observed,
    einsum,
    init_site_state,
    update_site_state,
)
from precisionlab.recipes._contract import AppliedRecipe, RecipeSpec
from precisionlab.recipes._conv import conv_general_dilated
from precisionlab.recipes._dot import (
    WEIGHT_OPERANDS,
    GemmRecord,
    canonical_operand,
    dot_general,
    fprop_gemm,
    matmul,
    operand_gemm,
    vjp_gemms,
)
from precisionlab.recipes._fp4 import (
    FourOverSix,
    FP4AllTheWay,
    FP4Recipe,
    FP4Step,
    NvidiaFP4,
    Quartet,
    QuartetII,
    TetraJet,
    TetraJetV2,
    TsengFP4,
    forward_weight_quantizer,
    fp4_step_tap,
    osci_reset,
    replay_fp4_step,
)
from precisionlab.recipes._names import RECIPE_NAMES, get_recipe
from precisionlab.recipes._recipes import (
    MX,
    NVFP4,
    Blockwise,
    Current,
    Delayed,
    Recipe,
    Reference,
    Rowwise,
)

__all__ = [
    "MX",
    "NVFP4",
    "RECIPE_NAMES",
    "WEIGHT_OPERANDS",
    "Applied",
    "AppliedRecipe",
    "Blockwise",
    "Current",
    "Delayed",
    "FP4AllTheWay",
    "FP4Recipe",
    "FP4Step",
    "FourOverSix",
    "GemmRecord",
    "NvidiaFP4",
    "Quartet",
    "QuartetII",
    "Recipe",
    "RecipeSpec",
    "Reference",
    "Rowwise",
    "TetraJet",
    "TetraJetV2",
    "TsengFP4",
    "accumulate",
    "apply",
    "canonical_operand",
    "combine_observed",
    "conv_general_dilated",
    "dot_general",
    "einsum",
    "forward_weight_quantizer",
    "fp4_step_tap",
    "fprop_gemm",
    "get_recipe",
    "init_site_state",
    "matmul",
    "operand_gemm",
    "osci_reset",
    "replay_fp4_step",
    "update_site_state",
    "vjp_gemms",
]
