"""Edge-case inputs for converting a source float type into a target format.

The set, for a target format and a source type (float64, float32, float16 or bfloat16):

- every finite value of the target (formats of 16 bits or fewer; for wider targets, every
  exponent with the smallest, second, middle and largest significands, plus random codes),
- every midpoint between neighbouring values, including the overflow threshold
  ``max + ulp(max)/2`` and half the smallest subnormal,
- the neighbours (+-1 ulp of the source type) of each of those, and values 2^-30 (relative)
  off each midpoint (float64 only: float32 rounding moves them onto the midpoint),
- +-0, +-inf, NaN of both signs, the source's smallest subnormal and largest value,
- random bit patterns of the source type,
- for targets of 8 bits or fewer, every float16 and every bfloat16 value.

Only values the source type holds exactly are kept (a float32 source cannot hold every
float64 midpoint); duplicates (by bit pattern) are dropped.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from precisionlab.conformance._exact import as_float_format, decode_codes
from precisionlab.formats import FloatFormat, Format

__all__ = [
    "KNOWN",
    "SOURCES",
    "edge_inputs",
    "extreme_inputs",
    "parse_source",
    "source_format",
]

#: Source types a conversion can start from: name -> numpy dtype.
SOURCES: dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

#: Inputs pinned in every set (where the source holds them) and shown first as examples:
#: disagreements this project found in ml_dtypes.
KNOWN = np.array(
    [
        1.7670407059322498e-32,  # float64 -> bfloat16: nearest is 0x0ab7 (via float32: 0x0ab8)
        2.0**-128,  # below E8M0's smallest value 2^-127
        1e-300,  # below float32's range: zero if rounded through float32 first
    ]
)

_UINT: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def source_format(source: str) -> FloatFormat:
    """The target-format description of a source type (to compare widths)."""
    return as_float_format(source)


def parse_source(source: str) -> str:
    key = source.strip().lower()
    if key not in SOURCES:
        raise ValueError(f"unknown source type {source!r}; allowed: {', '.join(SOURCES)}")
    return key


@functools.cache
def _target_values(fmt: FloatFormat, seed: int) -> np.ndarray:
    """Finite values of the target, sorted ascending (float64)."""
    if fmt.bits <= 16:
        codes = np.arange(1 << fmt.bits, dtype=np.int64)
    else:
        m = fmt.mantissa_bits
        exps = np.arange(fmt.exponent_field_max + 1, dtype=np.int64)
        mants = np.array([0, 1, 2, 1 << (m - 1), (1 << m) - 2, (1 << m) - 1], dtype=np.int64)
        structured = ((exps[:, None] << m) | mants[None, :]).ravel()
        rng = np.random.default_rng(seed)
        rand = rng.integers(0, fmt.magnitude_mask + 1, 1 << 14, dtype=np.int64)
        mags = np.concatenate([structured, rand]) & fmt.magnitude_mask
        codes = np.concatenate([mags, mags | fmt.sign_mask]) if fmt.signed else mags
    values = decode_codes(codes, fmt)
    values = values[np.isfinite(values)]
    return np.unique(values)


def _midpoints(fmt: FloatFormat, values: np.ndarray) -> np.ndarray:
    """Midpoints between neighbours, plus the overflow threshold on both sides and half the
    smallest value (exact in float64: a target of <= 51 mantissa bits needs one more bit)."""
    mids = (values[:-1] + values[1:]) / 2
    ulp_max = np.ldexp(1.0, fmt.emax - fmt.mantissa_bits)
    extra = [fmt.max + ulp_max / 2, fmt.smallest_positive / 2]
    if fmt.bits > 16:  # sampled values: add the exact next neighbour of each sampled value
        step = np.ldexp(1.0, np.maximum(np.frexp(np.abs(values))[1] - 1, fmt.emin))
        step = np.ldexp(step, -fmt.mantissa_bits)
        mids = np.concatenate([mids, values + step / 2, values - step / 2])
    ends = np.array(extra)
    out = np.concatenate([mids, ends, -ends])
    return out[np.isfinite(out)]


def _probes(mids: np.ndarray) -> np.ndarray:
    """Double-rounding probes: float64 values 2^-30 (relative) off each midpoint, which
    float32 rounding moves onto it (a float32 source cannot hold them; they are dropped)."""
    return np.concatenate([mids * (1 + 2.0**-30), mids * (1 - 2.0**-30)])


def _in_source(x64: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The values of ``x64`` that ``dtype`` holds exactly, converted to ``dtype``."""
    with np.errstate(over="ignore", invalid="ignore"):
        xs = x64.astype(dtype)
        back = xs.astype(np.float64)
    keep = (back == x64) | (np.isnan(x64) & np.isnan(back))
    return xs[keep]


def _neighbours(xs: np.ndarray) -> np.ndarray:
    """``xs`` and its neighbours one ulp of its own type away on both sides."""
    dtype = xs.dtype
    if dtype == np.dtype(ml_dtypes.bfloat16):  # numpy's nextafter has no bfloat16 loop
        bits = xs.view(np.uint16).astype(np.int64)
        finite = np.isfinite(xs.astype(np.float32))
        b = bits[finite]
        both = np.concatenate([b + 1, b - 1])  # one code either way (-0 - 1 is a NaN: kept)
        both = both[(both >= 0) & (both < 1 << 16)].astype(np.uint16).view(dtype)
        return np.concatenate([xs, both])
    with np.errstate(over="ignore"):
        return np.concatenate(
            [xs, np.nextafter(xs, dtype.type(np.inf)), np.nextafter(xs, dtype.type(-np.inf))]
        )


def _specials(dtype: np.dtype) -> np.ndarray:
    info = ml_dtypes.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    big = float(info.max)
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, big, -big]
    return np.array(vals, dtype=np.float64).astype(dtype)


@functools.cache
def _exhaustive_16() -> np.ndarray:
    codes = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN payloads
        f16 = codes.view(np.float16).astype(np.float64)
        bf16 = codes.view(ml_dtypes.bfloat16).astype(np.float64)
    return np.concatenate([f16, bf16])


def _dedupe(xs: np.ndarray) -> np.ndarray:
    uint = _UINT[xs.dtype.itemsize]
    bits = np.unique(xs.view(uint))
    return bits.view(xs.dtype)


def edge_inputs(fmt: Format | str, source: str, *, seed: int = 0, random: int = 4096) -> np.ndarray:
    """Edge-case inputs (an array of the source dtype, unique by bit pattern) for converting
    ``source`` values into ``fmt``; ``random`` random bit patterns of the source are added."""
    fmt = as_float_format(fmt)
    dtype = SOURCES[parse_source(source)]
    values = _target_values(fmt, seed)
    mids = _midpoints(fmt, values)
    xs = _neighbours(_in_source(np.concatenate([values, mids]), dtype))
    xs = np.concatenate([xs, _in_source(_probes(mids), dtype)])
    if fmt.bits <= 8:
        xs = np.concatenate([xs, _in_source(_exhaustive_16(), dtype)])
    with np.errstate(invalid="ignore"):
        xs = xs[~np.isnan(xs.astype(np.float64))]  # NaNs come from the specials and random bits
    rng = np.random.default_rng(seed)
    uint = _UINT[dtype.itemsize]
    rand = rng.integers(0, np.iinfo(uint).max, random, dtype=uint, endpoint=True).view(dtype)
    known = _in_source(np.concatenate([KNOWN, -KNOWN]), dtype)
    xs = np.concatenate([xs, _neighbours(_specials(dtype)), extreme_inputs(fmt, source), known])
    return _dedupe(np.concatenate([xs, rand]))


def extreme_inputs(fmt: Format | str, source: str) -> np.ndarray:
    """The inputs at the ends of the target's range (zeros, half the smallest value, the
    smallest subnormal and normal, the largest value, the overflow threshold, the specials)
    and their neighbours: what a sample of the edge set must keep."""
    fmt = as_float_format(fmt)
    dtype = SOURCES[parse_source(source)]
    ulp_max = np.ldexp(1.0, fmt.emax - fmt.mantissa_bits)
    ends = np.array(
        [
            fmt.smallest_positive / 2,
            fmt.smallest_positive,
            fmt.smallest_positive * 1.5,
            fmt.smallest_normal,
            fmt.max,
            fmt.max + ulp_max / 2,
        ]
    )
    xs = _neighbours(_in_source(np.concatenate([ends, -ends]), dtype))
    return np.concatenate([xs, _specials(dtype)])
