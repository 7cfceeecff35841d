"""The compute-dtype audit: which dtype each matmul and convolution of a function really
multiplies in, and whether a requested 16-bit policy happened.

A policy that casts the parameters to bfloat16 does not make a model compute in bfloat16: a
float32 input, a float32 parameter the cast missed, or a module whose ``dtype`` was fixed at
construction (Flax NNX's ``nnx.Embed`` takes its parameter's float32 when ``dtype`` is left
None) promotes the activations back to float32, and every later layer multiplies in float32
(JAX promotes its bfloat16 weights to meet them). Nothing fails; the run is just not the one
asked for. :func:`audit` traces the function (no computation) and lists each matmul and
convolution with the parameter it multiplies, its operand dtypes and the dtype it multiplies
in; with a 16-bit ``policy`` it warns (:class:`ComputeDtypeWarning`) when most of the FLOPs
run in float32, naming the first float32 matmul and the first operation that promoted its
operands, and why (read from the program's dataflow,
``precisionlab.intercept._dataflow``).
"""

from __future__ import annotations

import dataclasses
import textwrap
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from precisionlab.intercept import Context, Promotion, Site, flops_by_dtype, intercept
from precisionlab.intercept import _boundary as boundary
from precisionlab.mixed._policy import get_policy

__all__ = ["Audit", "AuditSite", "ComputeDtypeWarning", "audit"]

#: The share of FLOPs in 32 bits or more above which a 16-bit request is called unmet.
THRESHOLD = 0.5


class ComputeDtypeWarning(UserWarning):
    """A 16-bit policy was requested, and most of the matmul and convolution FLOPs run in
    float32 (see :func:`audit`)."""


class AuditSite(NamedTuple):
    """One matmul or convolution: ``name`` (``"dot_general[3]"``), ``param`` (the parameter
    it multiplies, ``""`` for two activations), ``in_dtypes``, ``out_dtype``,
    ``compute_dtype`` (what it multiplies in: its widest floating operand's dtype), ``flops``
    (per call of the function, loop iterations counted), ``where`` (source line)."""

    name: str
    param: str
    in_dtypes: tuple[str, ...]
    out_dtype: str
    compute_dtype: str
    flops: int
    where: str


@dataclasses.dataclass(frozen=True)
class Audit:
    """What :func:`audit` found.

    Attributes:
      requested: the policy's compute dtype name (None without a policy).
      sites: every matmul and convolution, in program order.
      flops: FLOPs per compute dtype, largest first.
      promotion: the first operation (in program order) that turned a 16-bit value into the
        float32 operands of the first float32 matmul, or None.
      cause: without a promotion, why that matmul's operands are float32 (``""`` otherwise).
      first_float32: that matmul's name (``""`` when none multiplies in 32 bits or more).
      warning: the :class:`ComputeDtypeWarning` message, or ``""`` when the request was met.
    """

    requested: str | None
    sites: tuple[AuditSite, ...]
    flops: dict[str, int]
    promotion: Promotion | None
    cause: str
    first_float32: str
    warning: str

    def share(self, dtype: str) -> float:
        """The fraction of the FLOPs that multiply in ``dtype`` (0 when there are none)."""
        total = sum(self.flops.values())
        return self.flops.get(dtype, 0) / total if total else 0.0

    def text(self) -> str:
        """A table of the sites, the FLOPs per dtype and the warning (if any)."""
        lines = [f"{'site':<24} {'multiplies':<24} {'operands':<20} {'in':<9} {'FLOPs':>12}"]
        for s in self.sites:
            ops = " x ".join(_short(d) for d in s.in_dtypes)
            lines.append(
                f"{s.name:<24} {s.param or '(activations)':<24} {ops:<20} "
                f"{_short(s.compute_dtype):<9} {s.flops:>12,}"
            )
        total = sum(self.flops.values())
        shares = ", ".join(f"{d} {100 * f / total:.1f}%" for d, f in self.flops.items())
        asked = f" (requested: {self.requested})" if self.requested else ""
        lines.append(f"FLOPs by compute dtype: {shares or '-'}{asked}")
        if self.warning:
            lines.append(textwrap.fill("WARNING: " + self.warning, 100, subsequent_indent="  "))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}.get(
        dtype, dtype
    )


class _Products:
    """Matches every matmul and convolution and leaves it as it is."""

    primitives = boundary.PRODUCTS
    emits = False
    label = "audit"

    def apply(self, ctx: Context, *operands: Any, **params: Any) -> list:
        return ctx.original(*operands)


def _runs(site: Site) -> int:
    return int(np.prod([n for n in site.lengths if n is not None], dtype=np.int64))


def audit(
    fn: Callable,
    *args: Any,
    policy: Any = None,
    params: int | Sequence[int] | None = None,
    warn: bool = True,
    **kwargs: Any,
) -> Audit:
    """Which dtype each matmul and convolution of ``fn(*args, **kwargs)`` multiplies in.

    Args:
      fn: the function as you run it (a loss, ``model.apply``, ``lambda p, x:
        nnx.merge(graphdef, policy.cast_to_compute(p))(x)``): traced, not run (arguments
        may be ShapeDtypeStructs).
      policy: the policy you asked for (a :class:`~precisionlab.mixed.Policy`, a policy
        string ``"p=f32,c=bf16"``, a jmp policy or a dtype): its compute dtype is what the
        matmuls should multiply in. None: list only.
      params: the positions of the arguments holding parameters (for the sites' labels; see
        :func:`precisionlab.intercept.intercept`).
      warn: issue a :class:`ComputeDtypeWarning` when a 16-bit request left more than half
        the FLOPs in float32 (the :class:`Audit`'s ``warning`` holds the message either way).

    Returns:
      An :class:`Audit` (``.text()``: a table of the sites, FLOPs by dtype, the warning).
    """
    requested = None if policy is None else np.dtype(get_policy(policy).compute_dtype).name
    inter = intercept(fn, _Products(), numbering="primitive", params=params)
    pairs = inter.promotions(*args, **kwargs)
    sites = [s for s in inter.sites(*args, **kwargs) if s.primitive in _Products.primitives]
    rows = tuple(
        AuditSite(
            s.name,
            s.param,
            s.in_dtypes,
            s.out_dtype,
            s.compute_dtype,
            s.flops * _runs(s),
            s.where,
        )
        for s in sites
    )
    flops = flops_by_dtype(sites)
    first, promotion, cause = pairs[0] if pairs else (None, None, "")
    message = ""
    total = sum(flops.values())
    if requested is not None and np.dtype(requested).itemsize <= 2 and total and first:
        wide = sum(f for d, f in flops.items() if np.dtype(d).itemsize >= 4) / total
        if wide > THRESHOLD:
            at = f" at {first.where}" if first.where else ""
            why = f"the first promotion: {promotion.describe()}" if promotion else cause
            message = (
                f"the policy asks for {requested}, but {100 * wide:.0f}% of the matmul and "
                f"convolution FLOPs multiply in {first.compute_dtype}; the first is "
                f"{first.name} ({first.param or 'two activations'}){at}; {why}"
            )
            if warn:
                warnings.warn(message, ComputeDtypeWarning, stacklevel=2)
    name = first.name if first else ""
    return Audit(requested, rows, flops, promotion, cause, name, message)
