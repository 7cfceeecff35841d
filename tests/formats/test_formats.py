"""Formats: derived properties against ml_dtypes' finfo, the OCP spec, and enumeration."""

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest

import precisionlab as pl
from precisionlab.formats import ALIASES, FORMATS, FloatFormat, IntFormat, Specials, get_format

FLOATS = [f for f in FORMATS.values() if isinstance(f, FloatFormat)]
ML_DTYPES = {
    f.name: np.dtype(getattr(ml_dtypes, f.name, f.name)) for f in FLOATS if f.name != "tf32"
}


@pytest.mark.parametrize("name", sorted(ML_DTYPES))
def test_derived_properties_match_ml_dtypes_finfo(name):
    fmt, info = FORMATS[name], ml_dtypes.finfo(ML_DTYPES[name])
    assert fmt.bits == info.bits
    assert fmt.max == float(info.max)
    assert fmt.min == float(info.min)
    assert fmt.smallest_normal == float(info.smallest_normal)
    assert fmt.smallest_subnormal == float(info.smallest_subnormal)
    assert fmt.eps == float(info.eps)
    assert fmt.mantissa_bits == info.nmant


@pytest.mark.parametrize("fmt", [f for f in FLOATS if f.bits <= 16], ids=str)
def test_counts_and_special_codes_by_enumeration(fmt):
    values = [fmt.value_of(c) for c in range(1 << fmt.bits)]
    nan = tuple(c for c, v in enumerate(values) if math.isnan(v))
    inf = tuple(c for c, v in enumerate(values) if math.isinf(v))
    zero = tuple(c for c, v in enumerate(values) if v == 0)
    assert fmt.nan_codes == nan
    assert fmt.inf_codes == inf
    assert fmt.zero_codes == zero
    assert fmt.num_finite == sum(math.isfinite(v) for v in values)
    assert fmt.num_nan == len(nan)
    finite = [abs(v) for v in values if math.isfinite(v) and v != 0]
    assert fmt.max == max(finite)
    assert fmt.smallest_positive == min(finite)
    assert fmt.dynamic_range_binades == pytest.approx(math.log2(max(finite) / min(finite)), 1e-15)


def test_ocp_8bit_spec_facts():
    # OCP 8-bit Floating Point Specification (OFP8) rev 1.0, Table 1.
    e4m3, e5m2 = get_format("e4m3"), get_format("e5m2")
    assert e4m3.max == 448 and e5m2.max == 57344
    assert e4m3.smallest_subnormal == 2**-9 and e5m2.smallest_subnormal == 2**-16
    assert e4m3.smallest_normal == 2**-6 and e5m2.smallest_normal == 2**-14
    assert e4m3.nan_codes == (0x7F, 0xFF) and e4m3.inf_codes == ()
    assert e5m2.inf_codes == (0x7C, 0xFC)
    # OCP Microscaling spec v1.0, section 5.3: FP4 E2M1 max 6, FP6 E2M3 7.5, E3M2 28.
    assert get_format("fp4").max == 6.0
    assert get_format("e2m3").max == 7.5 and get_format("e3m2").max == 28.0
    e8m0 = get_format("e8m0")
    assert e8m0.max == 2.0**127 and e8m0.smallest_positive == 2.0**-127
    assert e8m0.nan_codes == (0xFF,) and not e8m0.has_zero


def test_textbook_properties():
    f32, f16, bf16 = get_format("fp32"), get_format("fp16"), get_format("bf16")
    assert f16.max == 65504 and f16.unit_roundoff == 2**-11
    assert bf16.eps == 2**-7 and bf16.max == float(np.finfo(np.float32).max) * (1 - 2**-8) / (
        1 - 2**-24
    )
    assert f32.unit_roundoff == 2**-24
    assert get_format("tf32").eps == 2**-10 and get_format("tf32").max == (2 - 2**-10) * 2**127


def test_custom_formats_from_bits():
    e3m2b5 = get_format("e3m2b5ieee")
    assert (e3m2b5.bias, e3m2b5.specials) == (5, Specials.IEEE)
    # Largest finite: exponent field 6 (7 is inf/NaN), mantissa 11 -> 1.75 * 2**(6-5).
    assert e3m2b5.max == 1.75 * 2
    assert e3m2b5.smallest_subnormal == 2.0 ** (1 - 5 - 2)
    e6m9 = FloatFormat(name="e6m9", exponent_bits=6, mantissa_bits=9)
    assert e6m9.bits == 16 and e6m9.bias == 31
    assert e6m9.max == (2 - 2**-9) * 2.0**31 and e6m9.eps == 2**-9
    assert hash(e6m9) == hash(FloatFormat(name="e6m9", exponent_bits=6, mantissa_bits=9))
    with pytest.raises(dataclasses.FrozenInstanceError):
        e6m9.bias = 3  # frozen


def test_int_formats():
    int4, uint4, int2 = get_format("int4"), get_format("uint4"), get_format("int2")
    assert (int4.min, int4.max, uint4.min, uint4.max, int2.min, int2.max) == (-8, 7, 0, 15, -2, 1)
    assert int4.code_of(-1) == 0xF and int4.value_of(0x8) == -8
    assert [int4.value_of(c) for c in range(16)] == list(range(8)) + list(range(-8, 0))
    assert isinstance(get_format("i8"), IntFormat)


@pytest.mark.parametrize(
    "alias, name",
    [("fp32", "float32"), ("f32", "float32"), ("fp16", "float16"), ("half", "float16"),
     ("bf16", "bfloat16"), ("e4m3", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
     ("E5M2", "float8_e5m2"), ("fp8_e5m2", "float8_e5m2"), ("fp4", "float4_e2m1fn"),
     ("e2m1", "float4_e2m1fn"), ("e8m0", "float8_e8m0fnu"), ("tf32", "tf32")],
)  # fmt: skip
def test_aliases(alias, name):
    assert get_format(alias) is FORMATS[name]
    assert pl.get_format(alias) is FORMATS[name]


def test_unknown_names_and_bad_definitions_raise_clearly():
    with pytest.raises(ValueError, match=r"unknown format 'fp7'.*float32.*bfloat16"):
        get_format("fp7")
    with pytest.raises(TypeError, match="a format is a name"):
        get_format(3.0)
    with pytest.raises(ValueError, match="exponent_bits"):
        FloatFormat(name="x", exponent_bits=0, mantissa_bits=3)
    with pytest.raises(ValueError, match="IEEE-style"):
        FloatFormat(name="x", exponent_bits=4, mantissa_bits=0)
    with pytest.raises(ValueError, match="2 to 32 bits"):
        IntFormat(name="x", bits=1)
    with pytest.raises(ValueError, match="does not fit"):
        get_format("e4m3").value_of(256)


def test_counts_of_wide_formats():
    # float32: every code but those with the all-ones exponent (2 * 2**23) is finite.
    assert get_format("float32").num_finite == 2**32 - 2 * 2**23
    assert get_format("float32").num_nan == 2 * (2**23 - 1)
    assert get_format("float64").num_finite == 2**64 - 2 * 2**52
    assert get_format("tf32").num_finite == 2**19 - 2 * 2**10


def test_unsigned_ieee_format_counts_one_inf():
    u = FloatFormat(name="u", exponent_bits=5, mantissa_bits=2, signed=False)
    values = [u.value_of(c) for c in range(1 << u.bits)]
    assert u.inf_codes == (124,) and u.num_finite == sum(math.isfinite(v) for v in values)
    assert u.min == 0.0 and get_format("e8m0").min == 2.0**-127


@pytest.mark.parametrize("spec", ["e3m2b-2000", "e11m52b1100", "e5m2b-1100"])
def test_formats_beyond_float64_are_refused(spec):
    with pytest.raises(ValueError, match="beyond float64"):
        get_format(spec)


@pytest.mark.parametrize(
    "spec, specials, fmax",
    [("e4m3b7ieee", Specials.IEEE, 240.0), ("e4m3b7fn", Specials.FN, 448.0),
     ("e3m2b3none", Specials.NONE, 28.0), ("e3m2b3fn", Specials.FN, 24.0),
     ("e5m2b15", Specials.IEEE, 57344.0), ("e6m9", Specials.IEEE, (2 - 2**-9) * 2.0**31)],
)  # fmt: skip
def test_spec_suffix_says_the_specials(spec, specials, fmax):
    fmt = get_format(spec)
    assert (fmt.specials, fmt.max) == (specials, fmax)


@pytest.mark.parametrize(
    "name, hint",
    [("e4m3b7", "e4m3b7ieee or e4m3b7fn"), ("e3m2b5", "e3m2b5ieee or e3m2b5none"),
     ("e2m1b1", "e2m1b1ieee or e2m1b1none"), ("e3m2fn", "float6_e3m2fn"),
     ("e2m3fn", "float6_e2m3fn"), ("e2m1fn", "float4_e2m1fn")],
)  # fmt: skip
def test_names_that_could_mean_two_things_are_refused(name, hint):
    # e4m3 is float8_e4m3fn (max 448), so e4m3b7 must not silently be the IEEE e4m3 (max 240);
    # ml_dtypes' e3m2fn has no NaN while a spec's fn suffix keeps NaN codes.
    with pytest.raises(ValueError, match="ambiguous") as err:
        get_format(name)
    assert hint in str(err.value)


def test_every_alias_agrees_with_the_spec_grammar_or_is_not_a_spec():
    # An alias spelled like a spec (eXmY[suffix]) names a format with the conventions the
    # grammar gives that suffix, or is a bare eXmY (whose bias-carrying forms are then refused).
    import re

    for alias, canonical in ALIASES.items():
        m = re.fullmatch(r"e(\d+)m(\d+)(b\d+)?(ieee|fn|fnuz|fnu|none)", alias)
        if m is None:
            continue
        fmt = FORMATS[canonical]
        spec = get_format(f"e{m[1]}m{m[2]}b{fmt.bias}{m[4]}")
        assert (spec.specials, spec.signed, spec.subnormals, spec.bias) == (
            fmt.specials, fmt.signed, fmt.subnormals, fmt.bias,
        ), alias  # fmt: skip
