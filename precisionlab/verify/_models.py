"""The GEMM models a dump names, computed on the current machine.

- ``"recipe"``: the recipe's own GEMM (:func:`precisionlab.recipes.operand_gemm`): float32
  products summed by XLA at HIGHEST precision, the study accumulator, or the hardware preset
  of the recipe's ``accumulate`` (exact on any machine);
- a hardware preset of :data:`precisionlab.hardware.PRESETS` (``"h100-xla"``,
  ``"h100-cublaslt"``, ...): what that device and library compute, exact on any machine;
- ``"xla-cpu"``: XLA's own ``dot_general`` on the CPU backend, replayed: exact only on a CPU
  (with the same XLA), where a recorded run's native GEMMs are what it computed;
- ``"hp"``: a GEMM a recipe keeps in high precision (float32 at HIGHEST), exact on the
  recording platform.

Models that are exact only on the recording platform (``"xla-cpu"``, ``"hp"``, and
``"recipe"`` without a hardware or sequential accumulator: XLA's float32 summation order)
are flagged, so a GPU dump checked on a CPU says why its float32 sums differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from precisionlab import hardware, recipes
from precisionlab.hardware._gemm import BATCHED_GEMM_DIMS
from precisionlab.recipes import _scaling as S
from precisionlab.verify._tape import compact

__all__ = [
    "HARDWARE_MODELS",
    "NotModelled",
    "check_hardware",
    "hp_gemm",
    "model_gemm",
    "plain_gemm",
    "platform_bound",
    "quantize",
    "recipe_gemm",
]

#: Names a dump's ``hardware`` may take: every preset and alias, and ``"xla-cpu"``.
HARDWARE_MODELS: tuple[str, ...] = ("xla-cpu", *hardware.PRESETS, *hardware.PRESET_ALIASES)


class NotModelled(Exception):
    """No model of this GEMM exists here (a float32 GEMM on a GPU preset; ``"xla-cpu"``
    away from a CPU): the tensor is reported as not checked, with the reason."""


def check_hardware(name: str) -> str:
    """``name`` if it is one of :data:`HARDWARE_MODELS`, else ValueError listing them."""
    if name == "xla-cpu":
        return name
    try:
        return hardware.canonical_preset(name)
    except ValueError as err:
        raise ValueError(f"{err}; or 'xla-cpu' (XLA's own GEMM on a CPU)") from None


def platform_bound(model: str | None, recipe: recipes.Recipe | None = None) -> bool:
    """Whether the model is exact only on the platform that recorded the dump."""
    if model in ("xla-cpu", "hp"):
        return True
    if model == "recipe" and recipe is not None:
        return recipe.accumulate is None and recipe.accumulate_bits is None
    return False


def _need_cpu(what: str) -> None:
    if jax.default_backend() != "cpu":
        raise NotModelled(
            f"{what} replays XLA's CPU GEMM, exact only on a CPU backend (here: "
            f"{jax.default_backend()})"
        )


# --- quantization: the recipe's rule on the recorded input -----------------------------
@partial(jax.jit, static_argnames=("recipe", "kind", "layout"))
def _quantize(
    recipe: recipes.Recipe,
    kind: str,
    layout: Any,
    x: jax.Array,
    scale: jax.Array | None,
    key: jax.Array | None,
) -> dict[str, jax.Array]:
    q = recipe.quantize(x, kind, scale=scale, key=key)
    out = {"codes": q.elems}
    if q.row_inv is not None:
        out["row_scale"] = jnp.asarray(q.row_inv, jnp.float32)
    if q.block_inv is not None:
        out["block_scale"] = compact(jnp.broadcast_to(q.block_inv, x.shape), layout)
    if q.block_exp is not None:
        out["block_exp"] = compact(jnp.broadcast_to(q.block_exp, x.shape).astype(jnp.int32),
                                    layout)  # fmt: skip
    return out


def quantize(
    recipe: recipes.Recipe,
    kind: str,
    layout: Any,
    x: np.ndarray,
    scale: ArrayLike | None,
    key: jax.Array | None,
) -> dict[str, np.ndarray]:
    """The recipe's quantization of the recorded input ``x`` (float32 (B, R, K)) with the
    recorded scale (delayed) and key (stochastic rounding): codes (float32 element values)
    and the row and block factors, as the recorder keeps them."""
    s = None if scale is None else jnp.asarray(scale, jnp.float32)
    return jax.device_get(_quantize(recipe, kind, layout, jnp.asarray(x), s, key))


# --- GEMMs -----------------------------------------------------------------------------
@partial(jax.jit, static_argnames=("recipe", "kinds", "m", "n"))
def _recipe_gemm(
    recipe: recipes.Recipe,
    kinds: tuple[str, str],
    m: int,
    n: int,
    qa: S.QOperand,
    qb: S.QOperand,
) -> jax.Array:
    qa, qb = lax.optimization_barrier((qa, qb))  # as the recorder computes it
    return recipes.operand_gemm(recipe, qa, qb, kinds)[:, :m, :n]


def recipe_gemm(
    recipe: recipes.Recipe, kinds: Sequence[str], m: int, n: int, qa: S.QOperand, qb: S.QOperand
) -> np.ndarray:
    """The recipe's GEMM of two quantized operands, cut to (B, m, n)."""
    return np.asarray(_recipe_gemm(recipe, tuple(kinds), m, n, qa, qb))


@jax.jit
def _hp(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.einsum("bmk,bnk->bmn", a, b, precision=lax.Precision.HIGHEST,
                      preferred_element_type=jnp.float32)  # fmt: skip


def hp_gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 (B, M, K) x (B, N, K) at HIGHEST precision, as XLA sums it here."""
    return np.asarray(_hp(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)))


@partial(jax.jit, static_argnames=("dn", "precision", "pet"))
def _xla_dot(a: jax.Array, b: jax.Array, dn: Any, precision: Any, pet: Any) -> jax.Array:
    return lax.dot_general(a, b, dn, precision=precision, preferred_element_type=pet)


@partial(jax.jit, static_argnames=("dn", "preset", "out_dtype"))
def _preset_dot(a: jax.Array, b: jax.Array, dn: Any, preset: str, out_dtype: str) -> jax.Array:
    return hardware.dot_general(a, b, dn, preset=preset, out_dtype=out_dtype)


def _precision(p: Sequence[Any] | None) -> tuple[lax.Precision | None, ...] | None:
    if p is None:
        return None
    return tuple(None if x is None else lax.Precision[str(x).split(".")[-1]] for x in p)


def model_gemm(
    a: np.ndarray | jax.Array,
    b: np.ndarray | jax.Array,
    dn: Any,
    model: str,
    *,
    precision: Sequence[Any] | None = None,
    pet: str | None = None,
) -> np.ndarray:
    """``dot_general(a, b, dn)`` of typed operands (FP8, 16-bit) as ``model`` computes it:
    ``"xla-cpu"`` (replayed, CPU only) or a hardware preset. NotModelled when the model does
    not cover the operands."""
    dn = tuple(tuple(tuple(int(d) for d in x) for x in y) for y in dn)
    if model == "xla-cpu":
        _need_cpu("'xla-cpu'")
        p = _precision(precision)
        return np.asarray(_xla_dot(jnp.asarray(a), jnp.asarray(b), dn, p,
                                   None if pet is None else jnp.dtype(pet)))  # fmt: skip
    out = pet or jnp.result_type(a.dtype, b.dtype).name
    if out not in ("float32", "float16", "bfloat16"):
        raise NotModelled(f"{model} has no {out} output")
    try:
        return np.asarray(_preset_dot(jnp.asarray(a), jnp.asarray(b), dn, model, out))
    except ValueError as err:  # operand formats the preset's tensor cores do not take
        raise NotModelled(f"{model}: {str(err).splitlines()[0]}") from None


def plain_gemm(
    lhs: np.ndarray | jax.Array, rhs: np.ndarray | jax.Array, params: dict, model: str
) -> np.ndarray:
    """A plain site's ``dot_general`` with its recorded parameters, by ``model``."""
    return model_gemm(lhs, rhs, params["dimension_numbers"], model,
                      precision=params.get("precision"),
                      pet=params.get("preferred_element_type"))  # fmt: skip


def native_gemm(
    a: np.ndarray | jax.Array, b: np.ndarray | jax.Array, factor: ArrayLike | None, model: str
) -> np.ndarray:
    """(B, M, K) x (B, N, K) typed elements by ``model`` (float32 out), times the row
    factors (float32, as the recorded run multiplied them)."""
    acc = model_gemm(a, b, BATCHED_GEMM_DIMS, model, pet="float32")
    return acc if factor is None else np.asarray(jnp.asarray(acc) * jnp.asarray(factor))


def recipe_candidates(recipe: recipes.Recipe) -> list[tuple[str, recipes.Recipe]]:
    """The recipe with each other accumulator it could have (float32, each preset it
    accepts): the alternatives an accumulator diagnosis tries."""
    out = []
    for acc in (None, *hardware.PRESETS):
        if acc == recipe.accumulate and recipe.accumulate_bits is None:
            continue
        try:
            alt = dataclasses.replace(recipe, accumulate=acc, accumulate_bits=None,
                                      promote_every=None)  # fmt: skip
        except (ValueError, TypeError):
            continue
        out.append(("float32 (XLA, HIGHEST)" if acc is None else acc, alt))
    return out


def hardware_candidates(current: str | None) -> list[str]:
    """Every model but ``current``: "xla-cpu" on a CPU, then the presets."""
    names = (["xla-cpu"] if jax.default_backend() == "cpu" else []) + list(hardware.PRESETS)
    return [n for n in names if n != current]


def sixteen_bit_candidates() -> list[str]:
    """Models of a GEMM of 16-bit operands (what a run computed in bf16 would have used)."""
    return ["float32 (XLA, HIGHEST)", *hardware.PRESETS]


def bf16_gemm(a32: np.ndarray, b32: np.ndarray, model: str) -> np.ndarray:
    """The GEMM of float32 (B, M, K), (B, N, K) operands rounded to bfloat16 (a run that
    computed in bf16 where FP8 was asked), float32 out, by ``model``."""
    a = jnp.asarray(a32, jnp.float32).astype(jnp.bfloat16)
    b = jnp.asarray(b32, jnp.float32).astype(jnp.bfloat16)
    if model.startswith("float32"):
        return hp_gemm(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    return model_gemm(a, b, BATCHED_GEMM_DIMS, model, pet="float32")
