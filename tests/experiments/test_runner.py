"""The runner and run store: isolation of variants, atomic files, resume after Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments import _train_kind as train_kind
from precisionlab.experiments._summary import SUMMARY_KEYS

FAKE = """
kind = "train"
name = "fake"
[train]
model = "mlp"
steps = 30
[[variant]]
name = "ok"
[[variant]]
name = "boom"
[[variant]]
name = "nan"
[[variant]]
name = "last"
"""


def fake_run_unit(
    cfg, unit_dir, *, on_step, on_hist, resume, quiet, label, hooks=(), on_telemetry=None
):
    """A stand-in trainer: a decreasing loss; 'boom' raises at step 5, 'nan' diverges."""
    for step in range(1, cfg.steps + 1):
        if label == "boom" and step == 5:
            raise RuntimeError("the boom variant broke")
        loss = float("nan") if label == "nan" and step >= 10 else 2.0 / step
        on_step(
            {
                "step": step,
                "loss": loss,
                "loss_scale": 2.0 ** (10 + step % 3),
                "skipped": label == "nan" and step >= 10,
                "underflow_fraction": 0.25,
            }
        )
        if step % 10 == 0:
            on_hist({"step": step, "grad_hist": {"counts": [1, 2], "zeros": 0, "nonfinite": 0}})
    diverged = label == "nan"
    return {
        "eval_loss": 1.5,
        "eval_metric": 0.5,
        "diverged": diverged,
        "divergence_step": 10 if diverged else None,
    }


@pytest.fixture
def fake_trainer(monkeypatch):
    monkeypatch.setattr(train_kind, "run_unit", fake_run_unit)
    monkeypatch.setattr(train_kind, "precompile", lambda cfg: None)  # nothing to compile


def test_failures_and_divergence_do_not_stop_the_run(tmp_path, fake_trainer):
    path = tmp_path / "fake.toml"
    path.write_text(FAKE)
    run_dir = runner.run_file(path, out=tmp_path / "run", quiet=True)
    summary = store.read_json(run_dir / "summary.json")
    units = {u["variant"]: u for u in summary["variants"]}
    assert [u["status"] for u in summary["variants"]] == ["finished", "failed", "finished"] * 1 + [
        "finished"
    ]
    for unit in summary["variants"]:
        assert set(SUMMARY_KEYS) <= set(unit)
    boom = units["boom"]
    assert "RuntimeError: the boom variant broke" in boom["error"]
    log = (run_dir / "variants" / boom["id"] / "error.log").read_text()
    assert "Traceback" in log and "fake_run_unit" in log
    assert boom["steps"] == 4  # what it recorded before failing is kept
    assert units["nan"]["diverged"] and units["nan"]["divergence_step"] == 10
    assert units["nan"]["skipped_steps"] == 21
    ok = units["ok"]
    assert ok["steps"] == 30 and not ok["diverged"]
    assert math.isclose(ok["final_loss"], sum(2.0 / s for s in range(21, 31)) / 10)
    assert ok["min_loss_scale"] == 2.0**10 and ok["max_loss_scale"] == 2.0**12
    assert ok["mean_underflow_fraction"] == 0.25 and ok["eval_metric"] == 0.5
    assert units["last"]["status"] == "finished"
    assert store.read_json(run_dir / "run.json")["status"] == "finished"
    env = store.read_json(run_dir / "environment.json")
    for key in ("python", "jax", "jaxlib", "ml_dtypes", "backend", "device_kind", "device_count"):
        assert env[key] is not None
    config = store.read_json(run_dir / "config.json")
    assert config["resolved"]["units"][0]["params"]["steps"] == 30
    # Every row of every metrics file is valid JSON with a step.
    for unit in summary["variants"]:
        rows = store.read_jsonl(run_dir / "variants" / unit["id"] / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))


@pytest.mark.parametrize("flags", [[], ["--no-report"]])
def test_cli_exit_status_says_variants_failed(tmp_path, fake_trainer, capsys, flags):
    from precisionlab.cli import main

    path = tmp_path / "fake.toml"
    path.write_text(FAKE)
    status = main(["run", str(path), "--out", str(tmp_path / "run"), "--quiet", *flags])
    assert status == 1  # the "boom" variant failed, with or without the report
    assert "1 variant(s) failed" in capsys.readouterr().err


def test_out_dir_holding_a_run_is_refused(tmp_path, fake_trainer):
    path = tmp_path / "fake.toml"
    path.write_text(FAKE)
    runner.run_file(path, out=tmp_path / "run", quiet=True)
    with pytest.raises(ValueError, match="--resume"):
        runner.run_file(path, out=tmp_path / "run", quiet=True)


def test_resume_skips_finished_units(tmp_path, fake_trainer, monkeypatch):
    path = tmp_path / "fake.toml"
    path.write_text(FAKE)
    run_dir = runner.run_file(path, out=tmp_path / "run", quiet=True)
    seen = []

    def spy(params, unit_dir, **kw):
        seen.append(kw["label"])
        return fake_run_unit(params, unit_dir, **kw)

    monkeypatch.setattr(train_kind, "run_unit", spy)
    runner.resume(run_dir, quiet=True)
    assert seen == []  # finished and failed units are kept
    assert store.read_json(run_dir / "run.json")["resumed"] == 1


def test_jsonl_reader_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "m.jsonl"
    with store.JsonlWriter(path) as w:
        w.write({"step": 1, "loss": float("nan")})
        w.write({"step": 2, "loss": 1.0})
    with open(path, "a") as f:
        f.write('{"step": 3, "lo')
    rows = store.read_jsonl(path)
    assert rows == [{"step": 1, "loss": "nan"}, {"step": 2, "loss": 1.0}]


def test_resume_drops_a_torn_line_and_later_rows_before_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "loss": 1.0 / i} for i in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    store.resume_jsonl(path, 4)  # the unit restarts from its checkpoint at step 4
    with store.JsonlWriter(path) as writer:
        writer.write({"step": 4, "loss": 0.5})
    assert store.read_jsonl(path) == [*rows[:3], {"step": 4, "loss": 0.5}]
    assert path.read_text().endswith("\n")
    store.resume_jsonl(tmp_path / "absent.jsonl", 1)  # nothing to prepare
    assert not (tmp_path / "absent.jsonl").exists()


def test_write_json_is_atomic_and_strict(tmp_path):
    path = tmp_path / "s.json"
    store.write_json(path, {"a": float("inf"), "b": [1, 2]})
    assert json.loads(path.read_text()) == {"a": "inf", "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temporary left behind


SMALL = """
kind = "train"
name = "small"
[train]
model = "mlp"
steps = {steps}
batch_size = 32
lr = 0.003
checkpoint_interval = 20
progress = false
model_kwargs = {{ width = 16 }}
telemetry = {{ enabled = false }}  # not the subject: half the compile time of each process
[[variant]]
name = "first"
steps = 40
[[variant]]
name = "second"
"""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "precisionlab", *args]


# Each case is a 1000-step run in a subprocess plus its resume (about 200 s wall on 2 loaded
# cores): Ctrl-C stays in the default suite, the kill (same resume path, no clean-up) is slow.
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGKILL, marks=pytest.mark.slow)],
    ids=["ctrl_c", "kill"],
)
def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, sig):
    """Interrupt a real run in its second variant (Ctrl-C, or a kill that gives it no chance to
    clean up), resume it, and get the uninterrupted result bit for bit."""
    steps = 1000
    path = tmp_path / "small.toml"
    path.write_text(textwrap.dedent(SMALL.format(steps=steps)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # A suite started as a background job of a non-interactive shell inherits SIGINT ignored,
    # and so would the run (Python then installs no KeyboardInterrupt handler): give it the
    # default disposition a user's terminal gives it. (Set here around the start, not in a
    # preexec_fn: that forks a multithreaded process, which JAX warns about.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            _cli("run", str(path), "--out", str(run_dir), "--quiet", "--no-report"),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    second = run_dir / "variants" / "01-second" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(store.read_jsonl(second)) >= 50 or proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    ctrl_c = sig == signal.SIGINT
    assert proc.returncode == (130 if ctrl_c else -signal.SIGKILL), err.decode()
    if ctrl_c:  # one line, no traceback
        assert err.decode().splitlines()[-1:] == ["precisionlab run: interrupted"], err.decode()
        assert "Traceback" not in err.decode(), err.decode()
    run_status = store.read_json(run_dir / "run.json")["status"]
    assert run_status == ("interrupted" if ctrl_c else "running")
    status = store.read_json(run_dir / "variants" / "01-second" / "status.json")
    assert status["status"] == "running"
    done = store.read_jsonl(second)
    assert 50 <= len(done) < steps
    summary = store.read_json(run_dir / "summary.json")  # valid JSON at the interruption
    expected = ["finished", "running"] if ctrl_c else ["finished", "pending"]
    assert [u["status"] for u in summary["variants"]] == expected
    first_rows = (run_dir / "variants" / "00-first" / "metrics.jsonl").read_bytes()

    out = subprocess.run(
        _cli("run", "--resume", str(run_dir), "--quiet"), env=env, capture_output=True, timeout=300
    )
    assert out.returncode == 0, out.stderr.decode()
    assert "Traceback" not in out.stderr.decode(), out.stderr.decode()
    assert "second" in out.stdout.decode()  # the table is printed
    assert (run_dir / "variants" / "00-first" / "metrics.jsonl").read_bytes() == first_rows
    rows = store.read_jsonl(second)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    summary = store.read_json(run_dir / "summary.json")
    assert [u["status"] for u in summary["variants"]] == ["finished", "finished"]
    assert (run_dir / "report.md").exists()

    # The resumed unit's losses equal an uninterrupted run's, bit for bit.
    config = store.read_json(run_dir / "config.json")
    params = config["resolved"]["units"][1]["params"]
    ref: list[dict] = []
    train_kind.run_unit(
        train_kind.config({**params, "checkpoint_interval": 0}, "ref"),
        tmp_path / "ref",
        on_step=ref.append,
        on_hist=lambda _h: None,
        resume=False,
        quiet=True,
        label="ref",
    )
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]


def test_other_kinds_run_through_the_runner(tmp_path, monkeypatch):
    import types

    from precisionlab.experiments import _kinds as kinds

    module = types.ModuleType("fake_kind")
    module.KIND = "fake"
    module.validate = lambda section, where: {"n": section.get("n", 2)}

    def run(section, out_dir, *, quiet=False):
        if section["n"] < 0:
            raise RuntimeError("negative n")
        with store.JsonlWriter(out_dir / "rows.jsonl") as w:
            for i in range(section["n"]):
                w.write({"i": i})
        (out_dir / "summary.txt").write_text("the fake table\n")
        return {"rows": section["n"]}

    module.run = run
    monkeypatch.setitem(sys.modules, "fake_kind", module)
    monkeypatch.setitem(kinds.KINDS, "fake", module)
    path = tmp_path / "f.toml"
    path.write_text('kind = "fake"\n[fake]\nn = 3\n')
    run_dir = runner.run_file(path, out=tmp_path / "ok", quiet=True)
    summary = store.read_json(run_dir / "summary.json")
    assert summary["status"] == "finished" and summary["result"] == {"rows": 3}
    assert len(store.read_jsonl(run_dir / "fake" / "rows.jsonl")) == 3
    from precisionlab.experiments import _report as report

    path_md, table = report.write_report(run_dir)
    assert "the fake table" in table and "the fake table" in path_md.read_text()

    run_dir = runner.run_file(path, out=tmp_path / "bad", overrides=["fake.n=-1"], quiet=True)
    summary = store.read_json(run_dir / "summary.json")
    assert summary["status"] == "failed" and "negative n" in summary["error"]
    assert "Traceback" in (run_dir / "error.log").read_text()


def test_the_survey_kind_runs_through_the_runner(tmp_path):
    path = Path(__file__).parents[2] / "experiments" / "downcast_survey.toml"
    # Two formats and one distribution, the shipped file's other settings as shipped: the runner's
    # dispatch is the subject (tests/metrics/test_survey.py: the survey: every distribution's law,
    # the shipped file's validation, rows, table and plot; the quant tests every format).
    overrides = [
        "survey.size=4096",
        "survey.formats=['int8', 'mxfp4']",
        "survey.dists=['normal']",
    ]
    run_dir = runner.run_file(path, out=tmp_path / "run", overrides=overrides, quiet=True)
    summary = store.read_json(run_dir / "summary.json")
    assert summary["kind"] == "survey" and summary["status"] == "finished", summary
    assert summary["result"]["rows"] == 2, summary["result"]


def test_report_exits_1_when_variants_failed_like_run(tmp_path, monkeypatch):
    from precisionlab.cli import main

    def always_fails(cfg, unit_dir, **kw):
        raise RuntimeError("broken trainer")

    monkeypatch.setattr(train_kind, "run_unit", always_fails)
    path = tmp_path / "fake.toml"
    path.write_text(FAKE)
    run_dir = runner.run_file(path, out=tmp_path / "run", quiet=True)
    assert main(["report", str(run_dir), "--no-plots"]) == 1
    assert main(["run", str(path), "--out", str(tmp_path / "run2"), "--quiet", "--no-report"]) == 1


def test_final_loss_of_a_diverged_unit_is_honest(tmp_path):
    from precisionlab.experiments._config import Unit
    from precisionlab.experiments._summary import FINAL_WINDOW, summarize_unit

    losses = [3.0 - 0.1 * i for i in range(12)] + [math.nan]  # stops at its first nan
    with store.JsonlWriter(tmp_path / "metrics.jsonl") as w:
        for i, loss in enumerate(losses):
            w.write({"step": i + 1, "loss": loss, "skipped": False})
    unit = Unit("00-x", "x", "x", "", "x", 0, {})
    status = {"status": "finished", "result": {"diverged": True, "divergence_step": 13}}
    summary = summarize_unit(unit, tmp_path, status)
    assert math.isnan(summary["final_loss"])  # it used to be the pre-divergence mean
    finite = losses[-FINAL_WINDOW:-1]
    assert summary["final_loss_finite"] == pytest.approx(sum(finite) / len(finite))
    assert summary["diverged"] and summary["divergence_step"] == 13


def test_one_progress_bar_for_the_run_labelled_by_variant(tmp_path, capsys):
    # Issue 10: the bar was labelled with the policy string and restarted for every variant.
    path = tmp_path / "p.toml"
    path.write_text(
        textwrap.dedent(
            """
            kind = "train"
            [train]
            steps = 3
            batch_size = 8
            eval_batches = 1
            progress = true
            model_kwargs = { width = 8 }
            telemetry = { enabled = false }  # not the subject: half the compiles
            [[variant]]
            name = "first-variant"
            [[variant]]
            name = "second-variant"
            seed = 1  # not another policy: the first variant's programs (one compile)
            """
        )
    )
    runner.run_file(path, out=tmp_path / "run")
    err = capsys.readouterr().err
    assert "mlp p=f32" not in err  # the old per-variant bar's label
    for name, done in (("first-variant", 3), ("second-variant", 6)):
        assert f"{name}: " in err and f"{done}/6" in err, err
