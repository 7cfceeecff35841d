"""Number formats described by their bits.

A :class:`FloatFormat` is exponent bits, mantissa bits, bias, signedness, whether the
all-zeros exponent field holds subnormals, and how inf and NaN are encoded. Every other
property (largest finite value, smallest subnormal, epsilon, which codes are NaN, ...) is
derived from those bits, never typed in. An :class:`IntFormat` is a bit width and a sign.

Formats are frozen, hashable dataclasses, so they can be static arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import numpy as np

__all__ = [
    "ALIASES",
    "FORMATS",
    "FloatFormat",
    "Format",
    "IntFormat",
    "Specials",
    "format_names",
    "get_format",
]


class Specials(StrEnum):
    """How a float format spends codes on infinity and NaN.

    - ``ieee``: inf at the all-ones exponent with zero mantissa, NaN at the all-ones exponent
      with any other mantissa (fp32, fp16, bf16, E5M2).
    - ``fn``: finite only, no inf; NaN only where exponent and mantissa are all ones (E4M3FN).
      With no mantissa bits (E8M0) that is the all-ones exponent.
    - ``fnuz``: finite only, no inf, no negative zero; the one NaN sits at the code that would be
      negative zero (``0x80`` for 8-bit formats).
    - ``none``: every code is a finite number (FP6, FP4).
    """

    IEEE = "ieee"
    FN = "fn"
    FNUZ = "fnuz"
    NONE = "none"


def _code_dtype(bits: int) -> np.dtype:
    for width, dtype in ((8, np.uint8), (16, np.uint16), (32, np.uint32), (64, np.uint64)):
        if bits <= width:
            return np.dtype(dtype)
    raise ValueError(f"formats wider than 64 bits are not supported (got {bits} bits)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FloatFormat:
    """A binary floating-point format.

    Attributes:
      name: display name, e.g. ``"float8_e4m3fn"``.
      exponent_bits: width of the biased exponent field (>= 1).
      mantissa_bits: width of the stored fraction field (>= 0), without the implicit bit.
      bias: exponent bias; ``None`` means the IEEE default ``2**(exponent_bits - 1) - 1``.
      signed: whether there is a sign bit. Unsigned formats (E8M0) hold no negative values.
      subnormals: whether the all-zeros exponent field holds subnormals and zero. If False,
        that field holds ordinary normal numbers and the format has no zero (as E8M0).
      specials: how inf and NaN are encoded, see :class:`Specials`.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    signed: bool = True
    subnormals: bool = True
    specials: Specials = Specials.IEEE

    def __post_init__(self) -> None:
        if not isinstance(self.exponent_bits, int) or self.exponent_bits < 1:
            raise ValueError(f"exponent_bits must be an int >= 1, got {self.exponent_bits!r}")
        if not isinstance(self.mantissa_bits, int) or self.mantissa_bits < 0:
            raise ValueError(f"mantissa_bits must be an int >= 0, got {self.mantissa_bits!r}")
        if self.exponent_bits > 11 or self.mantissa_bits > 52:
            raise ValueError(
                "formats wider than float64 (exponent_bits <= 11, mantissa_bits <= 52) are not "
                f"supported, got e{self.exponent_bits}m{self.mantissa_bits}"
            )
        object.__setattr__(self, "specials", Specials(self.specials))
        if self.bias is None:
            object.__setattr__(self, "bias", 2 ** (self.exponent_bits - 1) - 1)
        if self.specials is Specials.FNUZ and not self.signed:
            raise ValueError("fnuz formats place NaN at the negative-zero code: they need a sign")
        if self.specials is Specials.IEEE and (self.exponent_bits < 2 or self.mantissa_bits < 1):
            raise ValueError(
                "IEEE-style inf/NaN need at least 2 exponent bits and 1 mantissa bit "
                f"(got e{self.exponent_bits}m{self.mantissa_bits}); use specials='fn' or 'none'"
            )
        if not self.subnormals and self.specials is Specials.FNUZ:
            raise ValueError("fnuz formats without subnormals have no zero code to reuse for NaN")
        if self.max_code_magnitude < 1:
            raise ValueError(f"format {self.name!r} has no positive finite value")
        # Values are exact Python floats (float64): the format must fit inside float64.
        if self.emax > 1023 or self.emin - (self.mantissa_bits if self.subnormals else 0) < -1074:
            raise ValueError(
                f"format {self.name!r} (bias {self.bias}) spans 2^{self.emin} .. 2^{self.emax}, "
                "beyond float64's range; choose a bias that keeps it within 2^-1074 .. 2^1023"
            )

    # --- layout -----------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total storage width in bits."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def code_dtype(self) -> np.dtype:
        """Smallest unsigned integer dtype that holds a code (uint8, uint16, uint32, uint64)."""
        return _code_dtype(self.bits)

    @property
    def sign_mask(self) -> int:
        return (1 << (self.bits - 1)) if self.signed else 0

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    @property
    def exponent_field_max(self) -> int:
        return (1 << self.exponent_bits) - 1

    @property
    def mantissa_mask(self) -> int:
        return (1 << self.mantissa_bits) - 1

    # --- exponent range ---------------------------------------------------------------
    @property
    def max_code_magnitude(self) -> int:
        """Code (without sign) of the largest finite value."""
        e_all, m_all = self.exponent_field_max, self.mantissa_mask
        if self.specials is Specials.IEEE:
            return ((e_all - 1) << self.mantissa_bits) | m_all
        if self.specials is Specials.FN:
            return (e_all << self.mantissa_bits) | (m_all - 1) if self.mantissa_bits else e_all - 1
        return (e_all << self.mantissa_bits) | m_all

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        assert self.bias is not None  # __post_init__ filled in the default
        return (self.max_code_magnitude >> self.mantissa_bits) - self.bias

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal value."""
        assert self.bias is not None  # __post_init__ filled in the default
        return (1 if self.subnormals else 0) - self.bias

    # --- derived values (exact, as Python floats) ---------------------------------------
    @property
    def max(self) -> float:
        """Largest finite value."""
        return self.value_of(self.max_code_magnitude)

    @property
    def min(self) -> float:
        """Smallest finite value: -max, or for unsigned formats 0 (or the smallest positive
        value where there is no zero, as in E8M0)."""
        if self.signed:
            return -self.max
        return 0.0 if self.has_zero else self.smallest_positive

    @property
    def smallest_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive subnormal; equals :attr:`smallest_normal` without subnormals."""
        if not self.subnormals or self.mantissa_bits == 0:
            return self.smallest_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def smallest_positive(self) -> float:
        return self.smallest_subnormal

    @property
    def eps(self) -> float:
        """Gap between 1 and the next larger value of the format: ``2**-mantissa_bits``."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def unit_roundoff(self) -> float:
        """Largest relative error of round-to-nearest over the normal range: ``eps / 2``."""
        return math.ldexp(1.0, -self.mantissa_bits - 1)

    @property
    def has_inf(self) -> bool:
        return self.specials is Specials.IEEE

    @property
    def has_nan(self) -> bool:
        return self.specials in (Specials.IEEE, Specials.FN, Specials.FNUZ)

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.subnormals and self.specials is not Specials.FNUZ

    @property
    def dynamic_range_binades(self) -> float:
        """``log2(max / smallest_positive)``: octaves spanned by the positive finite values."""
        return math.log2(self.max) - math.log2(self.smallest_positive)

    @property
    def num_nan(self) -> int:
        """Count of codes that decode to NaN (every payload counted)."""
        signs = 2 if self.signed else 1
        if self.specials is Specials.IEEE:
            return signs * self.mantissa_mask
        if self.specials is Specials.FN:
            return signs
        return 1 if self.specials is Specials.FNUZ else 0

    @property
    def num_finite(self) -> int:
        """Count of codes that decode to a finite value (both zeros counted separately)."""
        return (1 << self.bits) - self.num_nan - len(self.inf_codes)

    # --- special codes ------------------------------------------------------------------
    @property
    def nan_codes(self) -> tuple[int, ...]:
        """Every code that decodes to NaN, ascending. Enumerated for formats up to 16 bits;
        for wider ones only the canonical quiet NaN codes (both signs) are listed."""
        if not self.has_nan:
            return ()
        if self.specials is Specials.FNUZ:
            return (self.sign_mask,)
        top = self.exponent_field_max << self.mantissa_bits
        if self.specials is Specials.FN:
            mags = [top | self.mantissa_mask]
        elif self.bits <= 16:
            mags = [top | m for m in range(1, self.mantissa_mask + 1)]
        else:
            mags = [top | (1 << (self.mantissa_bits - 1))]
        signs = (0, self.sign_mask) if self.signed else (0,)
        return tuple(sorted(s | m for s in signs for m in mags))

    @property
    def inf_codes(self) -> tuple[int, ...]:
        """Codes of +inf and -inf (empty when the format has no inf)."""
        if not self.has_inf:
            return ()
        top = self.exponent_field_max << self.mantissa_bits
        return (top, self.sign_mask | top) if self.signed else (top,)

    @property
    def zero_codes(self) -> tuple[int, ...]:
        if not self.has_zero:
            return ()
        return (0, self.sign_mask) if self.has_negative_zero else (0,)

    # --- scalar reference ----------------------------------------------------------------
    def value_of(self, code: int) -> float:
        """Exact value of one code, from plain Python integers (the scalar reference decoder).

        Returns a Python float (float64), which holds every value of every supported format
        exactly; NaN and +-inf where the format says so.
        """
        code = int(code)
        if not 0 <= code < (1 << self.bits):
            raise ValueError(f"code {code:#x} does not fit in {self.bits}-bit format {self.name}")
        negative = bool(code & self.sign_mask)
        mag = code & self.magnitude_mask
        exp_field, mant = mag >> self.mantissa_bits, mag & self.mantissa_mask
        if self.specials is Specials.FNUZ and negative and mag == 0:
            return math.nan
        if self.specials is Specials.FN and mag == (
            (self.exponent_field_max << self.mantissa_bits) | self.mantissa_mask
        ):
            return math.nan
        if self.specials is Specials.IEEE and exp_field == self.exponent_field_max:
            if mant:
                return math.nan
            return -math.inf if negative else math.inf
        if exp_field == 0 and self.subnormals:
            value = math.ldexp(mant, self.emin - self.mantissa_bits)
        else:
            assert self.bias is not None  # __post_init__ filled in the default
            value = math.ldexp(
                (1 << self.mantissa_bits) | mant, exp_field - self.bias - self.mantissa_bits
            )
        return -value if negative else value

    def finite_values(self) -> Iterator[tuple[int, float]]:
        """Yield ``(code, value)`` for every finite code in code order (formats <= 16 bits)."""
        if self.bits > 16:
            raise ValueError(f"{self.name} has {self.bits} bits: enumerating it is too large")
        for code in range(1 << self.bits):
            value = self.value_of(code)
            if math.isfinite(value):
                yield code, value

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class IntFormat:
    """A two's-complement (signed) or plain binary (unsigned) integer format."""

    name: str
    bits: int
    signed: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 32:
            raise ValueError(f"integer formats take 2 to 32 bits, got {self.bits!r}")

    @property
    def code_dtype(self) -> np.dtype:
        return _code_dtype(self.bits)

    @property
    def max(self) -> int:
        return (1 << (self.bits - 1)) - 1 if self.signed else (1 << self.bits) - 1

    @property
    def min(self) -> int:
        return -(1 << (self.bits - 1)) if self.signed else 0

    @property
    def num_finite(self) -> int:
        return 1 << self.bits

    @property
    def eps(self) -> float:
        return 1.0

    def value_of(self, code: int) -> int:
        """Integer held by one code (two's complement for signed formats)."""
        code = int(code)
        if not 0 <= code < (1 << self.bits):
            raise ValueError(f"code {code:#x} does not fit in {self.bits}-bit format {self.name}")
        if self.signed and code >> (self.bits - 1):
            return code - (1 << self.bits)
        return code

    def code_of(self, value: int) -> int:
        """Two's-complement code of an in-range integer."""
        if not self.min <= value <= self.max:
            raise ValueError(f"{value} is outside {self.name}'s range [{self.min}, {self.max}]")
        return value & ((1 << self.bits) - 1)

    def __str__(self) -> str:
        return self.name


#: Any format: a :class:`FloatFormat` or an :class:`IntFormat`.
Format = FloatFormat | IntFormat


def _f(name: str, e: int, m: int, **kw: Any) -> FloatFormat:
    return FloatFormat(name=name, exponent_bits=e, mantissa_bits=m, **kw)


FN, FNUZ, NONE = Specials.FN, Specials.FNUZ, Specials.NONE

#: The built-in formats, by their canonical (ml_dtypes / numpy) names.
FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        _f("float64", 11, 52),
        _f("float32", 8, 23),
        _f("tf32", 8, 10),
        _f("float16", 5, 10),
        _f("bfloat16", 8, 7),
        _f("float8_e4m3fn", 4, 3, specials=FN),
        _f("float8_e5m2", 5, 2),
        _f("float8_e4m3fnuz", 4, 3, bias=8, specials=FNUZ),
        _f("float8_e5m2fnuz", 5, 2, bias=16, specials=FNUZ),
        _f("float8_e4m3b11fnuz", 4, 3, bias=11, specials=FNUZ),
        _f("float8_e3m4", 3, 4),
        _f("float8_e4m3", 4, 3),
        _f("float8_e8m0fnu", 8, 0, signed=False, subnormals=False, specials=FN),
        _f("float6_e2m3fn", 2, 3, specials=NONE),
        _f("float6_e3m2fn", 3, 2, specials=NONE),
        _f("float4_e2m1fn", 2, 1, specials=NONE),
        IntFormat(name="int8", bits=8),
        IntFormat(name="uint8", bits=8, signed=False),
        IntFormat(name="int4", bits=4),
        IntFormat(name="uint4", bits=4, signed=False),
        IntFormat(name="int2", bits=2),
    )
}

#: Short names users type, mapped to canonical names.
ALIASES: dict[str, str] = {
    "fp64": "float64",
    "f64": "float64",
    "double": "float64",
    "fp32": "float32",
    "f32": "float32",
    "single": "float32",
    "full": "float32",
    "float": "float32",
    "e8m10": "tf32",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "e5m10": "float16",
    "bf16": "bfloat16",
    "e8m7": "bfloat16",
    "e4m3": "float8_e4m3fn",
    "e4m3fn": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e4m3fn": "float8_e4m3fn",
    "f8e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "fp8_e5m2": "float8_e5m2",
    "f8e5m2": "float8_e5m2",
    "e4m3fnuz": "float8_e4m3fnuz",
    "fp8_e4m3fnuz": "float8_e4m3fnuz",
    "e5m2fnuz": "float8_e5m2fnuz",
    "fp8_e5m2fnuz": "float8_e5m2fnuz",
    "e4m3b11fnuz": "float8_e4m3b11fnuz",
    "e3m4": "float8_e3m4",
    "fp8_e3m4": "float8_e3m4",
    "e8m0": "float8_e8m0fnu",
    "e8m0fnu": "float8_e8m0fnu",
    "fp8_e8m0": "float8_e8m0fnu",
    "e2m3": "float6_e2m3fn",
    "fp6_e2m3": "float6_e2m3fn",
    "e3m2": "float6_e3m2fn",
    "fp6_e3m2": "float6_e3m2fn",
    "fp4": "float4_e2m1fn",
    "e2m1": "float4_e2m1fn",
    "fp4_e2m1": "float4_e2m1fn",
    "i8": "int8",
    "u8": "uint8",
    "i4": "int4",
    "u4": "uint4",
    "i2": "int2",
}

#: Family names that are more than one format (the OCP MX spec's FP8 and FP6 each have two
#: element encodings): refused, naming the formats the user can write instead.
_FAMILIES: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8_e4m3", "fp8_e5m2"),
    "float8": ("fp8_e4m3", "fp8_e5m2"),
    "fp6": ("fp6_e2m3", "fp6_e3m2"),
    "float6": ("fp6_e2m3", "fp6_e3m2"),
}

_CUSTOM = re.compile(r"^e(\d+)m(\d+)(?:b(-?\d+))?(ieee|fn|fnuz|fnu|none)?$")

#: ml_dtypes names whose ``fn`` ("finite": no inf, and here no NaN either) is not the spec
#: grammar's ``fn`` (NaN at the all-ones code): refused as ambiguous, with what to write instead.
_AMBIGUOUS: dict[str, str] = {
    "e2m3fn": "float6_e2m3fn",
    "e3m2fn": "float6_e3m2fn",
    "e2m1fn": "float4_e2m1fn",
}

#: Suffix of a custom spec -> (specials, signed, subnormals). No suffix means ``ieee``.
_SUFFIXES: dict[str | None, tuple[Specials, bool, bool]] = {
    None: (Specials.IEEE, True, True),
    "ieee": (Specials.IEEE, True, True),
    "fn": (Specials.FN, True, True),
    "fnuz": (Specials.FNUZ, True, True),
    "fnu": (Specials.FN, False, False),
    "none": (Specials.NONE, True, True),
}


def format_names() -> list[str]:
    """Canonical names of the built-in formats, in catalog order."""
    return list(FORMATS)


def get_format(name: str | Format) -> Format:
    """Look up a format by canonical name, alias, or a custom ``eXmY[bB][SUFFIX]`` spec.

    A spec names a custom float format: ``e3m2b5ieee`` is 3 exponent bits, 2 mantissa bits,
    bias 5, IEEE-style inf/NaN. SUFFIX is one of ``ieee`` (the default), ``fn``, ``fnuz``,
    ``fnu`` (unsigned, no subnormals) or ``none`` (see :class:`Specials`); the bias defaults to
    the IEEE one, 2^(e-1) - 1. A spec that is also an alias of a built-in format (``e4m3``,
    ``e5m2fnuz``) names the built-in. Names that could mean two things are refused: a spec whose
    name without ``bB`` is a built-in with other conventions (``e4m3b7``: ``e4m3`` is
    float8_e4m3fn, which has no inf; write ``e4m3b7ieee`` or ``e4m3b7fn``), and ml_dtypes'
    ``e3m2fn``, ``e2m3fn``, ``e2m1fn`` (there ``fn`` means no NaN at all; write
    ``float6_e3m2fn`` or ``e3m2``).
    Format objects pass through unchanged.

    Raises:
      TypeError: if ``name`` is neither a string nor a format.
      ValueError: if the name is unknown or ambiguous (the message says what is allowed).

    Example:
      >>> from precisionlab import get_format
      >>> fmt = get_format("e4m3")
      >>> fmt.name, fmt.max, fmt.smallest_normal, fmt.smallest_subnormal
      ('float8_e4m3fn', 448.0, 0.015625, 0.001953125)
      >>> get_format("e3m2b5ieee").max  # exponent field 6 (7 is inf/NaN): 1.75 x 2**(6 - 5)
      3.5
    """
    if isinstance(name, FloatFormat | IntFormat):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a format is a name or a FloatFormat/IntFormat, got {type(name).__name__}")
    key = name.strip().lower()
    if key in _AMBIGUOUS:
        raise ValueError(
            f"format name {name!r} is ambiguous: ml_dtypes' {_AMBIGUOUS[key]} has no inf and no "
            f"NaN, while a spec's 'fn' suffix keeps NaN codes; write {_AMBIGUOUS[key]} "
            f"(or {key[:-2]}) for the built-in, or {key[:-2]}b{{BIAS}}fn for NaN codes"
        )
    if key in _FAMILIES:
        options = " or ".join(f"{a} ({ALIASES[a]})" for a in _FAMILIES[key])
        raise ValueError(
            f"format name {name!r} names more than one format (the OCP MX spec's "
            f"{key.upper().replace('FLOAT', 'FP')} has two element encodings); write {options}"
        )
    key = ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    match = _CUSTOM.match(key)
    if match:
        e, m, bias, suffix = match.groups()
        specials, signed, subnormals = _SUFFIXES[suffix]
        fmt = FloatFormat(
            name=key,
            exponent_bits=int(e),
            mantissa_bits=int(m),
            bias=None if bias is None else int(bias),
            signed=signed,
            subnormals=subnormals,
            specials=specials,
        )
        _check_unambiguous(fmt, f"e{e}m{m}{suffix or ''}", suffix)
        return fmt

    shown = name if len(name) <= 40 else name[:37] + "..."
    known = list(FORMATS) + list(ALIASES)
    # names that start with what was typed first ("float6" -> both 6-bit formats), then
    # the closest by spelling
    close = [k for k in known if len(key) >= 3 and k.startswith(key[:40])][:3]
    close += [k for k in difflib.get_close_matches(key[:40], known, n=3) if k not in close]
    close = close[:3]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ValueError(
        f"unknown format {shown!r}; {hint}known: {', '.join(list(FORMATS)[:5])}, ... (all "
        f"{len(FORMATS)}: `precisionlab formats`), aliases such as bf16, fp16, e4m3, fp4, or a "
        "custom spec such as e3m2b5ieee"
    )


def _check_unambiguous(fmt: FloatFormat, namesake: str, suffix: str | None) -> None:
    """Refuse a custom spec whose bias-free name is a built-in with other conventions."""
    builtin = FORMATS.get(ALIASES.get(namesake, namesake))
    if not isinstance(builtin, FloatFormat):
        return
    conventions = (builtin.specials, builtin.signed, builtin.subnormals)
    if (fmt.specials, fmt.signed, fmt.subnormals) == conventions:
        return
    theirs = next(k for k, v in _SUFFIXES.items() if k is not None and v == conventions)
    base = f"e{fmt.exponent_bits}m{fmt.mantissa_bits}b{fmt.bias}"
    raise ValueError(
        f"format spec {fmt.name!r} is ambiguous: {namesake!r} names {builtin.name} "
        f"(specials {theirs}), but the spec reads as specials {suffix or 'ieee'}; "
        f"write {base}{suffix or 'ieee'} or {base}{theirs}"
    )
