"""A run's life as the user sees it: the lock, resume, signals, killed runs, damaged files, the
timings file. The runs train nothing: a stand-in trainer writes rows like the real one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _tiny_runs import two_variants

from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments import _train_kind as train_kind


@pytest.fixture
def work(tmp_path, monkeypatch):
    return two_variants(tmp_path, monkeypatch)


DATA = Path(__file__).parents[1] / "data" / "run_tiny"


# A subprocess running `precisionlab ARGV` with train_kind.run_unit replaced by a stand-in that
# writes one metrics row per step, sleeping PRECISIONLAB_TEST_STEP_S between steps.
_FAKE_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from precisionlab.experiments import _train_kind as train_kind

    def run_unit(cfg, unit_dir, *, on_step, on_hist, resume, quiet, label, hooks=(),
                 on_telemetry=None, timings=None):
        for step in range(1, cfg.steps + 1):
            time.sleep(float(os.environ.get("PRECISIONLAB_TEST_STEP_S", "0")))
            on_step({"step": step, "loss": 1.0 / step})
        return {"eval_loss": 1.0, "eval_metric": 0.5, "diverged": False}

    train_kind.run_unit = run_unit
    train_kind.precompile = lambda cfg: None
    from precisionlab.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def _default_hup() -> None:
    """In the child: SIGHUP back to its default. A suite started under ``nohup`` passes SIGHUP
    on ignored, and precisionlab then rightly leaves it ignored (the user asked for that)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _fake_cli(args: list[str], *, step_s: float = 0.0, **kw) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PRECISIONLAB_TEST_STEP_S": str(step_s)}
    return subprocess.Popen(
        [sys.executable, "-c", _FAKE_TRAINER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_hup,
        **kw,
    )


def fake_run_unit(cfg, unit_dir, *, on_step, on_hist, resume, quiet, label, hooks=(), **_):
    for step in range(1, cfg.steps + 1):
        on_step({"step": step, "loss": 1.0 / step})
    return {"eval_loss": 1.0, "eval_metric": 0.5, "diverged": False}


@pytest.fixture
def fake_trainer(monkeypatch):
    monkeypatch.setattr(train_kind, "run_unit", fake_run_unit)
    monkeypatch.setattr(train_kind, "precompile", lambda cfg: None)


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the lock (taken, then released, by a refused run)."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_force_into_a_run_without_config_json_refuses(work, cli):
    """Why: `run s2.toml --out old --force`, old holding a finished run whose config.json is
    missing, reused the old units under the new config and printed the old table, exit 0."""
    old = work / "old"
    shutil.copytree(DATA, old)
    (old / "config.json").unlink()
    before = _tree(old)
    _, err = cli(["run", "s5.toml", "--out", str(old), "--force", "--quiet", "--no-report"])
    assert "no config.json" in err and "another run's files" in err
    assert _tree(old) == before  # nothing written, nothing reused


def test_resume_refuses_units_recorded_under_another_config(work, fake_trainer):
    """Why: an old 3-step metrics.jsonl kept under a 5-step config. A unit's status records
    its configuration's hash; a run whose config.json was swapped for another one's refuses."""
    run_dir = runner.run_file("s2.toml", out="run", quiet=True)
    status = store.read_json(run_dir / "variants" / "00-a" / "status.json")
    assert status["config_hash"] == runner.config_hash(
        store.read_json(run_dir / "config.json")["resolved"]["units"][0]["params"]
    )
    other = runner.run_file("s5.toml", out="other", quiet=True)
    shutil.copy(other / "config.json", run_dir / "config.json")  # the 5-step run's config
    with pytest.raises(ValueError, match="recorded under another configuration"):
        runner.resume(run_dir, quiet=True)
    # a config.json edited by hand (its document no longer the recorded one) is refused too
    doc = json.loads((other / "config.json").read_text())
    doc["document"]["train"]["steps"] = 7
    (other / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no longer resolves"):
        runner.resume(other, quiet=True)


def test_the_lock_is_taken_before_config_json_is_written(work, cli):
    """Why: two runs started together into one --out mixed their files: config.json was
    written before the lock was taken. With the lock held elsewhere nothing is written."""
    out = work / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import time
            from precisionlab.experiments import _store as store
            with store.run_lock({str(out)!r}):
                print("locked", flush=True)
                time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        _, err = cli(["run", "s2.toml", "--out", str(out), "--force", "--quiet", "--no-report"])
        assert f"pid {holder.pid}" in err
        assert sorted(os.listdir(out)) == [".lock"]  # no config.json of the loser
    finally:
        holder.kill()
        holder.wait()


def test_two_runs_started_together_into_one_out(work):
    """The race itself: two `run --out same` processes started at once; one runs, the other
    exits 2 naming the holder or the run, and the directory holds one run's files only."""
    out = work / "same"
    procs = [
        _fake_cli(["run", f"s{n}.toml", "--out", str(out), "--force", "--quiet", "--no-report"],
                  step_s=0.05)
        for n in (2, 5)
    ]  # fmt: skip
    results = [(p.wait(timeout=600), p.stderr.read()) for p in procs]  # a loaded machine
    codes = sorted(rc for rc, _ in results)
    assert codes == [0, 2], results
    loser = next(err for rc, err in results if rc == 2)
    assert "another precisionlab process" in loser or "already holds a run" in loser, loser
    steps = store.read_json(out / "config.json")["resolved"]["units"][0]["params"]["steps"]
    for unit in ("00-a", "01-b"):
        rows = store.read_jsonl(out / "variants" / unit / "metrics.jsonl")
        assert [r["step"] for r in rows] == list(range(1, steps + 1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_sigterm_and_sighup_end_a_run_like_ctrl_c(work, sig):
    """Why: SIGTERM left run.json "running" for ever and a .lock naming a dead process."""
    out = work / "run"
    proc = _fake_cli(["run", "s5.toml", "--out", str(out), "--quiet", "--no-report"], step_s=5)
    metrics = out / "variants" / "00-a" / "metrics.jsonl"
    deadline = time.monotonic() + 600  # generous: starting JAX on a loaded machine is slow
    while not store.read_jsonl(metrics) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-1] == f"precisionlab run: terminated ({signal.Signals(sig).name})"
    assert "Traceback" not in err
    assert store.read_json(out / "run.json")["status"] == "interrupted"
    assert store.lock_holder(out) == (str(proc.pid), False)  # released
    assert store.read_json(out / "variants" / "00-a" / "status.json")["status"] == "running"
    assert store.read_json(out / "summary.json")["variants"][0]["status"] == "running"


def _dead_pid() -> str:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return str(proc.pid)


def test_a_killed_run_is_recognised_and_a_plain_rerun_names_resume(work, cli, fake_trainer):
    """Why: after a kill, run.json said "running" for ever beside a .lock holding a dead pid,
    and a plain re-run of the same command silently started afresh in a new directory."""
    run_dir = runner.run_file("s2.toml", quiet=True)  # runs/tiny-<time>
    info = store.read_json(run_dir / "run.json")
    store.write_json(run_dir / "run.json", {**info, "status": "running"})
    dead = _dead_pid()
    (run_dir / ".lock").write_text(f"{dead}\n")
    assert store.lock_holder(run_dir) == (dead, False)
    cli(["report", str(run_dir), "--no-plots"], status=0, limit_s=600)
    text = (run_dir / "report.md").read_text()
    assert f"its process {dead} has ended" in text and "--resume" in text
    _, err = cli(["run", "s2.toml", "--quiet", "--no-report"])
    assert str(run_dir) in err and "--resume" in err and "--force" in err
    assert f"left running by process {dead}" in err
    assert os.listdir("runs") == [run_dir.name]  # nothing started beside it
    _, err = cli(["run", "--resume", str(run_dir), "--no-report"], status=0, limit_s=600)
    assert f"left running by process {dead}, which has ended" in err
    assert store.read_json(run_dir / "run.json")["killed"] == [dead]
    # an interrupted run is named too; --force starts a new one beside it
    store.write_json(run_dir / "run.json", {**info, "status": "interrupted"})
    _, err = cli(["run", "s2.toml", "--quiet", "--no-report"])
    assert "was interrupted" in err
    cli(["run", "s2.toml", "--quiet", "--no-report", "--force"], status=0, limit_s=600)
    assert len(os.listdir("runs")) == 2


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _edit_jsonl(path: Path, edit) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        edit(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


_UNIT = Path("variants") / "00-a"


# file, edit, words the one-line error names: a nested field each, KeyError/IndexError before
_NESTED = {
    "telemetry-summary-steps": (
        "summary.json",
        lambda d: d["variants"][0]["telemetry"].pop("steps"),
        "telemetry: missing field 'steps'",
    ),
    "groups-n": (
        "summary.json",
        lambda d: d.update(groups=[{"group": "a", "diverged": 0}]),
        "groups[0]: missing field 'n'",
    ),
    "groups-group": (
        "summary.json",
        lambda d: d.update(groups=[{"n": 2, "diverged": 0}]),
        "groups[0]: missing field 'group'",
    ),
    "telemetry-row-n": (
        str(_UNIT / "telemetry.jsonl"),
        lambda r: r.pop("n"),
        "missing field 'n'",
    ),
    "hist-edges": (
        str(_UNIT / "hist.jsonl"),
        None,  # a row whose 3 counts have 2 edges (the copy has no histogram row)
        "edges for",
    ),
    "status-summary": (
        str(_UNIT / "status.json"),
        lambda d: d["summary"].update(final_loss=[1]),
        "summary: final_loss: expected a number",
    ),
}


@pytest.mark.parametrize("case", list(_NESTED))
def test_damaged_nested_run_fields_are_one_line(work, cli, monkeypatch, case):
    """Why: damaged nested run files crashed `report` (KeyError: 'steps', 'n', 'group'; an
    IndexError in the plots when a histogram's counts and edges disagree): runfiles.py
    checked top-level fields only. Now one schema language (_schema.Field) covers nested
    tables and lists of records, and the error is one line naming the file and the field."""
    name, edit, words = _NESTED[case]
    run = work / "r"
    shutil.copytree(DATA, run)
    path = run / name
    if edit is None:
        hist = {"counts": [1, 2, 3], "edges": [0.0, 1.0], "zeros": 0, "nonfinite": 0}
        path.write_text(json.dumps({"step": 2, "grad_hist": hist}) + "\n")
    else:
        (_edit_jsonl if name.endswith(".jsonl") else _edit_json)(path, edit)
    plots = case in ("hist-edges", "telemetry-row-n")  # read by the plots only
    monkeypatch.setenv("PRECISIONLAB_REPORT_WORKERS", "1")  # drawn here, not in workers
    if name.endswith("status.json"):  # read by resume (which rebuilds summary.json from it)
        _, err = cli(["run", "--resume", str(run), "--quiet", "--no-report"])
    else:
        _, err = cli(["report", str(run)] + ([] if plots else ["--no-plots"]), limit_s=600)
    assert Path(name).name in err and words in err, err


def test_the_run_file_schema_is_one_language():
    """Every run file's schema is made of _schema.Field (nested ones included)."""
    from precisionlab._schema import Field
    from precisionlab.experiments._runfiles import SCHEMAS

    stack = [f for schema in SCHEMAS.values() for f in schema.values()]
    seen = 0
    while stack:
        field = stack.pop()
        assert isinstance(field, Field), field
        seen += 1
        stack.extend((field.fields or {}).values())
        stack.extend([field.values] if field.values is not None else [])
    assert seen > 100


_MEM = Path(__file__).resolve().parents[2] / "experiments" / "memory.toml"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "s2.toml", "--set", "train.data_kwargs.input_scale=1e308"], "input_scale"),
        (["run", "s2.toml", "--set", "train.data=digits",
          "--set", "train.data_kwargs.input_scale=1e308"], "input_scale"),
        (["run", "MEM", "--set", "memory.seq=0"], "memory.seq: must be an int >= 1"),
        (["bench", "recipes", "--accumulator", "--recipes", "nope"], "unknown recipe 'nope'"),
        (["bench", "hardware", "--m", "2147483647", "--n", "1", "--k", "1"], "GiB"),
    ],
    ids=["teacher-input-scale", "digits-input-scale", "memory-seq", "bench-accumulator",
         "bench-hardware-m"],
)  # fmt: skip
def test_meaningless_numbers_and_names_are_refused(work, cli, argv, message):
    """Why: input_scale = 1e308 (inf once the data is float32) and memory.seq = 0 validated;
    `bench recipes --accumulator --recipes nope` exited 0; `bench hardware --m 2147483647`
    raised MemoryError."""
    argv = [str(_MEM) if a == "MEM" else a for a in argv]
    if argv[0] == "run":
        argv += ["--quiet", "--no-report"]
    _, err = cli(argv)
    assert message in err, err
    assert not (work / "runs").exists()


def test_an_exception_in_the_users_function_is_one_line(work, cli):
    """Why: an exception inside the user's function in `emulate-check` escaped as a full
    traceback."""
    (work / "bad.py").write_text(
        textwrap.dedent("""
        import jax.numpy as jnp

        def model(x):
            raise RuntimeError("the model broke")

        def inputs():
            return (jnp.ones(3),)
    """)
    )
    _, err = cli(["emulate-check", "bad.py"])
    assert "bad.py: calling it on inputs() failed: RuntimeError: the model broke" in err


def test_the_timings_file_accounts_for_the_whole_run(tmp_path):
    """Why: the main job's timings file accounted for 58 s of a 112 s first run: imports,
    planning, the environment, waits for the compile thread, summaries and the interpreter's
    teardown were not measured. Now timings.json's ``process`` covers the process from its
    start (Linux /proc) and its total is the wall time a caller measures, within 5%."""
    (tmp_path / "one.toml").write_text(
        textwrap.dedent("""
        kind = "train"
        name = "one"
        [train]
        model = "mlp"
        steps = 1
        batch_size = 8
        eval_batches = 1
        model_kwargs = { width = 8, depth = 1 }
        telemetry = { enabled = false }
        [[variant]]
        name = "a"
    """)
    )
    argv = [sys.executable, "-m", "precisionlab", "run", "one.toml", "--out", "run",
            "--timings", "--no-report", "--quiet", "--no-cache"]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=tmp_path, check=True, capture_output=True, timeout=300)
    wall = time.perf_counter() - t0
    proc = store.read_json(tmp_path / "run" / "timings.json")["process"]
    phases = proc["phases"]
    for name in ("startup", "imports", "plan", "environment", "units", "summaries"):
        assert phases[name]["wall_s"] > 0, name
    total = proc["total"]["wall_s"]
    assert abs(total - wall) <= 0.05 * wall, (total, wall)
    assert abs(proc["unaccounted"]["wall_s"]) <= 0.05 * total, proc


def test_a_rerun_copies_its_telemetry_figures_instead_of_drawing_them(work, monkeypatch):
    """Time: the report's telemetry figures were half of a warm rerun's CPU seconds. With a
    figure cache (``run`` passes figures/ of its compilation cache), figures drawn from the
    same rows, targets, title and code are copied, byte for byte; other rows are drawn."""
    from precisionlab.experiments import _report as report
    from precisionlab.experiments import _telemetry_views as telemetry_views

    monkeypatch.setenv("PRECISIONLAB_REPORT_WORKERS", "1")
    cache = work / "cache" / "figures"
    first, second = work / "r1", work / "r2"
    shutil.copytree(DATA, first)
    shutil.copytree(DATA, second)
    report.write_report(first, figure_cache=cache)
    pngs = sorted((first / "plots").glob("telemetry_*.png"))
    assert pngs and len(list(cache.glob("*.png"))) == len(pngs)

    def refuse(jobs):
        assert not jobs, "a cached figure was drawn again"
        return []

    monkeypatch.setattr(telemetry_views, "_draw_all", refuse)
    report.write_report(second, figure_cache=cache)
    for png in pngs:
        assert (second / "plots" / png.name).read_bytes() == png.read_bytes()
    assert (second / "report.md").read_text().count("telemetry_heatmap") == (
        (first / "report.md").read_text().count("telemetry_heatmap")
    )
    with open(second / "variants" / "00-a" / "telemetry.jsonl", "a") as f:
        f.write((DATA / "variants" / "00-a" / "telemetry.jsonl").read_text().splitlines()[0]
                .replace('"step": 1', '"step": 2') + "\n")  # fmt: skip
    with pytest.raises(AssertionError, match="drawn again"):
        report.write_report(second, figure_cache=cache)  # other rows: drawn


# A tournament whose units sleep instead of training: the SIGTERM path of a kind other than
# train (the runner's _run_other), at the cost of the CLI's imports.
_FAKE_TOURNAMENT = textwrap.dedent(
    """
    import sys, time
    from precisionlab.experiments import _tournament as tournament

    def run_unit(section, unit, unit_dir, include):
        time.sleep(30)  # ended by the signal
        raise AssertionError("not interrupted")

    tournament.run_unit = run_unit
    tournament.linear_sites = lambda cfg: ([0], ["w"])
    from precisionlab.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["term", "hup"])
def test_sigterm_ends_a_tournament_like_ctrl_c(work, sig):
    """The same end for the tournament kind: run.json interrupted, lock released, no unit
    result written for the unit the signal cut short, and --resume named."""
    src = Path(__file__).parents[2] / "experiments" / "fp4_tournament_quick.toml"
    shutil.copy(src, work / "t.toml")
    out = work / "t"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _FAKE_TOURNAMENT, "run", "t.toml", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_hup,
    )  # fmt: skip
    unit = out / "tournament" / "units" / "bf16-s0"
    deadline = time.monotonic() + 600
    while not unit.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + sig, err
    assert err.splitlines()[-1] == f"precisionlab run: terminated ({signal.Signals(sig).name})"
    assert "Traceback" not in err and f"precisionlab run --resume {out}" in err
    assert store.read_json(out / "run.json")["status"] == "interrupted"
    assert store.lock_holder(out) == (str(proc.pid), False)  # released
    assert not (unit / "result.json").exists()
