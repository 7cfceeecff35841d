"""The command line's own output: did-you-mean for a mistyped subcommand, --version without
importing JAX, tables as wide as their headers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parents[1] / "data" / "run_tiny"


def test_a_mistyped_subcommand_gets_did_you_mean(cli, capsys):
    """Why: a mistyped subcommand got no "did you mean"."""
    from precisionlab.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["rnu", "x.toml"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith("precisionlab: error: argument COMMAND: invalid choice: 'rnu'; did "
                          "you mean 'run'?")  # fmt: skip
    _, err = cli(["bench", "codec"])
    assert "did you mean 'codecs'?" in err


def test_version_answers_at_once_without_jax(tmp_path):
    """Why: `precisionlab --version` took 3 s (it imported every subcommand, and JAX). Now no
    subcommand module and no JAX: measured in CPU seconds (a loaded machine's wall time says
    little), the whole interpreter included."""
    import resource

    code = (
        "import sys; from precisionlab.cli import main\n"
        "try: main(['--version'])\n"
        "except SystemExit as e: print('jax' in sys.modules, e.code)"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert out[0].startswith("precisionlab ") and out[1] == "False 0", out
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.5, f"--version took {cpu:.2f} CPU s"


def _columns_fit(text: str) -> None:
    """Every table of ``text`` (a header line over a rule of dash runs) fits its headers: as
    many header cells as rule runs, and every character of the header and of the rows below
    (to the next blank line) inside a run: no header runs into its neighbour."""
    import re

    lines = text.splitlines()
    found = 0
    for i, rule in enumerate(lines):
        if i == 0 or not rule.strip() or set(rule) - {"-", " "}:
            continue
        runs = [(m.start(), m.end()) for m in re.finditer("-+", rule)]
        header = lines[i - 1]
        cells = [c for c in re.split(r"\s{2,}", header.strip()) if c]
        assert len(cells) == len(runs), (header, rule)
        body = [header]
        for row in lines[i + 1 :]:
            if not row.strip():
                break
            body.append(row)
        for row in body:
            for j, ch in enumerate(row):
                assert ch == " " or any(a <= j < b for a, b in runs), (row, j)
        found += 1
    assert found, text


def test_every_table_fits_its_headers(cli, tmp_path):
    """Why: `conformance --gemm` printed headers that ran together
    (`exact-onceh100-cublaslt-fasth100-cublaslt`): the columns were narrower than the preset
    names. Its tables (from a made-up result: the real one takes minutes), the timings table
    with long unit names, the run report's table and `formats` are each checked."""
    from precisionlab.conformance._gemm import MODELS, GemmResult, gemm_tables
    from precisionlab.experiments import _report as report
    from precisionlab.experiments import _timings as timings

    share = {("xla:cpu", "e4m3 K=256", m): 0.5 for m in MODELS}
    share[("xla:cpu", "e4m3 K=256", "exact-once")] = None
    for _, text in gemm_tables(GemmResult(["xla:cpu"], ["e4m3 K=256"], share)):
        _columns_fit(text)
    run = tmp_path / "run"
    run.mkdir()
    timings.record_unit(run, "00-a", "a-very-long-setting-name/a-very-long-variant-name",
                        {"wall_s": 1.0, "cpu_s": 2.0, "loop": {"compiles": 3}})  # fmt: skip
    _columns_fit(timings.timings_table(run))
    summary = json.loads((DATA / "summary.json").read_text())
    _columns_fit(report.fitted_table(report.summary_rows(summary), report.headers()))
    out, _ = cli(["formats"], status=0)
    _columns_fit(out)
