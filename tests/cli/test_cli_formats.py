"""`precisionlab formats`, `values`, `env`, and the table renderer.

Oracles: ml_dtypes.finfo and ml_dtypes' decoding of every code; numpy two's complement.
"""

from __future__ import annotations

import io
import json
import math

import ml_dtypes
import numpy as np
import pytest

from precisionlab.cli import main
from precisionlab.cli._render import paint, table, use_color, visible_len
from precisionlab.formats import FORMATS

ML_FLOATS = [
    "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz", "float8_e4m3b11fnuz", "float8_e3m4", "float6_e2m3fn", "float6_e3m2fn",
    "float4_e2m1fn",
]  # fmt: skip


def _ml(name: str):
    return np.dtype(name) if name in ("float32", "float16") else np.dtype(getattr(ml_dtypes, name))


def _json(capsys, *argv: str):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_formats_lists_every_builtin(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in FORMATS:
        assert f"\n{name} " in out
    rows = _json(capsys, "formats", "--json")
    assert [r["name"] for r in rows] == list(FORMATS)


@pytest.mark.parametrize("name", ML_FLOATS)
def test_formats_json_matches_ml_dtypes_finfo(capsys, name):
    (row,) = [r for r in _json(capsys, "formats", "--json") if r["name"] == name]
    info = ml_dtypes.finfo(_ml(name))
    assert row["max"] == float(info.max)
    assert row["smallest_normal"] == float(info.smallest_normal)
    assert row["smallest_subnormal"] == float(info.smallest_subnormal)
    assert row["eps"] == float(info.eps)
    assert row["unit_roundoff"] == float(info.eps) / 2
    assert row["bits"] == info.bits
    assert (row["exponent_bits"], row["mantissa_bits"]) == (info.nexp, info.nmant)
    assert row["binades"] == pytest.approx(math.log2(row["max"] / row["smallest_subnormal"]))


@pytest.mark.parametrize("name", [n for n in ML_FLOATS if n != "float32"])
def test_finite_count_matches_ml_dtypes_enumeration(capsys, name):
    (row,) = [r for r in _json(capsys, "formats", "--json") if r["name"] == name]
    nbits = ml_dtypes.finfo(_ml(name)).bits
    codes = np.arange(1 << nbits, dtype=np.uint16 if nbits > 8 else np.uint8)
    with np.errstate(invalid="ignore"):
        values = codes.view(_ml(name)).astype(np.float64)
    assert row["finite_count"] == int(np.count_nonzero(np.isfinite(values)))


def test_finite_count_float32(capsys):
    (row,) = [r for r in _json(capsys, "formats", "--json") if r["name"] == "float32"]
    assert row["finite_count"] == 2**32 - 2 * 2**23  # all but the all-ones exponent codes


def test_ocp_facts(capsys):
    rows = {r["name"]: r for r in _json(capsys, "formats", "--json")}
    # OCP 8-bit floating point spec, table 1: E4M3 max 448, min subnormal 2^-9; E5M2 max
    # 57344, min subnormal 2^-16.
    assert rows["float8_e4m3fn"]["max"] == 448 and rows["float8_e4m3fn"]["specials"] == "fn"
    assert rows["float8_e4m3fn"]["smallest_subnormal"] == 2.0**-9
    assert rows["float8_e5m2"]["max"] == 57344
    assert rows["float8_e5m2"]["smallest_subnormal"] == 2.0**-16
    assert rows["int4"]["min"] == -8 and rows["int4"]["max"] == 7
    assert rows["float8_e8m0fnu"]["smallest_subnormal"] is None


@pytest.mark.parametrize(
    "name", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float4_e2m1fn"]
)
def test_values_match_ml_dtypes_for_every_code(capsys, name):
    rows = _json(capsys, "values", name, "--json")
    nbits = ml_dtypes.finfo(_ml(name)).bits
    assert [r["code"] for r in rows] == list(range(1 << nbits))
    with np.errstate(invalid="ignore"):
        expected = np.arange(1 << nbits, dtype=np.uint8).view(_ml(name)).astype(np.float64)
    for row, want in zip(rows, expected, strict=True):
        if math.isnan(want):
            assert row["value"] == "nan" and row["class"] == "nan"
        elif math.isinf(want):
            assert row["value"] == ("inf" if want > 0 else "-inf") and row["class"] == "inf"
        else:
            assert row["value"] == want
            assert math.copysign(1, row["value"]) == math.copysign(1, want)  # -0 kept
            assert (row["class"] == "zero") == (want == 0)


def test_values_text_like_ocp_table(capsys):
    assert main(["values", "e4m3fn"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 3 + 256
    assert lines[-1].split()[:4] == ["0xff", "1", "1111", "111"] and lines[-1].endswith("nan")
    assert any(line.startswith("0x7e") and " 448 " in line for line in lines)


def test_values_int4_is_twos_complement(capsys):
    rows = _json(capsys, "values", "int4", "--json")
    expected = [int(v) for v in (np.arange(16, dtype=np.int8) << 4) >> 4]  # sign-extend 4 bits
    assert [r["value"] for r in rows] == expected


@pytest.mark.parametrize(("argv", "needle"), [(["values", "bf16"], "at most 8 bits"),
                                               (["values", "nope"], "unknown format")])  # fmt: skip
def test_values_errors_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_env_reports_measured_flushing(capsys):
    info = _json(capsys, "env", "--json")
    assert info["backend"] and info["devices"]
    assert set(info["versions"]) >= {"jax", "jaxlib", "ml_dtypes"}
    flags = info["float32_subnormals"]
    assert isinstance(flags["arithmetic_flushes"], bool)
    assert isinstance(flags["comparison_flushes"], bool)
    assert main(["env"]) == 0
    assert "bit patterns" in capsys.readouterr().out


def test_table_aligns_numbers_right_and_text_left():
    text = table([["bf16", "1.5", "2.0x"], ["e4m3fn", "12345", None]], ["fmt", "M/s", "ratio"])
    lines = text.splitlines()
    assert lines[0] == "fmt       M/s  ratio"
    assert lines[2] == "bf16      1.5   2.0x"
    assert lines[3] == "e4m3fn  12345"
    with pytest.raises(ValueError, match="3 cells but there are 2 headers"):
        table([["a", "b", "c"]], ["x", "y"])
    with pytest.raises(ValueError, match="align"):
        table([["a"]], ["x"], align="c")


def test_colour_only_on_tty_without_no_color(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty()) and not use_color(io.StringIO())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())
    painted = paint("abc", "bold+red", True)
    assert painted != "abc" and visible_len(painted) == 3
    assert paint("abc", "red", False) == "abc"
