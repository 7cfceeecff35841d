"""Smoke test of `precisionlab bench codecs` on tiny sizes: output structure, ratio columns,
agreement with the peers. Never asserts timings."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precisionlab.bench import _timing
from precisionlab.bench._codecs import DEFAULT_FORMATS, HIGH, LOW, make_inputs
from precisionlab.cli import main
from precisionlab.formats import get_format


def _gfloat_imports() -> bool:
    # installed is not enough: the bench leaves gfloat out when it cannot be imported (a
    # dependency of it missing, as once on a machine where it was copied in without them)
    try:
        import gfloat
        import gfloat.formats  # noqa: F401
    except ImportError:
        return False
    return True


HAVE_GFLOAT = _gfloat_imports()
TINY = ["--size", "4096", "--chunk", "1024", "--repeats", "1", "--gfloat-size", "256"]


def test_bench_json_structure_and_agreement(capsys, tmp_path):
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", *TINY, "--json", "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads(out.read_text())
    streamed = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert streamed == result["rows"]
    assert result["size"] == 4096 and result["gfloat_size"] == 256
    assert result["copy_bandwidth_bytes_per_s"] > 0
    names = [get_format(f).name for f in DEFAULT_FORMATS]
    assert [(r["format"], r["op"]) for r in result["rows"]] == [
        (name, op) for name in names for op in ("encode", "decode")
    ]
    expected = {"bf16/fp16 >= 2x peer": 4, "fp8/fp4 >= 10x ml_dtypes": 6}
    expected |= {"all >= 100x gfloat": 10} if HAVE_GFLOAT else {}
    expected |= {"all >= 70% of copy bandwidth": 12}
    assert {t["target"]: t["of"] for t in result["targets"]} == expected
    for row in result["rows"]:
        assert row["precisionlab"] > 0 and row["peer"] > 0
        assert row["ratio_peer"] == pytest.approx(row["precisionlab"] / row["peer"])
        assert 0 < row["copy_fraction"]
        assert row["mismatches"] == 0  # precisionlab agrees with ml_dtypes / numpy rint+clip
        assert row["floor"] > 0  # the one-operation XLA kernel timed alongside
        assert row["floor_fraction"] == pytest.approx(row["precisionlab"] / row["floor"])
        if row["format"] == "int8":
            assert row["peer_name"] == "numpy" and row["gfloat"] is None
        else:
            assert row["peer_name"] == ("numpy" if row["format"] == "float16" else "ml_dtypes")
            if HAVE_GFLOAT:  # an optional peer (the `bench` extra)
                assert row["ratio_gfloat"] == pytest.approx(row["precisionlab"] / row["gfloat"])
            else:
                assert row["gfloat"] is None


def test_bench_text_table(capsys):
    assert main(["bench", "codecs", *TINY, "--formats", "bf16,e2m1"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("format"))
    for column in (
        "precisionlab M/s",
        "peer M/s",
        "vs peer",
        "vs gfloat",
        "of copy bw",
        "of floor",
    ):
        assert column in header
    assert "copy bandwidth" in out and "targets (chunked encode):" in out and "issue" not in out
    assert sum(line.startswith(("bfloat16", "float4_e2m1fn")) for line in out.splitlines()) == 4
    assert main(["bench", "codecs", *TINY, "--formats", "int8", "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("| int8 | ") for line in lines) == 2


@pytest.mark.parametrize(
    ("argv", "needle"), [(["--formats", "nope"], "unknown format"), (["--size", "0"], "size")]
)
def test_bench_bad_input_exit_2(capsys, argv, needle):
    try:
        status = main(["bench", "codecs", *argv])
    except SystemExit as exc:  # argparse type errors exit from the parser
        status = exc.code
    assert status == 2
    assert needle in capsys.readouterr().err


def test_inputs_span_the_stated_range():
    x = make_inputs(1 << 14)
    assert x.dtype == np.float32
    mag = np.abs(x)
    assert mag.min() >= 2.0**LOW and mag.max() <= 2.0**HIGH
    assert (x < 0).any() and (x > 0).any()
    assert (mag < 2.0**-14).any() and (mag > 65504).any()  # fp16 subnormal and overflow


def test_timing_helpers():
    calls = []
    timing = _timing.time_call(lambda: calls.append(1), repeats=3, warmup=2)
    assert len(calls) == 5 and timing.repeats == 3
    assert 0 <= timing.best <= timing.median
    assert _timing.copy_bandwidth(1 << 16, repeats=1) > 0
    with pytest.raises(ValueError, match="repeats"):
        _timing.time_call(lambda: None, repeats=0)


def test_bench_whole_array_json_structure_and_agreement(capsys):
    argv = ["bench", "codecs", "--whole-array", "--size", "4096", "--repeats", "1", "--json"]
    assert main([*argv, "--formats", "bf16,fp16,e4m3fn,e2m3,int8"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "whole-array" and result["chunk"] is None
    assert [(r["format"], r["op"]) for r in result["rows"]] == [
        (name, op)
        for name in ("bfloat16", "float16", "float8_e4m3fn", "float6_e2m3fn", "int8")
        for op in ("encode", "decode")
    ]
    expected = {"bf16 >= 1.0x ml_dtypes": 4, "fp16 >= 2x numpy": 4}
    expected |= {"8/6/4-bit floats >= 10x ml_dtypes": 8}  # public and jit, both ops
    assert {t["target"]: t["of"] for t in result["targets"]} == expected
    for row in result["rows"]:
        assert row["mode"] == "whole-array" and row["gfloat"] is None
        assert row["ratio_peer"] == pytest.approx(row["precisionlab"] / row["peer"])
        assert row["ratio_jit_peer"] == pytest.approx(row["jit"] / row["peer"])
        assert row["mismatches"] == 0  # the public call agrees with the peer's astype
        assert row["faults"] >= -1 and row["jit_faults"] >= -1 and row["peer_faults"] >= -1
        assert row["floor_fraction"] == pytest.approx(row["jit"] / row["floor"])


def test_bench_whole_array_text_table(capsys):
    argv = ["bench", "codecs", "--whole-array", "--size", "4096", "--repeats", "1"]
    assert main([*argv, "--formats", "e5m2", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| format | op | public M/s | jit M/s |" in out
    assert "| of copy bw | jit of floor | faults/call |" in out
    assert sum(line.startswith("| float8_e5m2 | ") for line in out.splitlines()) == 2
    assert "targets (public and jitted calls):" in out and "issue" not in out


def test_minor_faults_counts_fresh_pages():
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("page faults are counted on Linux")
    assert _timing.minor_faults(lambda: np.ones(1 << 22, np.uint8)) >= 0
    # Touching 64 fresh 4 KiB pages of an mmapped buffer faults at least once per page.
    import mmap

    buf = mmap.mmap(-1, 64 * 4096)
    assert _timing.minor_faults(lambda: buf.write(b"\x01" * (64 * 4096))) >= 64
