"""The headline public functions carry ``>>>`` examples, the examples run (``doctest``), and
every number an example shows is the one an independent oracle gives (ml_dtypes casts, exact
float64 or hand computations stated beside each oracle below), not only what the code said.

An example imports what it uses (it runs with empty globals), so it can be pasted as it is.
"""

from __future__ import annotations

import doctest
import importlib
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

E4M3, E5M2, BF16 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.bfloat16


def _cast(values, dtype) -> list[float]:
    """float32 ``values`` cast by ml_dtypes to ``dtype`` (round to nearest even) and back."""
    return np.asarray(values, np.float32).astype(dtype).astype(np.float64).tolist()


def _bytes(values, dtype) -> list[str]:
    return [hex(c) for c in np.asarray(values, np.float32).astype(dtype).view(np.uint8).tolist()]


def _symmetric(values, bits: int) -> tuple[Fraction, list[int], list[float]]:
    """(scale, integer codes, values) of symmetric per-tensor integer quantization, exactly:
    scale = amax / (2**(bits-1) - 1), codes rounded half to even (Python's round)."""
    xs = [Fraction(float(np.float32(v))) for v in values]
    scale = max(abs(x) for x in xs) / (2 ** (bits - 1) - 1)
    codes = [round(x / scale) for x in xs]
    return scale, codes, [float(c * scale) for c in codes]


def _encode():
    x = [1.0, -2.0, 0.1, 500.0]
    return [str(_bytes(x, E4M3)), str(_bytes(np.clip(x, -448, 448), E4M3))]


def _decode():
    codes = np.array([0x38, 0xC0, 0x1D, 0x7E, 0x7F], np.uint8)
    return [str(codes.view(E4M3).astype(np.float64).tolist())]


def _round_to_format():
    saturated = min(500.0, float(ml_dtypes.finfo(E4M3).max))
    return [str(_cast([0.1, 1.00390625, 3.0], BF16)), str(_cast(saturated, E4M3))]


def _fields():
    (code,) = np.array([-1.5], np.float32).astype(E5M2).view(np.uint8).tolist()
    # sign bit, 5 exponent bits, 2 mantissa bits
    return [str((hex(code), [code >> 7, (code >> 2) & 0x1F, code & 0x3]))]


def _classify():
    values = np.array([0.0, 2.0**-16, 1.0, np.inf, np.nan], np.float32).astype(E5M2)
    tiny = ml_dtypes.finfo(E5M2).smallest_normal  # 2**-14

    def name(v) -> str:
        if np.isnan(v):
            return "NAN"
        if np.isinf(v):
            return "INF"
        return "ZERO" if v == 0 else "SUBNORMAL" if abs(v) < tiny else "NORMAL"

    return [str([name(v) for v in values])]


def _get_format():
    fi = ml_dtypes.finfo(E4M3)
    shown = (
        "float8_e4m3fn",
        float(fi.max),
        float(fi.smallest_normal),
        float(fi.smallest_subnormal),
    )
    # e3m2, bias 5, IEEE: the largest finite exponent field is 6, the mantissa 1.11b
    return [str(shown), str(1.75 * 2.0 ** (6 - 5))]


def _quantize():
    scale, codes, values = _symmetric([1.984375, -1.0, 0.3, 0.01], 8)
    return [str(float(scale)), str([c % 256 for c in codes]), str(values)]


def _dequantize():
    return [str(_symmetric([3.5, -1.0, 1.2, 0.3], 4)[2])]


def _fake_quant():
    _, codes, values = _symmetric([1.984375, -1.0, 0.3, 0.01], 8)
    assert all(abs(c) <= 127 for c in codes)  # nothing clipped: the clipped STE passes all
    return [str(values), str([1.0] * 4)]


def _get_policy():
    # the dtypes the policy string names (p=f32, c=bf16, o=f32); a bare dtype sets all three
    dtypes = (np.dtype("float32"), np.dtype(BF16), np.dtype("float32"))
    return [repr(dtypes), repr("p=bf16,c=bf16,o=bf16")]


def _matmul():
    # a's per-tensor scale: 448 / amax rounded down to a power of two (256); b (ones) is
    # exact at any power-of-two scale, so the product is the sum of a's rounded values
    scale = 2.0 ** np.floor(np.log2(448 / np.float32(1.1)))
    a = np.array(_cast(np.float32([1.0, 1.1]) * np.float32(scale), E4M3)) / scale
    return [str([[float(a.sum())]])]


def _gemm():
    # H100 FP8 (13 fraction bits): the grid is 2**(8 - 13); 2**-7 is cut. B200: 2**(8 - 25)
    def step(fraction_bits: int) -> float:
        grid = Fraction(2) ** (8 - fraction_bits)
        return float(sum((Fraction(p) // grid) * grid for p in (448.0, 2.0**-7)))

    return [str([[step(13)]]), str([[step(25)]])]


def _error_report():
    x = np.array([1.0, 1.00390625, 3.0])
    err = np.abs(np.array(_cast(x, BF16)) - x)
    ulp = 2.0**-7  # bfloat16's step in [1, 2)
    return [str((float(err.max()), float(err[1] / ulp), 0.0))]


#: public name -> the outputs its examples show, computed by the oracle.
HEADLINE = {
    "precisionlab:encode": _encode,
    "precisionlab:decode": _decode,
    "precisionlab:round_to_format": _round_to_format,
    "precisionlab:fields": _fields,
    "precisionlab:classify": _classify,
    "precisionlab:get_format": _get_format,
    "precisionlab:quantize": _quantize,
    "precisionlab:dequantize": _dequantize,
    "precisionlab:fake_quant": _fake_quant,
    "precisionlab.mixed:get_policy": _get_policy,
    "precisionlab.recipes:matmul": _matmul,
    "precisionlab.hardware:gemm": _gemm,
    "precisionlab.metrics:error_report": _error_report,
}


def _resolve(name: str):
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def _examples(name: str) -> doctest.DocTest:
    (test,) = doctest.DocTestFinder(recurse=False).find(_resolve(name), name, globs={})
    return test


@pytest.mark.parametrize("name", sorted(HEADLINE))
def test_headline_function_has_an_example_that_runs(name):
    test = _examples(name)
    assert test.examples, f"{name} has no >>> example in its docstring"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    result = runner.run(test, out=lambda text: print(text, end=""))
    assert result.failed == 0, f"{name}: {result.failed} example(s) failed (printed above)"


@pytest.mark.parametrize("name", sorted(HEADLINE))
def test_every_number_shown_is_the_oracles(name):
    shown = [ex.want.strip() for ex in _examples(name).examples if ex.want.strip()]
    assert shown == HEADLINE[name]()
