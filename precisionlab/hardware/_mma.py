"""``mma``: one tensor-core instruction, ``D = A @ B + C``, with a float32 ``C`` going in.

:func:`precisionlab.hardware.gemm` models a library's GEMM, which starts every output from a
zero accumulator. The feature tests of the literature (FTTN, Fasi et al. 2021, Khattak and
Mikaitis) instead probe one matrix-multiply-accumulate instruction with a chosen nonzero
``C``; :func:`mma` runs such vectors through a device's profile: gemm's chain of the
profile's steps over K in order (one chain, no schedule), ``C`` entering the first step.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from precisionlab.hardware._gemm import EIGHT, as_operand, chain_all, poison, specials
from precisionlab.hardware._presets import Resolved
from precisionlab.hardware._profiles import DEVICE_ALIASES, Profile, check_inputs, get_profile
from precisionlab.hardware._schedule import Schedule
from precisionlab.hardware._step import Step

__all__ = ["mma"]

_KINDS = {
    "float16": "16bit",
    "bfloat16": "16bit",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def _check_kind(a_dtype: Any, b_dtype: Any) -> str:
    na, nb = jnp.dtype(a_dtype).name, jnp.dtype(b_dtype).name
    ka, kb = _KINDS.get(na), _KINDS.get(nb)
    if ka is None or ka != kb or (ka == "16bit" and na != nb):
        raise ValueError(
            f"mma: unsupported operand dtypes {na} x {nb}; supported: float16 x float16, "
            "bfloat16 x bfloat16, or FP8 (float8_e4m3fn / float8_e5m2, mixed allowed); "
            "block-scaled FP4 runs through hardware.gemm with block scales"
        )
    return ka


def _resolve_step(
    device: str, kind: str, names: tuple[str, str], overrides: dict
) -> tuple[Profile, Step]:
    dev = DEVICE_ALIASES.get(str(device).lower(), str(device).lower())
    prof = get_profile(dev, kind)  # ValueError listing devices / devices with this kind
    check_inputs(prof.device, kind, names, "mma")
    fields = {f.name for f in dataclasses.fields(Step)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"mma: unknown override(s) {', '.join(unknown)}; allowed (Step fields): "
            + ", ".join(sorted(fields))
        )
    assert prof.step is not None  # get_profile raised for a profile without one
    return prof, dataclasses.replace(prof.step, **overrides)


@partial(jax.jit, static_argnames=("prof", "step"))
def _mma(
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    bad_a: jax.Array,
    bad_b: jax.Array,
    *,
    prof: Profile,
    step: Step,
) -> jax.Array:
    # gemm's chain with C as the first step's accumulator, one chain over K
    acc = chain_all(a, b, Resolved(prof, step, Schedule()), init=c)
    return poison(specials(a, b, acc, init=c), bad_a, bad_b)


def mma(a: jax.Array, b: jax.Array, c: jax.Array, device: str = "h100", *,
        a_format: str | None = None, b_format: str | None = None,
        **overrides: Any) -> jax.Array:  # fmt: skip
    """``D = A @ B + C`` as one tensor-core instruction of ``device`` computes it.

    a: (M, K) and b: (K, N), float16 x float16, bfloat16 x bfloat16 or FP8
    (float8_e4m3fn / float8_e5m2, mixed allowed); c: (M, N) float32, the accumulator going
    in. Returns float32 (M, N). The device's profile (:data:`PROFILES`, ``"16bit"`` or
    ``"fp8"`` by the dtypes) gives the step; K must be a multiple of its ``products``
    (a100: 8, v100: 4, h100 16-bit: 16, h100 FP8: 32, ...): the steps run over K in order,
    ``c`` entering the first, each step's float32 result the next one's accumulator (an
    ``mma.m16n8k16`` on an A100 is K = 16: two fused 8-product steps). ``overrides``: any
    :class:`Step` field (``fraction_bits=24``, ...). Jittable (``device`` and overrides
    static) and vmappable. Unknown device, dtype, override, a device without the instruction
    (bfloat16 on v100, FP8 before Ada) or K not a multiple: ``ValueError`` saying what exists.
    ``a_format``/``b_format`` (``"float8_e4m3fn"`` or ``"float8_e5m2"``): ``a``/``b`` hold
    that format's codes (uint8 or uint16), decoded as an array of the dtype would be (NaN,
    inf, zeros, subnormals); a code past 8 bits is a ValueError (under a trace: NaN outputs).
    """
    for fmt, which in ((a_format, "a"), (b_format, "b")):
        if fmt is not None and fmt not in EIGHT:
            raise ValueError(f"mma: {which}_format {fmt!r}; allowed: {', '.join(EIGHT)}")
    a, _, bad_a = as_operand(a, a_format, "a") if a_format else (jnp.asarray(a), None, None)
    b, _, bad_b = as_operand(b, b_format, "b") if b_format else (jnp.asarray(b), None, None)
    c = jnp.asarray(c)
    if a.ndim != 2 or b.ndim != 2 or c.ndim != 2 or a.shape[1] != b.shape[0] \
            or c.shape != (a.shape[0], b.shape[1]):  # fmt: skip
        raise ValueError(
            f"mma needs a (M, K), b (K, N) and c (M, N); got {a.shape}, {b.shape}, {c.shape}"
        )
    if c.dtype != jnp.float32:
        raise ValueError(f"mma: c must be float32 (the accumulator); got {c.dtype}")
    kind = _check_kind(a.dtype, b.dtype)
    names = (jnp.dtype(a.dtype).name, jnp.dtype(b.dtype).name)
    prof, step = _resolve_step(device, kind, names, overrides)
    w = step.products
    if a.shape[1] == 0 or a.shape[1] % w:
        raise ValueError(
            f"mma: K={a.shape[1]} is not a positive multiple of the {device} {kind} step's "
            f"{w} products; allowed: K = {w}, {2 * w}, {3 * w}, ..."
        )
    return _mma(a, b, c, bad_a, bad_b, prof=prof, step=step)
