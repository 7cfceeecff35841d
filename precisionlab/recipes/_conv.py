"""The quantized convolution: ``lax.conv_general_dilated``'s signature, quantized by a recipe as
the GEMM over its patches that it equals.

A convolution is the (batched, one GEMM per group) matmul ``y = P W^T`` of its patch matrix
``P`` (M, K) and its kernel rows ``W`` (O, K) (:mod:`precisionlab.hardware._conv`): M the
output positions (batch x output spatial), K the window **in the order (kernel taps
row-major, then C_in fastest)**, K = (kh, kw, C_in) for a 2-D convolution, O the output
features. The recipe quantizes the three GEMMs of that matmul exactly as a dense layer's
(``precisionlab.recipes._dot``), with the same kinds (the kernel is the weight):

- fprop ``y = Q(P) Q(W)^T``: the patches scaled along K per output position (a row of P),
  the kernel along K per output feature (a row of W);
- dgrad ``dP = Q(g) Q(W^T)^T``: the output gradient (M, O) scaled along O per output position,
  the transposed kernel (K, O) along O; ``dx`` is the sum of ``dP`` over the windows each
  input element falls in (col2im, float32, then rounded once to ``x``'s dtype);
- wgrad ``dW = Q(g^T) Q(P^T)^T``: both scaled along M (per output feature, per window entry).

Per-tensor recipes (delayed, current) scale the whole patch matrix, which holds the input's
values (its amax is the input's wherever every input element falls in some window). Block and
2-D tile recipes pad K, M or O with zeros where needed (``pad=True``), as for matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.hardware._conv import conv_gemm
from precisionlab.intercept import _boundary as boundary
from precisionlab.recipes._dot import Weight, as_recipe, checked_operands, qdot3_jit
from precisionlab.recipes._fp4 import FP4Recipe
from precisionlab.recipes._recipes import Recipe

__all__ = ["NOT_COVERED", "conv_general_dilated", "conv_site"]

#: Primitives a recipe could quantize but has no rule for: listed by ``Applied.report`` and
#: warned about once (a grouped matmul's groups have no scaling rule here yet).
NOT_COVERED: tuple[str, ...] = boundary.RAGGED_PRODUCTS


def conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    recipe: Recipe | str,
    state: dict | None = None,
    key: jax.Array | None = None,
    weight: Weight = "rhs",
) -> jax.Array:
    """``lax.conv_general_dilated`` whose forward and backward GEMMs are quantized by
    ``recipe``, as the GEMM over the patches (see the module docstring for the scaled axis of
    each operand).

    Args:
      lhs, rhs: the input and the kernel, as in ``lax.conv_general_dilated``.
      window_strides, padding, lhs_dilation, rhs_dilation: as there.
      dimension_numbers, feature_group_count, batch_group_count: as there.
      precision: accepted and ignored (products are exact and accumulate in float32, or as
        the recipe's ``accumulate=`` says).
      preferred_element_type: as there.
      recipe: a :class:`~precisionlab.recipes.Recipe` or a name, as for
        :func:`~precisionlab.recipes.dot_general` (a named block recipe pads; an FP4 recipe
        runs its own three GEMMs on the patches and kernel rows).
      state: a stateful recipe's state for this convolution, as for
        :func:`~precisionlab.recipes.dot_general` (delayed: lhs = patches, rhs = kernel,
        output gradient; TetraJet's: shaped as the kernel).
      key: PRNG key for stochastic rounding of gradients (NVFP4).
      weight: which operand is the weight: ``"rhs"`` (the kernel; default), ``"lhs"``,
        ``"none"``, ``"both"`` or a pair of kinds, as for ``dot_general``.

    Returns:
      The convolution, dtype ``preferred_element_type`` or the operands' result dtype.
    """
    recipe = as_recipe(recipe)
    kinds, lhs, rhs = checked_operands(recipe, weight, lhs, rhs, state, "convolution")
    plan = conv_gemm(
        lhs.shape, rhs.shape, window_strides=window_strides, padding=padding,
        lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count,
        batch_group_count=batch_group_count,
    )  # fmt: skip
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    # float32 before the patches: the data gradient's windows are summed in float32 (col2im)
    # and rounded once to the input's dtype, as a convolution's dgrad accumulates
    a3 = plan.patches(lhs.astype(jnp.float32))
    b3 = plan.kernel_rows(rhs.astype(jnp.float32))
    if not recipe.stateful:
        state = None
    if isinstance(recipe, FP4Recipe):  # a recipe owning its three GEMMs (recipes._fp4)
        # its state is weight-shaped: put in the GEMM's layout as the weight operand is
        layout = plan.kernel_rows if kinds[1] == "w" else plan.patches
        y = recipe.dot3(kinds, a3, b3, state, key, canon=lambda t: layout(t.astype(jnp.float32)))
        return plan.output(y).astype(out_dtype)
    nums = recipe.given_numbers
    y = qdot3_jit(recipe.with_numbers(None), kinds, a3, b3, state, key, nums)
    return plan.output(y).astype(out_dtype)


def conv_site(
    lhs: jax.Array, rhs: jax.Array, params: dict, recipe: Recipe, weight: Weight,
    state: dict | None, key: jax.Array | None,
) -> jax.Array:  # fmt: skip
    """A matched ``conv_general_dilated`` equation (its parameters ``params``) quantized, with
    the site's ``state`` and ``key`` as :func:`conv_general_dilated` takes them."""
    return conv_general_dilated(
        lhs, rhs, params["window_strides"], params["padding"], params.get("lhs_dilation"),
        params.get("rhs_dilation"), params["dimension_numbers"],
        params.get("feature_group_count", 1), params.get("batch_group_count", 1),
        preferred_element_type=params.get("preferred_element_type"), recipe=recipe,
        state=state, key=key, weight=weight,
    )  # fmt: skip
