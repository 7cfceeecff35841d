"""Regression tests of issue 10: no hang, no traceback, one bounded error line, exit 0/1/2.

Each test drives ``precisionlab.cli.main`` in-process (or a subprocess where a real pipe or
file descriptor matters) with an input that once hung, crashed or misled.
"""

from __future__ import annotations

import subprocess
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from numpy.lib import format as npy

from precisionlab.cli import main


def _run(argv, capsys):
    """(status, stdout, stderr) of one in-process command; SystemExit from argparse counted."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def _one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"precisionlab {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# --- hangs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1e1000000000000000000", "-1e-99999999999999999999"])
def test_bits_huge_exponent_is_refused_at_once(value, capsys):
    start = time.perf_counter()
    status, _, err = _run(["bits", value], capsys)
    assert time.perf_counter() - start < 5
    assert status == 2
    assert "out of range: decimal exponents up to +-10000" in _one_error_line(err, "bits")


def test_bits_overlong_value_and_exponent_fraction_are_refused(capsys):
    status, _, err = _run(["bits", "1" * 5000], capsys)
    line = _one_error_line(err, "bits")
    assert status == 2 and "at most 1000" in line and len(line) < 200
    status, _, err = _run(["bits", "1e5/3"], capsys)  # Fraction would read it; p/q only
    assert status == 2 and "is not a number" in _one_error_line(err, "bits")


@pytest.mark.parametrize("batch", ["100000000000000000000000", "1099511627777"])
def test_memory_huge_batch_is_refused_with_the_bound(batch, capsys):
    start = time.perf_counter()
    argv = ["memory", "--preset", "gpt3-175b", "--batch", batch, "--budget", "80GiB"]
    status, _, err = _run(argv, capsys)
    assert time.perf_counter() - start < 5
    assert status == 2
    assert "batch must be at most 1,099,511,627,776 (2^40)" in _one_error_line(err, "memory")


def test_a_model_no_machine_holds_is_refused_before_the_run(tmp_path, capsys):
    """width 10^12: 10^24 float32 parameters. It once failed in every variant's init
    (numpy could not allocate 116 TiB; exit 1, three error.log tracebacks)."""
    path = tmp_path / "w.toml"
    path.write_text('kind = "train"\n[train]\nmodel = "mlp"\nsteps = 1\n[[variant]]\nname = "a"\n')
    argv = ["run", str(path), "--out", str(tmp_path / "run"), "--quiet", "--set",
            "train.model_kwargs.width=1000000000000"]  # fmt: skip
    status, _, err = _run(argv, capsys)
    assert status == 2
    line = _one_error_line(err, "run")
    assert "model 'mlp' (1e+24 parameters) needs 3.725e+15 GiB in float32, more than the" in line
    assert not (tmp_path / "run").exists()


def test_memory_fit_with_a_large_batch_is_fast(capsys):
    start = time.perf_counter()
    argv = ["memory", "--preset", "gpt3-175b", "--batch", "1000000000", "--budget", "80GiB"]
    status, out, _ = _run(argv, capsys)
    assert time.perf_counter() - start < 10
    assert status == 0 and "smallest change that fits" in out


def test_divisors_against_brute_force():
    from precisionlab.memory._fit import _divisors

    for n in [1, 2, 12, 97, 360, 1024, 5040]:
        brute = [m for m in range(2, n + 1) if n % m == 0]
        got = _divisors(n, most=10**6)
        assert got == brute
        short = _divisors(n, most=4)
        assert short == (brute if len(brute) <= 4 else [*brute[:3], n])


# --- tracebacks -----------------------------------------------------------------------------
def test_memory_seq_with_400_digits_is_one_line(capsys):
    status, _, err = _run(["memory", "--preset", "gpt3-175b", "--seq", "9" * 400], capsys)
    assert status == 2 and "seq must be at most" in _one_error_line(err, "memory")


@pytest.mark.parametrize(
    "argv", [["bench", "--help"], ["bench", "codecs", "--help"], ["survey", "--help"]]
)
def test_help_of_every_level_prints(argv, capsys):
    status, out, err = _run(argv, capsys)
    assert status == 0 and "usage:" in out and err == ""


def _write_header(path, shape, descr="<f4"):
    with open(path, "wb") as fh:
        npy.write_array_header_1_0(fh, {"descr": descr, "fortran_order": False, "shape": shape})


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.write_bytes(b""), "is an empty file"),
        (lambda p: p.write_text("hello\n"), "is not a NumPy .npy file"),
        (lambda p: np.save(p, np.ones(4, ml_dtypes.bfloat16)), "dtype |V2 (raw bytes"),
        (lambda p: _write_header(p, (10**7, 10**7)), "at most 16,777,216 (2^24)"),
        (lambda p: np.save(p, np.zeros((0, 3), np.float32)), "is empty"),
        (lambda p: np.save(p, np.arange(3)), "the survey needs floats"),
    ],
)
def test_survey_bad_npy_files_are_one_line(tmp_path, make, needle, capsys):
    path = tmp_path / "t.npy"
    make(path)
    status, _, err = _run(["survey", "--input", str(path), "--formats", "int8"], capsys)
    assert status == 2
    assert needle in _one_error_line(err, "survey")


def test_survey_empty_npz_is_an_error(tmp_path, capsys):
    np.savez(tmp_path / "e.npz")
    status, out, err = _run(["survey", "--input", str(tmp_path / "e.npz")], capsys)
    assert status == 2 and out == ""
    assert "holds no arrays" in _one_error_line(err, "survey")


def test_survey_huge_size_and_padding_are_refused(tmp_path, capsys):
    status, _, err = _run(["survey", "--size", "1000000000000"], capsys)
    assert status == 2 and "[1, 16,777,216]" in _one_error_line(err, "survey")
    np.save(tmp_path / "w.npy", np.ones((1000, 1), np.float32))
    argv = ["survey", "--input", str(tmp_path / "w.npy"), "--formats", "int8"]
    status, _, err = _run([*argv, "--granularity", "block:100000"], capsys)
    assert status == 2 and "use a block_size of at most 1" in _one_error_line(err, "survey")
    status, out, _ = _run([*argv, "--granularity", "block:4"], capsys)  # mild padding is fine
    assert status == 0 and "block:4" in out


# --- exit codes and messages ----------------------------------------------------------------
def test_broken_pipe_exits_quietly():
    # `precisionlab values e4m3fn | head -1`: the reader closes the pipe early.
    proc = subprocess.Popen(
        [sys.executable, "-m", "precisionlab", "values", "e4m3fn"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    status = proc.wait(timeout=60)
    assert status == 0, err
    assert err == ""


def test_list_presets_checks_the_other_flags(capsys):
    status, _, err = _run(["memory", "--list-presets", "--batch=-1"], capsys)
    assert status == 2 and "batch must be a positive integer" in _one_error_line(err, "memory")


def test_long_values_are_echoed_shortened(capsys):
    status, _, err = _run(["bits", "x" * 100_000], capsys)
    assert status == 2 and len(_one_error_line(err, "bits")) < 300
    status, _, err = _run(["bits", "1", "--format", "q" * 100_000], capsys)
    line = _one_error_line(err, "bits")
    assert status == 2 and len(line) < 400 and "..." in line


def test_unknown_format_message_is_short_and_helpful(capsys):
    status, _, err = _run(["bits", "0.1", "--format", "bf17"], capsys)
    line = _one_error_line(err, "bits")
    assert status == 2 and len(line) < 300 and "did you mean bf16" in line


def test_bench_out_in_a_missing_directory_creates_nothing(tmp_path, capsys):
    target = tmp_path / "missing" / "x.json"
    status, _, err = _run(["bench", "codecs", "--out", str(target)], capsys)
    assert status == 2 and "directory does not exist" in _one_error_line(err, "bench")
    assert not target.parent.exists()


@pytest.mark.parametrize(
    ("argv", "prog"),
    [(["bits", "1", "--bogus"], "precisionlab bits"),
     (["bench", "codecs", "--bogus"], "precisionlab bench codecs"),
     (["memory", "--preset", "gpt3-175b", "extra"], "precisionlab memory")],
)  # fmt: skip
def test_unrecognized_arguments_name_the_subcommand(argv, prog, capsys):
    status, _, err = _run(argv, capsys)
    assert status == 2
    assert err.strip() == f"{prog}: error: unrecognized arguments: {argv[-1]}"
