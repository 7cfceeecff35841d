"""The quantization options, defined once, and their eager validation into one static spec.

:class:`QuantOptions` lists and documents the keywords :func:`~precisionlab.quant.quantize`
and :func:`~precisionlab.quant.fake_quant` share; :func:`resolve` checks and normalises them
into a hashable :class:`QuantSpec` (a jit static argument), and :func:`prepare` adds the
checks that need the input array and the PRNG key. Shared with the survey and the benchmarks.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, TypedDict, TypeVar, Unpack

import jax
import jax.numpy as jnp

from precisionlab.bits import parse_rounding
from precisionlab.formats import FloatFormat, Format, IntFormat, get_format
from precisionlab.quant._mx import MX_FORMATS, SCALE_RULES, MXFormat, get_mx_format
from precisionlab.quant._qarray import SCALE_FORMATS

__all__ = ["SCALE_METHODS", "SCHEMES", "QuantOptions", "QuantSpec", "given", "prepare", "resolve"]

#: Quantization schemes: a symmetric range, or an integer zero point from min/max.
SCHEMES = ("symmetric", "asymmetric")
#: How the scale is chosen (``auto``: ``none`` for floats of 16 bits or more, else ``amax``).
SCALE_METHODS = ("auto", "amax", "percentile:<p>", "mse", "none")
#: Clipping ratios the "mse" scale search tries: 1.0 down to 0.01, geometrically spaced
#: (heavy-tailed tensors at 4 bits want clip values far below amax).
MSE_GRID = 64
MSE_MIN_RATIO = 0.01
_FLOAT_INPUTS = (jnp.float32, jnp.float16, jnp.bfloat16, jnp.float64)
# Blocks pad their axis to whole blocks; a block far longer than its axis (block_size 100000
# on a width-1 axis) would allocate block_size times the input. Refused past this bound.
MAX_PADDED_ELEMENTS = 2**26


class QuantOptions(TypedDict, total=False):
    """The options of :func:`~precisionlab.quant.quantize` and
    :func:`~precisionlab.quant.fake_quant`, given as keywords; each may be left out.

    Attributes:
      axis: per-channel: one scale per index along ``axis``. With ``block_size``: the axis
        the blocks run along (default: the last).
      block_size: blocks of this many consecutive elements share a scale (a ragged last
        block is allowed). MX formats always use 32.
      scheme: ``"symmetric"`` (zero point 0; default for signed ints and floats; signed ints
        use [-(2**(b-1)-1), 2**(b-1)-1] unless ``full_range``) or ``"asymmetric"`` (integer
        zero point from min/max; default for unsigned ints).
      scale: ``"amax"``, ``"percentile:<p>"`` (clip at the p-th percentile of |x|), ``"mse"``
        (least squared error over 64 clipping ratios 1.0..0.01), ``"none"`` (scale 1: a plain
        cast), or None: amax, except none for float formats of 16 bits or more.
      scale_format: ``"float32"`` (default), ``"float16"``/``"bfloat16"`` (rounded up),
        ``"pow2"`` (float32 powers of two) or ``"e8m0"`` (uint8 E8M0 codes; MX always).
      scale_rule: for power-of-two scales, one of :data:`~precisionlab.quant.SCALE_RULES`:
        ``"floor"`` (OCP MX rule; the default for MX formats), ``"ceil"`` (torchao CEIL),
        ``"rceil"`` (TE / cuBLAS: ``2**ceil(log2(amax / max))``, never saturates; the default
        otherwise) or ``"even"`` (torchao EVEN).
      rounding: a mode of :data:`precisionlab.bits.ROUNDING_MODES` (default
        ``"nearest_even"``); ``"stochastic"`` needs a PRNG ``key``.
      full_range: symmetric signed ints may also use code -2**(b-1) (default False).
    """

    axis: int | None
    block_size: int | None
    scheme: str | None
    scale: str | None
    scale_format: str | None
    scale_rule: str | None
    rounding: str
    full_range: bool


#: The names :class:`QuantOptions` takes, in its order.
OPTION_NAMES: tuple[str, ...] = tuple(QuantOptions.__annotations__)


def check_option_names(options: dict[str, Any]) -> None:
    """``TypeError`` naming an unknown option and the allowed ones (as Python does for an
    unexpected keyword)."""
    unknown = [name for name in options if name not in OPTION_NAMES]
    if unknown:
        raise TypeError(
            f"unknown quantization option {unknown[0]!r}; allowed: key, {', '.join(OPTION_NAMES)}"
        )


_T = TypeVar("_T")


def given(value: _T | None, missing: str) -> _T:
    """``value``, which the rest of a spec implies is set; ``ValueError(missing)`` where None."""
    if value is None:
        raise ValueError(missing)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """Everything static about one quantization (hashable: a jit static argument)."""

    fmt: Format  # element format
    mx: MXFormat | None
    ndim: int
    granularity: str  # "tensor" | "channel" | "block"
    axis: int | None  # normalized to 0..ndim-1
    block_size: int | None
    scheme: str
    scale: str  # "amax" | "percentile" | "mse" | "none"
    percentile: float | None
    scale_format: str
    scale_rule: str | None
    rounding: str
    full_range: bool

    @property
    def pow2(self) -> bool:
        return self.scale_format in ("pow2", "e8m0")

    @property
    def is_int(self) -> bool:
        return isinstance(self.fmt, IntFormat)

    @property
    def frac_bits(self) -> int:
        return self.mx.frac_bits if self.mx is not None else 0

    @property
    def qmax(self) -> float:
        """Largest element magnitude in element units (integer units for ints)."""
        return float(self.fmt.max)

    @property
    def qmin(self) -> float:
        """Smallest element: -qmax for narrow-range symmetric ints, the format's min else."""
        if self.is_int and self.scheme == "symmetric" and not self.full_range:
            return -float(self.fmt.max)
        return float(self.fmt.min) if self.is_int else -float(self.fmt.max)

    @property
    def clip_target(self) -> float:
        """The magnitude the clip value maps to: qmax (ints), max (floats), and for MX the
        element max after the fixed-point shift (127/64 for MXINT8)."""
        if self.mx is not None:
            return self.mx.elem_max
        return self.qmax

    @property
    def emax_target(self) -> int:
        """Exponent of ``clip_target`` (the spec's emax_elem) for the "floor" rule."""
        if self.mx is not None:
            return self.mx.emax_elem
        if isinstance(self.fmt, FloatFormat):
            return self.fmt.emax
        return math.floor(math.log2(self.clip_target))

    @property
    def group_axis(self) -> int:
        """The axis of channel and block granularity (``axis``, normalized)."""
        return given(self.axis, f"{self.granularity} granularity has no axis")

    @property
    def block(self) -> int:
        """The elements per block of block granularity (``block_size``)."""
        return given(self.block_size, f"{self.granularity} granularity has no block size")

    @property
    def pow2_rule(self) -> str:
        """The rule of power-of-two scales (``scale_rule``; see :data:`SCALE_RULES`)."""
        return given(
            self.scale_rule, f"scale_format {self.scale_format!r} has no power-of-two rule"
        )

    @property
    def clip_percentile(self) -> float:
        """The percentile of ``scale="percentile:<p>"``."""
        return given(self.percentile, f"scale {self.scale!r} has no percentile")

    @property
    def scale_method(self) -> str:
        return f"percentile:{self.percentile:g}" if self.scale == "percentile" else self.scale

    @property
    def format_obj(self) -> Format | MXFormat:
        return self.mx if self.mx is not None else self.fmt


def parse_format(fmt: Any) -> tuple[Format, MXFormat | None]:
    mx = get_mx_format(fmt)
    if mx is not None:
        return mx.element, mx
    try:
        return get_format(fmt), None
    except ValueError as err:
        raise ValueError(f"{err}; or an MX format: {', '.join(MX_FORMATS)}") from None


def parse_scale(scale: str | None, fmt: Format) -> tuple[str, float | None]:
    if scale is None or scale == "auto":
        wide_float = isinstance(fmt, FloatFormat) and fmt.bits >= 16
        return ("none" if wide_float else "amax"), None
    if not isinstance(scale, str):
        raise TypeError(f"scale must be a string, one of {SCALE_METHODS}, got {scale!r}")
    key = scale.strip().lower()
    if key in ("amax", "mse", "none"):
        return key, None
    if key.startswith("percentile:"):
        try:
            p = float(key.split(":", 1)[1])
        except ValueError:
            p = math.nan
        if not 0 < p <= 100:
            raise ValueError(f"scale {scale!r}: the percentile must be a number in (0, 100]")
        return "percentile", p
    raise ValueError(f"unknown scale {scale!r}; allowed: {', '.join(SCALE_METHODS)}")


def resolve(ndim: int, fmt: Any, **options: Unpack[QuantOptions]) -> QuantSpec:
    """Validate and normalise the options of quantize/fake_quant for an input of ``ndim``
    axes; ``ValueError``/``TypeError`` name what is wrong and what is allowed."""
    check_option_names(dict(options))
    axis = options.get("axis")
    block_size = options.get("block_size")
    scheme = options.get("scheme")
    scale = options.get("scale")
    scale_format = options.get("scale_format")
    scale_rule = options.get("scale_rule")
    full_range = options.get("full_range", False)
    elem, mx = parse_format(fmt)
    rounding = parse_rounding(options.get("rounding", "nearest_even")).value
    if axis is not None:
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"axis must be an int or None, got {axis!r}")
        if not -ndim <= axis < ndim:
            raise ValueError(f"axis {axis} is out of range for an input with {ndim} axes")
        axis %= ndim
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")

    if mx is not None:
        if block_size not in (None, mx.block_size):
            raise ValueError(
                f"{mx.name} has blocks of {mx.block_size} (OCP MX v1.0), "
                f"got block_size={block_size}"
            )
        if scheme not in (None, "symmetric"):
            raise ValueError(f"{mx.name} is symmetric; got scheme={scheme!r}")
        if scale not in (None, "amax", "auto"):
            raise ValueError(
                f"{mx.name} derives its scale from the block amax; got scale={scale!r}"
            )
        if scale_format not in (None, "e8m0"):
            raise ValueError(f"{mx.name} stores E8M0 scales; got scale_format={scale_format!r}")
        if ndim < 1:
            raise ValueError(f"{mx.name} needs an input with at least one axis")
        if full_range and not isinstance(elem, IntFormat):
            raise ValueError(
                f"full_range applies to MXINT8 and signed integer formats, not {mx.name}"
            )
        scale_rule = "floor" if scale_rule is None else scale_rule
        if scale_rule not in SCALE_RULES:
            raise ValueError(
                f"unknown scale_rule {scale_rule!r}; allowed: {', '.join(SCALE_RULES)}"
            )
        return QuantSpec(
            fmt=elem, mx=mx, ndim=ndim, granularity="block",
            axis=ndim - 1 if axis is None else axis, block_size=mx.block_size,
            scheme="symmetric", scale="amax", percentile=None, scale_format="e8m0",
            scale_rule=scale_rule, rounding=rounding, full_range=bool(full_range),
        )  # fmt: skip

    if block_size is not None:
        if ndim < 1:
            raise ValueError("block granularity needs an input with at least one axis")
        granularity, axis = "block", ndim - 1 if axis is None else axis
    elif axis is not None:
        granularity = "channel"
    else:
        granularity = "tensor"

    is_int = isinstance(elem, IntFormat)
    if scheme is None:
        scheme = "asymmetric" if is_int and not elem.signed else "symmetric"
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(SCHEMES)}")
    if scheme == "asymmetric" and not is_int:
        raise ValueError(f"scheme='asymmetric' needs an integer format, not {elem.name}")
    if scheme == "symmetric" and is_int and not elem.signed:
        raise ValueError(f"{elem.name} is unsigned: use scheme='asymmetric'")
    if full_range and not (is_int and scheme == "symmetric"):
        raise ValueError("full_range applies to symmetric signed integer formats only")

    method, p = parse_scale(scale, elem)
    if method == "none" and scheme == "asymmetric":
        raise ValueError("scale='none' cannot define a zero point: use amax, mse or percentile")
    scale_format = "float32" if scale_format is None else scale_format
    if scale_format not in SCALE_FORMATS:
        raise ValueError(
            f"unknown scale_format {scale_format!r}; allowed: {', '.join(SCALE_FORMATS)}"
        )
    if scale_format in ("pow2", "e8m0"):
        scale_rule = "rceil" if scale_rule is None else scale_rule
        if scale_rule not in SCALE_RULES:
            raise ValueError(
                f"unknown scale_rule {scale_rule!r}; allowed: {', '.join(SCALE_RULES)}"
            )
    elif scale_rule is not None:
        raise ValueError(
            f"scale_rule={scale_rule!r} applies to power-of-two scales "
            "(scale_format='pow2' or 'e8m0') and MX formats only"
        )
    return QuantSpec(
        fmt=elem, mx=None, ndim=ndim, granularity=granularity, axis=axis,
        block_size=block_size, scheme=scheme, scale=method, percentile=p,
        scale_format=scale_format, scale_rule=scale_rule, rounding=rounding,
        full_range=bool(full_range),
    )  # fmt: skip


def check_input(x: Any) -> jax.Array:
    """``x`` as a float array to quantize: ``TypeError`` for other dtypes, ``ValueError``
    when empty."""
    x = jnp.asarray(x)
    if x.dtype not in [jnp.dtype(d) for d in _FLOAT_INPUTS]:
        raise TypeError(
            f"quantization takes float32, float16, bfloat16 or float64 arrays, got {x.dtype}"
        )
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    return x


def prepare(x: jax.Array, fmt: Any, key: jax.Array | None, options: QuantOptions) -> QuantSpec:
    """:func:`resolve` for the checked input ``x``, then the checks that need ``x`` and the
    PRNG ``key``: a key exactly for stochastic rounding, and block padding within bounds."""
    spec = resolve(x.ndim, fmt, **options)
    _check_key(spec, key)
    _check_padding(tuple(x.shape), spec)
    return spec


def _check_padding(shape: tuple[int, ...], spec: QuantSpec) -> None:
    if spec.granularity != "block":
        return
    assert spec.axis is not None and spec.block_size is not None
    n = shape[spec.axis]
    size = math.prod(shape)
    padded = size // n * (-(-n // spec.block_size) * spec.block_size)
    if padded > 2 * size and padded > MAX_PADDED_ELEMENTS:
        raise ValueError(
            f"block_size {spec.block_size} along axis {spec.axis} (length {n}) pads the input "
            f"from {size:,} to {padded:,} elements (limit 2^26 when padding more than doubles "
            f"it); use a block_size of at most {n}"
        )


def _check_key(spec: QuantSpec, key: jax.Array | None) -> None:
    if spec.rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(0)")
    if spec.rounding != "stochastic" and key is not None:
        raise ValueError(f"key is only used by rounding='stochastic', not {spec.rounding!r}")
