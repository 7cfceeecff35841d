"""``precisionlab conformance``: the classifier on planted cases, the runner on the known
disagreements, skipping libraries that are missing, and the command line."""

import json

import numpy as np
import pytest

from precisionlab.cli import main
from precisionlab.conformance import _adapters as adapters
from precisionlab.conformance import run_conformance
from precisionlab.conformance._classify import CATEGORIES, RULES, classify, rule_spec
from precisionlab.conformance._exact import encode_exact
from precisionlab.conformance._report import markdown
from precisionlab.conformance._spec import SPECS

NAN8 = 0x7F  # e4m3fn's NaN


# (input, source, format, mode, planted library code, expected rule). Each library code is
# one a real implementation could return; the exact code comes from the reference.
PLANTED = [
    (np.nan, "float32", "float4_e2m1fn", "nearest_even", 0x8, "nan-no-encoding"),
    (np.nan, "float32", "float8_e4m3fn", "nearest_even", 0x00, "nan-not-nan"),
    (np.inf, "float32", "float4_e2m1fn", "nearest_even", 0x0, "inf-no-encoding"),
    (-1.0, "float32", "float8_e8m0fnu", "nearest_even", 0x7F, "negative-unsigned"),
    (0.0, "float32", "float8_e8m0fnu", "nearest_even", 0x00, "zero-no-encoding"),
    (np.inf, "float32", "float8_e4m3fn", "nearest_even", 0x7E, "inf-saturated"),
    (-np.inf, "float32", "float16", "nearest_even", 0xFBFF, "inf-wrong"),
    (500.0, "float32", "float8_e4m3fn", "nearest_even", 0x7E, "overflow-saturated-fp8"),
    (1e6, "float32", "float16", "nearest_even", 0x7BFF, "overflow-saturated"),
    (1.5, "float32", "float8_e8m0fnu", "nearest_even", 0x7F, "e8m0-tie"),
    (1e-40, "float32", "float8_e8m0fnu", "nearest_even", 0xFF, "subnormal-input-as-zero"),
    (1.7670407059322498e-32, "float64", "bfloat16", "nearest_even", 0x0AB8, "double-rounding"),
    (1.0, "float32", "float8_e4m3fn", "nearest_even", NAN8, "nan-for-number"),
    (2.0**-140, "float64", "float32", "nearest_even", 0x0, "flush-to-zero"),
    (-(2.0**-200), "float64", "float16", "nearest_even", 0x0000, "zero-sign"),
    (1 + 2.0**-8, "float32", "bfloat16", "nearest_even", 0x3F81, "wrong-tie"),
    (np.nextafter(0.25, 0), "float64", "float4_e2m1fn", "nearest_away", 0x1, "near-tie"),
    (1.0, "float32", "float8_e4m3fn", "nearest_even", -1, "not-a-value"),
    (1.0, "float32", "float8_e4m3fn", "nearest_even", 0x39, "misrounded"),
]


@pytest.mark.parametrize("case", PLANTED, ids=[c[-1] for c in PLANTED])
def test_classifier_on_planted_cases(case):
    x, source, fmt, mode, lib, want = case
    xs = np.array([x], dtype=np.float64)
    ref = encode_exact(xs, fmt, mode)
    assert ref[0] != lib, "a planted case must disagree with the reference"
    got = classify(xs, np.array([lib]), ref, fmt, mode, source)
    assert got[0] == want
    assert RULES[want].category in CATEGORIES


def test_planted_cases_cover_every_rule_but_one():
    covered = {c[-1] for c in PLANTED}
    # zero-not-in-format needs a library returning a value (gfloat style): tested below.
    assert set(RULES) - covered == {"zero-not-in-format"}


def test_zero_returned_for_a_format_without_zero():
    xs = np.array([2.0**-130])
    ref = encode_exact(xs, "float8_e8m0fnu")
    got = classify(
        xs, np.array([-1]), ref, "float8_e8m0fnu", "toward_zero", "float32",
        lib_values=np.array([0.0]),
    )  # fmt: skip
    assert got[0] == "zero-not-in-format" and RULES[got[0]].category == "violation"


def test_double_rounding_needs_evidence_beyond_the_tie_neighbours():
    """One ulp from a tie, rounding through float32 and a float64 `delta + 0.5` look alike;
    the classifier says double rounding only when a farther input shows it."""
    near = np.nextafter(0.25, 1.0)  # float32 rounds it onto the tie 0.25, -> 0 (even)
    far = 0.25 * (1 + 2.0**-30)  # float32 rounds this onto the tie too
    xs = np.array([near, far])
    ref = encode_exact(xs, "float4_e2m1fn")
    lib = np.array([0, 0])
    both = classify(xs, lib, ref, "float4_e2m1fn", "nearest_even", "float64")
    assert both.tolist() == ["double-rounding", "double-rounding"]
    alone = classify(xs[:1], lib[:1], ref[:1], "float4_e2m1fn", "nearest_even", "float64")
    assert alone.tolist() == ["near-tie"]


def test_every_rule_cites_a_known_spec():
    for rule in RULES:
        for mode in ("nearest_even", "nearest_away", "toward_zero", "up", "down"):
            assert rule_spec(rule, mode) in SPECS


def _cell(result, library, fmt, source, mode="nearest_even"):
    (cell,) = [
        c
        for c in result.cells
        if (c.library, c.format, c.source, c.mode) == (library, fmt, source, mode)
    ]
    return cell


def test_finds_the_ml_dtypes_disagreements_of_issue_16():
    result = run_conformance(["ml_dtypes"], ["bfloat16", "float8_e8m0fnu"], ["float64"])
    bf16 = _cell(result, "ml_dtypes", "bfloat16", "float64")
    (finding,) = bf16.findings
    assert finding.rule == "double-rounding" and finding.category == "violation"
    example = finding.examples[0]
    assert (example.input, example.output, example.exact) == (1.7670407059322498e-32, 0xAB8, 0xAB7)
    e8m0 = _cell(result, "ml_dtypes", "float8_e8m0fnu", "float64")
    tiny = [e for f in e8m0.findings for e in f.examples if e.input == 1e-300]
    assert tiny and tiny[0].output == 0xFF and tiny[0].exact == 0x00  # NaN for 2^-127
    assert result.checked_by_arbiter > 0
    text = markdown(result)
    assert "1.7670407059322498e-32" in text and SPECS["ieee-5.1"].text in text


def test_finds_the_ties_away_error_of_gfloats_scalar_rounder():
    pytest.importorskip("gfloat")
    result = run_conformance(["gfloat"], ["float4_e2m1fn"], ["float64"])
    cell = _cell(result, "gfloat.round_float", "float4_e2m1fn", "float64", "nearest_away")
    (finding,) = [f for f in cell.findings if f.category == "violation"]
    assert finding.rule == "near-tie"
    example = finding.examples[0]
    assert abs(example.input) == np.nextafter(0.25, 0) and example.exact_value == 0.0
    assert abs(example.output_value) == 0.5
    vectorized = _cell(result, "gfloat", "float4_e2m1fn", "float64", "nearest_away")
    assert all(f.category == "undefined" for f in vectorized.findings)  # NaN only


def test_precisionlab_codec_agrees_with_the_reference_in_every_mode():
    result = run_conformance(["precisionlab"], ["float8_e4m3fn"], ["float32"])
    assert len(result.cells) == 6  # every deterministic mode
    assert all(c.mismatches == 0 for c in result.cells)


@pytest.fixture
def without_optional_libraries(monkeypatch):
    """Pretend gfloat and torch are not installed."""
    real = adapters._import

    def fake(name):
        return None if name.split(".")[0] in ("gfloat", "torch") else real(name)

    monkeypatch.setattr(adapters, "_import", fake)


def test_runs_with_only_required_dependencies(without_optional_libraries):
    result = run_conformance(None, ["float8_e4m3fn"], ["float32"])
    assert result.skipped == {
        "gfloat": "gfloat is not installed",
        "gfloat.round_float": "gfloat is not installed",
        "torch:cpu": "torch is not installed",
    }
    libraries = {c.library for c in result.cells}
    assert {"ml_dtypes", "xla:cpu"} <= libraries
    assert all(c.mismatches == 0 for c in result.cells)  # e4m3fn from float32 is exact here


def test_cli_writes_report_and_json(tmp_path, capsys, without_optional_libraries):
    out = tmp_path / "run"
    # a library asked for by name that is missing is an error (test_conformance_missing); one
    # left to the defaults is skipped with its reason (test_runs_with_only_required_dependencies)
    assert main(["conformance", "--libs", "numpy,torch", "--out", str(out)]) == 2
    assert "'torch' was asked for but torch is not installed" in capsys.readouterr().err
    argv = ["conformance", "--libs", "numpy", "--formats", "float16", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "from float64, nearest_even" in text and "| float16 | 0     |" in text
    assert (out / "report.md").exists() and (out / "environment.json").exists()
    data = json.loads((out / "conformance.json").read_text())
    assert {c["source"] for c in data["cells"]} == {"float32", "float64"}
    capsys.readouterr()
    # the results already in --out are replaced only when asked (--force)
    assert main([*argv, "--sources", "float64"]) == 2
    assert "already holds report.md" in capsys.readouterr().err
    assert main([*argv, "--json", "--sources", "float64", "--force"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["report"] == str(out / "report.md") and len(printed["cells"]) == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--libs", "tensorflow"], "unknown library 'tensorflow'; allowed: ml_dtypes"),
        (["--formats", "int8"], "int8 is an integer format"),
        (["--formats", "nope"], "unknown format 'nope'"),
        (["--sources", "float128"], "unknown source type 'float128'"),
        (["--formats", ","], "--formats needs at least one name"),
        (["--formats", "float64"], "narrower than float64"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path):
    assert main(["conformance", *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("precisionlab conformance: error: ")
    assert message in err


def test_cli_bad_flag_value_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["conformance", "--seed", "x"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1
