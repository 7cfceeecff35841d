"""Trust, fourth pass (issue 39): one test per reproducer of the issue's "Why", each failing on
the code before it (commit 5cf8b73) and passing now. The runs here train nothing: a stand-in
trainer (``_FAKE_TRAINER``) writes rows like the real one, so a case costs the CLI's imports,
not XLA's compilations."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from precisionlab.experiments import runner, store, train_kind

DATA = Path(__file__).parent / "data" / "run_tiny"

TINY = """
kind = "train"
name = "tiny"
[train]
model = "mlp"
steps = {steps}
batch_size = 8
model_kwargs = {{ width = 8, depth = 2 }}
[[variant]]
name = "a"
[[variant]]
name = "b"
"""

# A subprocess running `precisionlab ARGV` with train_kind.run_unit replaced by a stand-in that
# writes one metrics row per step, sleeping PRECISIONLAB_TEST_STEP_S between steps.
_FAKE_TRAINER = textwrap.dedent(
    """
    import os, sys, time
    from precisionlab.experiments import train_kind

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


def _fake_cli(args: list[str], *, step_s: float = 0.0, **kw) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PRECISIONLAB_TEST_STEP_S": str(step_s)}
    return subprocess.Popen(
        [sys.executable, "-c", _FAKE_TRAINER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
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


@pytest.fixture
def work(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRECISIONLAB_DEBUG", raising=False)
    (tmp_path / "s2.toml").write_text(TINY.format(steps=2))
    (tmp_path / "s5.toml").write_text(TINY.format(steps=5))
    return tmp_path


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` but the lock (taken, then released, by a refused run)."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".lock")
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


# --- 1. results belong to their run ---------------------------------------------------------


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
            from precisionlab.experiments import store
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
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
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
    deadline = time.monotonic() + 60
    while not store.read_jsonl(metrics) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
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
    cli(["report", str(run_dir), "--no-plots"], status=0)
    text = (run_dir / "report.md").read_text()
    assert f"its process {dead} has ended" in text and "--resume" in text
    _, err = cli(["run", "s2.toml", "--quiet", "--no-report"])
    assert str(run_dir) in err and "--resume" in err and "--force" in err
    assert f"left running by process {dead}" in err
    assert os.listdir("runs") == [run_dir.name]  # nothing started beside it
    _, err = cli(["run", "--resume", str(run_dir), "--no-report"], status=0)
    assert f"left running by process {dead}, which has ended" in err
    assert store.read_json(run_dir / "run.json")["killed"] == [dead]
    # an interrupted run is named too; --force starts a new one beside it
    store.write_json(run_dir / "run.json", {**info, "status": "interrupted"})
    _, err = cli(["run", "s2.toml", "--quiet", "--no-report"])
    assert "was interrupted" in err
    cli(["run", "s2.toml", "--quiet", "--no-report", "--force"], status=0)
    assert len(os.listdir("runs")) == 2


def test_a_killed_checkpoint_write_leaves_no_temporary_directory(tmp_path):
    """Why: a checkpoint write killed midway left a .tmp_ckpt_* directory behind for good."""
    from precisionlab.train.checkpoint import list_checkpoints, save_checkpoint

    partial = tmp_path / ".tmp_ckpt_deadbeef"
    partial.mkdir()
    (partial / "arrays.npz").write_bytes(b"PK")
    save_checkpoint(tmp_path, {"w": np.arange(3.0)}, step=4)
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]


def test_a_fifo_for_a_checkpoint_array_file_is_an_error_not_a_hang(tmp_path):
    """Why: a FIFO in place of a checkpoint's arrays.npz made `run --resume` hang for ever
    (np.load opened it directly, not through precisionlab._io)."""
    from precisionlab import _io
    from precisionlab.train.checkpoint import load_checkpoint, save_checkpoint

    state = {"w": np.arange(3.0, dtype=np.float32)}
    path = save_checkpoint(tmp_path, state, step=1)
    (path / "arrays.npz").unlink()
    os.mkfifo(path / "arrays.npz")
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_catch(lambda: load_checkpoint(tmp_path, state))),
        daemon=True,
    )
    thread.start()
    thread.join(20)
    assert result, "load_checkpoint hung on a FIFO"
    assert isinstance(result[0], _io.UnsafePathError) and "is a FIFO" in str(result[0])


def test_a_checkpoint_array_file_larger_than_its_arrays_is_refused(tmp_path):
    from precisionlab import _io
    from precisionlab.train.checkpoint import load_checkpoint, save_checkpoint

    state = {"w": np.arange(3.0, dtype=np.float32)}
    path = save_checkpoint(tmp_path, state, step=1)
    with open(path / "arrays.npz", "ab") as f:
        f.write(b"\0" * (1 << 20))
    with pytest.raises(_io.UnsafePathError, match="larger than"):
        load_checkpoint(tmp_path, state)
    (path / "arrays.npz").write_bytes(b"not a zip")
    with pytest.raises(_io.DamagedFileError, match="damaged checkpoint"):
        load_checkpoint(tmp_path, state)
    got, step, _ = load_checkpoint(save_checkpoint(tmp_path, state, step=2), state)
    assert step == 2 and got["w"].tolist() == [0.0, 1.0, 2.0]


def _catch(fn):
    try:
        return fn()
    except Exception as err:  # the test inspects it
        return err
