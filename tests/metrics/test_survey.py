"""The survey library, its experiment kind, and the `precisionlab survey` CLI."""

import json
import pathlib

import numpy as np
import pytest

from precisionlab import survey
from precisionlab.cli import main

REPO = pathlib.Path(__file__).resolve().parents[2]
SMALL = {"formats": ["int8", "mxfp4", "fp16"], "dists": ["normal"], "size": 1024}


def test_make_input_shapes_and_laws():
    x = survey.make_input("normal", 4096, seed=1)
    assert x.dtype == np.float32 and x.shape == (16, 256)
    assert abs(x.std() - 1) < 0.05
    assert survey.make_input("student_t:3", 100).shape == (100,)
    lu = np.abs(survey.make_input("loguniform:-20:10", 10000))
    assert 1e-20 <= lu.min() and lu.max() <= 1e10
    assert abs(np.log10(lu).mean() + 5) < 0.3
    u = survey.make_input("uniform", 1000)
    assert u.min() >= -1 and u.max() <= 1


@pytest.mark.parametrize(
    "bad", ["gauss", "student_t", "student_t:-1", "loguniform:3:1", "normal:2"]
)
def test_bad_distributions(bad):
    with pytest.raises(ValueError, match="distribution"):
        survey.make_input(bad, 10)


def test_validate_defaults_and_errors():
    cfg = survey.validate({}, "x.survey")
    assert cfg["formats"] == survey.DEFAULT_FORMATS and cfg["granularity"] == "tensor"
    with pytest.raises(ValueError, match=r"x\.survey: unknown key 'colour'; allowed keys: formats"):
        survey.validate({"colour": 1}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.formats: unknown format 'fp7'"):
        survey.validate({"formats": ["fp7"]}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.size: expected int, got str 'big'"):
        survey.validate({"size": "big"}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.granularity"):
        survey.validate({"granularity": "row"}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.rounding: unknown mode"):
        survey.validate({"rounding": "up-ish"}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.scale"):
        survey.validate({"scale": "max"}, "x.survey")
    with pytest.raises(ValueError, match=r"x\.survey\.formats: expected list of str"):
        survey.validate({"formats": "int8"}, "x.survey")


def test_experiment_file_validates():
    import tomllib

    doc = tomllib.loads((REPO / "experiments" / "downcast_survey.toml").read_text())
    assert doc["kind"] == survey.KIND == "survey"
    cfg = survey.validate(doc["survey"], "downcast_survey.survey")
    assert "mxfp4" in cfg["formats"] and "loguniform:-20:10" in cfg["dists"]


def test_run_writes_rows_summary_and_plot(tmp_path):
    summary = survey.run(dict(SMALL), tmp_path, quiet=True)
    json.dumps(summary)
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert len(rows) == summary["rows"] == 3
    by = {(r["input"], r["format"]): r for r in rows}
    assert by[("normal", "mxfp4")]["scale_rule"] == "floor"
    assert by[("normal", "mxfp4")]["granularity"] == "block:32"
    assert by[("normal", "fp16")]["scale"] == "none"
    assert by[("normal", "int8")]["sqnr_db"] > 35
    assert summary["best_sqnr_format"]["normal"] == "fp16"
    assert (tmp_path / "errors.png").stat().st_size > 1000
    assert "input normal" in (tmp_path / "summary.txt").read_text()


def test_cli_table_json_plot_and_input(tmp_path, capsys):
    np.save(tmp_path / "w.npy", np.random.default_rng(0).standard_normal((8, 64)).astype("f4"))
    rc = main(["survey", "--formats", "int8,mxfp8_e4m3", "--input", str(tmp_path / "w.npy"),
               "--granularity", "channel:0", "--json"])  # fmt: skip
    assert rc == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["input"] for r in rows] == ["w", "w"]
    assert rows[0]["granularity"] == "channel:0"
    rc = main(["survey", "--formats", "int4", "--dist", "laplace", "--size", "1024",
               "--scale", "mse", "--plot", str(tmp_path / "p.png")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0 and "int4" in out and "SQNR dB" in out and (tmp_path / "p.png").exists()
    assert max(len(line) for line in out.splitlines()) <= 100  # the site's code blocks


def test_cli_config(tmp_path, capsys):
    cfg = tmp_path / "s.toml"
    cfg.write_text('kind = "survey"\nname = "t"\n[survey]\nformats = ["e4m3fn"]\n'
                   'dists = ["normal"]\nsize = 1024\n')  # fmt: skip
    assert main(["survey", "--config", str(cfg)]) == 0
    assert "e4m3fn" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--formats", "int9"], "unknown format 'int9'"),
        (["--dist", "gauss"], "unknown distribution 'gauss'"),
        (["--granularity", "rows"], "unknown granularity 'rows'"),
        (["--input", "nothere.npy"], "no such file"),
        (["--config", "nothere.toml"], "no such file"),
        (["--plot", "out.svg"], "PNG"),
        (["--plot", "/missing/dir/x.png"], "directory does not exist"),
    ],
)
def test_cli_errors_are_one_line_exit_2(argv, message, capsys):
    rc = main(["survey", "--size", "64", *argv] if "--config" not in argv else ["survey", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
