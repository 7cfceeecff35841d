"""Error metrics of a rounded or quantized tensor against its original.

:func:`error_report` measures ``x_hat`` against ``x`` with jittable reductions and returns an
:class:`ErrorReport` pytree; ``.to_dict()`` gives plain floats for JSON, ``str()`` a table.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab.formats import FloatFormat, Format, IntFormat, get_format
from precisionlab.quant import _pow2 as pow2
from precisionlab.quant._mx import get_mx_format

__all__ = ["METRICS", "ErrorReport", "error_report", "format_table"]

#: Field name -> (column header, short description).
METRICS: dict[str, tuple[str, str]] = {
    "max_abs_error": ("max|err|", "largest |x_hat - x|"),
    "mean_abs_error": ("mean|err|", "mean |x_hat - x|"),
    "rmse": ("rmse", "root mean squared error"),
    "mean_rel_error": ("mean rel", "mean |x_hat - x| / |x| over x != 0"),
    "max_rel_error": ("max rel", "largest |x_hat - x| / |x| over x != 0"),
    "sqnr_db": ("SQNR dB", "10 log10(sum x^2 / sum err^2)"),
    "bias": ("bias", "mean signed error x_hat - x"),
    "mean_ulp_error": ("mean ulp", "mean error in units in the last place of fmt"),
    "max_ulp_error": ("max ulp", "largest error in units in the last place of fmt"),
    "frac_overflow": ("overflow", "fraction of finite x that became inf or NaN"),
    "frac_saturated": ("saturated", "fraction clipped to the format's range, not rounded"),
    "frac_underflow": ("underflow", "fraction with x != 0 and x_hat == 0"),
    "frac_subnormal": ("subnormal", "fraction of x_hat in fmt's subnormal range"),
}


@partial(
    jax.tree_util.register_dataclass,
    data_fields=[*METRICS, "n_nonfinite"],
    meta_fields=["n", "fmt"],
)
@dataclasses.dataclass(frozen=True, kw_only=True)
class ErrorReport:
    """Scalar float32 error statistics (jax arrays) of one ``x_hat`` against ``x``.

    Error statistics cover the elements where both ``x`` and ``x_hat`` are finite; the
    ``frac_*`` fields count the others, and ``n_nonfinite`` counts the elements of ``x`` that
    are inf or NaN. With no element finite in both, every error statistic is NaN (never a
    perfect SQNR of inf). ULP statistics, saturation and subnormal fractions need ``fmt`` and
    are NaN without it. ``n`` is the element count, ``fmt`` its name.
    """

    max_abs_error: jax.Array
    mean_abs_error: jax.Array
    rmse: jax.Array
    mean_rel_error: jax.Array
    max_rel_error: jax.Array
    sqnr_db: jax.Array
    bias: jax.Array
    mean_ulp_error: jax.Array
    max_ulp_error: jax.Array
    frac_overflow: jax.Array
    frac_saturated: jax.Array
    frac_underflow: jax.Array
    frac_subnormal: jax.Array
    n_nonfinite: jax.Array
    n: int
    fmt: str | None

    def to_dict(self) -> dict:
        """Plain Python floats (NaN/inf kept as floats) plus ``n`` and ``fmt``."""
        out: dict = {"n": self.n, "fmt": self.fmt}
        out.update({name: float(getattr(self, name)) for name in METRICS})
        out["n_nonfinite"] = int(self.n_nonfinite)
        return out

    def __str__(self) -> str:
        d = self.to_dict()
        rows = [(METRICS[k][0], _fmt_value(d[k]), METRICS[k][1]) for k in METRICS]
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        bad = f", {d['n_nonfinite']} non-finite" if d["n_nonfinite"] else ""
        head = f"error report ({self.n} elements{bad}" + (f", fmt {self.fmt})" if self.fmt else ")")
        return "\n".join([head] + [f"  {a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows])


def _fmt_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, int):
        return str(v)
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}"
    return f"{v:.3e}"


def format_table(rows: list[dict], columns: list[str], *, headers: dict | None = None) -> str:
    """A plain-text table: one line per row dict, the given columns (metric fields get
    their short header)."""
    headers = headers or {}
    names = [headers.get(c, METRICS[c][0] if c in METRICS else c) for c in columns]
    cells = [[_fmt_value(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(names)]

    def line(items: list[str]) -> str:
        first = f"{items[0]:<{widths[0]}}"
        rest = [f"{v:>{w}}" for v, w in zip(items[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(names), sep] + [line(r) for r in cells])


def _ulp(v: jax.Array, fmt: Format) -> jax.Array:
    """float32 spacing of ``fmt`` at |v| (clamped to its normal exponent range)."""
    if isinstance(fmt, IntFormat):
        return jnp.ones_like(v)
    e = jnp.clip(pow2.floor_log2(v), fmt.emin, fmt.emax)
    return pow2.pow2(e - fmt.mantissa_bits)


@partial(jax.jit, static_argnames=("fmt",))
def _report(
    x: jax.Array, x_hat: jax.Array, scale: jax.Array | None, fmt: Format | None
) -> dict[str, jax.Array]:
    f32 = jnp.float32
    x = x.astype(f32)
    x_hat = x_hat.astype(f32)
    finite_x = jnp.isfinite(x)
    both = finite_x & jnp.isfinite(x_hat)
    any_both = jnp.any(both)  # no finite pair: every error statistic is NaN, not 0 or inf
    n_both = jnp.maximum(jnp.sum(both), 1).astype(f32)
    # Zero tests on the bit patterns: XLA on CPU flushes float32 subnormals in comparisons.
    nonzero_x = _nonzero(x)
    zero_hat = ~_nonzero(x_hat)
    # Rescale both by 2**-k (exactly, on the bit patterns) so that the largest |x| is ~1:
    # squares and differences then stay in float32's normal range for huge tensors and for
    # subnormal ones. Relative statistics need no scaling back; absolute ones are scaled back.
    k = jnp.max(jnp.where(both & nonzero_x, pow2.floor_log2(x), jnp.int32(-(2**30))))
    k = jnp.where(k < -(2**29), 0, k).astype(jnp.int32)
    xs, x_hats = pow2.ldexp(x, -k), pow2.ldexp(x_hat, -k)
    err_s = jnp.where(both, x_hats - xs, 0.0)
    aerr_s = jnp.abs(err_s)
    aerr = pow2.ldexp(aerr_s, k)  # absolute errors at the input's scale, exactly
    x0 = jnp.where(both, xs, 0.0)
    nz = both & nonzero_x & (jnp.abs(xs) > 0)  # elements > 2**-126 of the largest
    rel = jnp.where(nz, aerr_s / jnp.where(nz, jnp.abs(xs), 1.0), 0.0)
    n_nz = jnp.sum(nz).astype(f32)
    sig = jnp.sum(jnp.square(x0))
    noise = jnp.sum(jnp.square(err_s))
    sqnr = jnp.where(noise > 0, 10.0 * jnp.log10(sig / jnp.where(noise > 0, noise, 1.0)), jnp.inf)
    n = f32(x.size)
    nan = jnp.float32(jnp.nan)
    if fmt is None:
        mean_ulp = max_ulp = frac_sat = frac_sub = nan
    else:
        s = jnp.ones_like(x) if scale is None else jnp.broadcast_to(scale, x.shape).astype(f32)
        ulp_x = _ulp(x / s, fmt) * s
        ulps = jnp.where(both, aerr / ulp_x, 0.0)
        mean_ulp = jnp.sum(ulps) / n_both
        max_ulp = jnp.max(ulps)
        # Clipped, not rounded: more than a step away, or landed on the largest magnitude
        # more than half a step away (as the OCP MX floor rule does to a block's top values).
        at_max = jnp.abs(x_hat) >= jnp.float32(fmt.max) * s
        sat = (
            both
            & (jnp.abs(x) > jnp.abs(x_hat))
            & ((aerr > ulp_x) | (at_max & (aerr > 0.5 * ulp_x)))
        )
        frac_sat = jnp.sum(sat) / n
        if isinstance(fmt, FloatFormat) and fmt.subnormals:
            tiny = jnp.float32(fmt.smallest_normal) * s
            frac_sub = jnp.sum((x_hat != 0) & (jnp.abs(x_hat) < tiny)) / n
        else:
            frac_sub = jnp.float32(0.0)

    def stat(v: jax.Array) -> jax.Array:
        return jnp.where(any_both, v, nan)

    return dict(
        max_abs_error=stat(pow2.ldexp(jnp.max(aerr_s), k)),
        mean_abs_error=stat(pow2.ldexp(jnp.sum(aerr_s) / n_both, k)),
        rmse=stat(pow2.ldexp(jnp.sqrt(noise / n_both), k)),
        mean_rel_error=jnp.where(n_nz > 0, jnp.sum(rel) / jnp.maximum(n_nz, 1.0), nan),
        max_rel_error=jnp.where(n_nz > 0, jnp.max(rel), nan),
        sqnr_db=stat(sqnr),
        bias=stat(pow2.ldexp(jnp.sum(err_s) / n_both, k)),
        mean_ulp_error=stat(mean_ulp),
        max_ulp_error=stat(max_ulp),
        frac_overflow=jnp.sum(finite_x & ~jnp.isfinite(x_hat)) / n,
        frac_saturated=frac_sat,
        frac_underflow=jnp.sum(nonzero_x & zero_hat) / n,
        frac_subnormal=frac_sub,
        n_nonfinite=jnp.sum(~finite_x).astype(jnp.int32),
    )


def _nonzero(a: jax.Array) -> jax.Array:
    """``a != 0`` for float32 ``a``, read off the bits (exact for subnormals; NaN counts)."""
    bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    return (bits & jnp.uint32(0x7FFFFFFF)) != 0


def error_report(
    x: jax.typing.ArrayLike,
    x_hat: jax.typing.ArrayLike,
    fmt: Any = None,
    *,
    scale: jax.typing.ArrayLike | None = None,
) -> ErrorReport:
    """Error statistics of ``x_hat`` (a rounded or quantized ``x``) against ``x``.

    Args:
      x, x_hat: float arrays of one shape (computed in float32).
      fmt: the format ``x_hat`` was stored in (name or format; for a quantized tensor the
        element format), for ULP errors, saturation and subnormal fractions.
      scale: float32 array broadcastable to ``x``: the scale each element was quantized
        with, so ULPs are those of the scaled grid (``precisionlab.quant.element_scales``).

    Returns:
      An :class:`ErrorReport` (a pytree of float32 scalars; jittable when ``fmt`` is static).

    Example:
      1 + 2**-8 rounds to 1.0 in bfloat16: an error of 2**-8, half of bfloat16's step at 1.

      >>> import jax.numpy as jnp
      >>> from precisionlab import round_to_format
      >>> from precisionlab.metrics import error_report
      >>> x = jnp.array([1.0, 1.00390625, 3.0])
      >>> r = error_report(x, round_to_format(x, "bf16"), "bf16")
      >>> float(r.max_abs_error), float(r.max_ulp_error), float(r.frac_saturated)
      (0.00390625, 0.5, 0.0)
    """
    x = jnp.asarray(x)
    x_hat = jnp.asarray(x_hat)
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have one shape, got {x.shape} and {x_hat.shape}")
    for name, a in (("x", x), ("x_hat", x_hat)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{name} must be a float array, got {a.dtype}")
    if isinstance(fmt, str) and fmt.strip().lower().startswith("mx"):
        fmt = get_mx_format(fmt)
    fmt_obj = None if fmt is None else get_format(getattr(fmt, "element", fmt))
    if fmt_obj is not None and isinstance(fmt_obj, FloatFormat) and fmt_obj.bits > 32:
        fmt_obj = None
    if scale is not None:
        scale = jnp.asarray(scale, jnp.float32)
    fields = _report(x, x_hat, scale, fmt_obj)
    return ErrorReport(**fields, n=int(np.prod(x.shape)), fmt=None if fmt is None else str(fmt))
