"""`precisionlab bits`: exact rounding of decimal input, printed fields, JSON, and errors.

Oracles: ml_dtypes' value tables (every code of the format, decoded by ml_dtypes) searched by
brute force with exact Fractions for the nearest value, numpy rint + clip for integers, and
pinned values derived by hand in the comments.
"""

from __future__ import annotations

import bisect
import json
import math
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from precisionlab.cli import _bits_cmd as bits_cmd
from precisionlab.cli import main

ML = {
    "bfloat16": (ml_dtypes.bfloat16, np.uint16),
    "float16": (np.float16, np.uint16),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, np.uint8),
    "float8_e5m2": (ml_dtypes.float8_e5m2, np.uint8),
}


def _table(name: str) -> tuple[list[Fraction], list[int]]:
    """Positive finite values of a format (ascending, as Fractions) and their codes, decoded
    by ml_dtypes from every code."""
    dtype, udt = ML[name]
    bits = np.dtype(udt).itemsize * 8
    codes = np.arange(1 << (bits - 1), dtype=udt)  # sign bit clear
    with np.errstate(invalid="ignore"):  # NaN codes
        values = codes.view(dtype).astype(np.float64)
    keep = np.isfinite(values)
    return [Fraction(float(v)) for v in values[keep]], [int(c) for c in codes[keep]]


TABLES = {name: _table(name) for name in ML}


def brute_nearest_even(value: Fraction, name: str) -> int:
    """Code of the nearest value of the format to ``value`` (>= 0, below the overflow
    threshold), ties to the even code, found by search over ml_dtypes' value table."""
    values, codes = TABLES[name]
    i = bisect.bisect_left(values, value)
    if i < len(values) and values[i] == value:
        return codes[i]
    lo, hi = i - 1, i
    if hi == len(values):
        # Above max: IEEE rounding goes to max below max + half the top gap (max's mantissa is
        # odd, so the tie goes up). A shortest decimal such as 6e4 for e5m2's 57344 lands here.
        gap = values[-1] - values[-2]
        assert value < values[-1] + gap / 2, "beyond the rounding range of max"
        return codes[-1]
    d_lo, d_hi = value - values[lo], values[hi] - value
    if d_lo != d_hi:
        return codes[lo] if d_lo < d_hi else codes[hi]
    return codes[lo] if codes[lo] % 2 == 0 else codes[hi]


def run_json(capsys, *argv: str) -> list[dict]:
    assert main(["bits", *argv, "--json"]) == 0
    out = capsys.readouterr().out

    def reject(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    return json.loads(out, parse_constant=reject)


def run_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        status = main(["bits", *argv])
        raise SystemExit(status)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_point_one_in_bf16(capsys):
    # bf16 neighbours of 0.1 are 0x3dcc = 0.099609375 and 0x3dcd = 0.10009765625 (nearer).
    (row,) = run_json(capsys, "0.1", "--format", "bf16")
    assert row["code"] == 0x3DCD == brute_nearest_even(Fraction("0.1"), "bfloat16")
    assert row["hex"] == "0x3dcd" and row["binary"] == "0b0011110111001101"
    assert (row["sign"], row["exponent"], row["mantissa"]) == (0, 123, 77)
    assert row["value"] == 0.10009765625 == float(np.uint16(0x3DCD).view(ml_dtypes.bfloat16))
    assert row["shortest"] == "0.1"
    assert row["exact"] == "0.10009765625"
    assert row["class"] == "normal"
    err = Fraction("0.10009765625") - Fraction("0.1")
    assert row["abs_error"] == float(err)
    assert row["rel_error"] == float(err / Fraction("0.1"))
    assert row["ulp_error"] == float(err / Fraction(1, 2**11))  # binade 2^-4, 7 bits: 2^-11
    assert row["next_up"] == 0.1005859375 and row["next_down"] == 0.099609375


def test_no_double_rounding_through_float32(capsys):
    # 1 + 2^-8 + 2^-30: float32 rounds it to 1 + 2^-8, a bf16 tie that goes to even (1.0);
    # rounded once, it lies above the tie, so bf16 stores 1 + 2^-7 (code 0x3f81).
    text = str(Decimal(1) + Decimal(2) ** -8 + Decimal(2) ** -30)
    (row,) = run_json(capsys, text, "-f", "bf16")
    assert row["code"] == 0x3F81 == brute_nearest_even(Fraction(text), "bfloat16")
    via_float32 = np.float32(float(text)).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert via_float32 == 0x3F80  # what a float32 detour gives


@given(
    digits=st.integers(min_value=1, max_value=10**12),
    exp10=st.integers(min_value=-16, max_value=2),
    name=st.sampled_from(sorted(ML)),
)
def test_decimal_rounds_exactly_to_nearest(digits, exp10, name):
    value = Fraction(digits) * Fraction(10) ** exp10
    fmt_max = TABLES[name][0][-1]
    if value > fmt_max:
        return
    text = str(Decimal(digits).scaleb(exp10))
    info = bits_cmd.inspect(
        bits_cmd.parse_value(text), bits_cmd.get_format(name), "nearest_even", False
    )
    assert info["code"] == brute_nearest_even(value, name)
    # The shortest form reads back to the same code, and no decimal with fewer digits does.
    short = Decimal(info["shortest"])
    assert brute_nearest_even(Fraction(short), name) == info["code"]
    n_digits = len(short.normalize().as_tuple().digits)
    if n_digits > 1:
        exact = Decimal(info["exact"])
        quantum = Decimal(1).scaleb(exact.adjusted() - n_digits + 2)
        for rounding in ("ROUND_FLOOR", "ROUND_CEILING"):
            shorter = exact.quantize(quantum, rounding=rounding)
            if 0 < shorter <= fmt_max:
                assert brute_nearest_even(Fraction(shorter), name) != info["code"]
    assert Decimal(info["exact"]) == Decimal(float(np.asarray(info["value"])))


@pytest.mark.parametrize(
    ("text", "code"), [("3.7", 4), ("-3.5", -4), ("2.5", 2), ("-200", -128), ("1e9", 127)]
)
def test_int8_rounds_and_saturates_like_rint_clip(capsys, text, code):
    (row,) = run_json(capsys, text, "-f", "int8")
    expected = int(np.clip(np.rint(float(text)), -128, 127))
    assert expected == code
    assert row["value"] == code and row["code"] == code & 0xFF
    assert row["hex"] == f"0x{code & 0xFF:02x}"


@pytest.mark.parametrize(
    ("text", "fp32_code"),
    [
        ("-0", 0x80000000),
        ("-1.5", 0xBFC00000),
        ("-inf", 0xFF800000),
        ("-1e-39", 0x800AE398),  # a float32 subnormal: numpy gives the same bits
        ("inf", 0x7F800000),
    ],
)
def test_values_starting_with_minus_parse_as_value(capsys, text, fp32_code):
    (row,) = run_json(capsys, text, "-f", "fp32")
    assert row["code"] == fp32_code == int(np.float32(float(text)).view(np.uint32))
    assert row["input"] == text


def test_nan_and_inf_give_valid_json(capsys):
    rows = run_json(capsys, "nan")
    assert [r["format"] for r in rows] == [
        "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    ]  # fmt: skip
    assert all(r["value"] == "nan" and r["class"] == "nan" for r in rows)
    assert all(r["next_up"] is None and r["next_down"] is None for r in rows)
    rows = run_json(capsys, "1e10", "-f", "fp16,e4m3fn,e5m2")
    assert [r["value"] for r in rows] == ["inf", "nan", "inf"]  # per format conventions
    assert rows[0]["abs_error"] == "inf" and rows[0]["next_down"] == 65504.0


def test_errors_beyond_float64_range_stay_valid_json(capsys):
    rows = run_json(capsys, "1e9999", "-f", "fp64,e2m1")
    assert rows[0]["value"] == "inf" and rows[1]["value"] == 6.0
    assert rows[1]["abs_error"] == "1e+9999"  # 1e9999 - 6 to 17 digits: a string, not a float


def test_saturate_and_rounding_modes(capsys):
    (row,) = run_json(capsys, "1e6", "-f", "e4m3fn", "--saturate")
    assert row["value"] == 448.0
    down, up = (run_json(capsys, "0.1", "-f", "bf16", "--rounding", m)[0] for m in ("down", "up"))
    assert (down["code"], up["code"]) == (0x3DCC, 0x3DCD)
    (row,) = run_json(capsys, "-0.1", "-f", "bf16", "--rounding", "toward_zero")
    assert row["code"] == 0xBDCC


def test_raw_codes(capsys):
    (row,) = run_json(capsys, "0x3c00", "-f", "fp16")
    assert row["value"] == 1.0 and row["abs_error"] == 0.0
    (row,) = run_json(capsys, "0b0011110000000000", "-f", "fp16")
    assert row["code"] == 0x3C00
    rows = run_json(capsys, "0x3c00")  # 4 hex digits: the 16-bit default formats
    assert [r["format"] for r in rows] == ["float16", "bfloat16"]
    assert rows[1]["value"] == float(np.uint16(0x3C00).view(ml_dtypes.bfloat16))
    (row,) = run_json(capsys, "0xff", "-f", "int8")
    assert row["value"] == -1


def test_text_output_draws_fields(capsys, monkeypatch):
    assert main(["bits", "0.1", "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "0 | 01111011 | 1001101" in out
    assert "0x3dcd" in out and "0.10009765625" in out and "\x1b[" not in out
    monkeypatch.setattr(bits_cmd, "use_color", lambda: True)
    assert main(["bits", "0.1", "--format", "bf16"]) == 0
    assert "\x1b[" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["1", "-f", "nope"], "unknown format"),
        (["abc"], "not a number"),
        (["0x1ff", "-f", "e4m3"], "wider than"),
        (["1", "--rounding", "sideways"], "allowed: nearest_even"),
        (["1", "--rounding", "stochastic"], "stochastic"),
        (["-0x3c"], "no sign"),
        (["1e-99999999"], "out of range"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    assert needle in run_error(capsys, *argv)


def test_console_script_handles_negative_value():
    proc = subprocess.run(
        [sys.executable, "-m", "precisionlab", "bits", "-2.5e-3", "-f", "fp16", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["code"] == int(np.float16(-2.5e-3).view(np.uint16))
    assert not math.isnan(row["value"])
