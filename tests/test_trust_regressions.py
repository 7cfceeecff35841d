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

from precisionlab.experiments import _runner as runner
from precisionlab.experiments import _store as store
from precisionlab.experiments import _train_kind as train_kind

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


def test_a_killed_checkpoint_write_leaves_no_temporary_directory(tmp_path):
    """Why: a checkpoint write killed midway left a .tmp_ckpt_* directory behind for good."""
    from precisionlab.train._checkpoint import list_checkpoints, save_checkpoint

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
    from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

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
    from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

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


# --- 2. special values in every GEMM path ---------------------------------------------------

# format -> (exponent bits, mantissa bits, specials): "fn" (E4M3: only S.1111.111 is NaN),
# "ieee" (E5M2: all-ones exponent is inf or NaN), "none" (FP6, FP4: every code is finite)
_FORMATS = {
    "float8_e4m3fn": (4, 3, "fn"),
    "float8_e5m2": (5, 2, "ieee"),
    "float6_e2m3fn": (2, 3, "none"),
    "float6_e3m2fn": (3, 2, "none"),
    "float4_e2m1fn": (2, 1, "none"),
}


def _by_hand(code: int, ebits: int, mbits: int, specials: str) -> float:
    """The value of ``code`` from its sign, exponent and mantissa fields (bias 2^(e-1) - 1),
    independent of ml_dtypes and of the code under test."""
    sign = -1.0 if code >> (ebits + mbits) & 1 else 1.0
    ef, mf = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    top = (1 << ebits) - 1
    if specials == "ieee" and ef == top:
        return sign * float("inf") if mf == 0 else float("nan")
    if specials == "fn" and ef == top and mf == (1 << mbits) - 1:
        return float("nan")
    bias = (1 << (ebits - 1)) - 1
    if ef == 0:
        return sign * mf * 2.0 ** (1 - bias - mbits)
    return sign * (1 + mf / (1 << mbits)) * 2.0 ** (ef - bias)


def _all_codes(fmt: str) -> tuple[np.ndarray, np.ndarray, str]:
    """(every code of ``fmt`` as a (codes, 32) uint8 matrix with the code in column 0 and
    zeros elsewhere, the hand-decoded values, the device whose GEMM takes the format against
    float8_e4m3fn ones)."""
    ebits, mbits, specials = _FORMATS[fmt]
    n = 1 << (1 + ebits + mbits)
    a = np.zeros((n, 32), np.uint8)
    a[:, 0] = np.arange(n)
    want = np.array([_by_hand(c, ebits, mbits, specials) for c in range(n)], np.float32)
    return a, want, "h100" if fmt.startswith("float8") else "b200"


def _same(got, want) -> bool:
    got, want = np.asarray(got, np.float32).ravel(), np.asarray(want, np.float32).ravel()
    return bool(np.array_equal(np.isnan(got), np.isnan(want)) and
                np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)]))  # fmt: skip


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_every_code_of_every_format_decodes_as_its_value(fmt):
    """Why: gemm(..., a_format="float8_e4m3fn") on uint8 codes read NaN (0x7F) as 480 and
    E5M2 +inf (0x7C) as 65536. Every code of every format, as a (uint8 and uint16) or b, through
    gemm, jit(gemm), vmap(gemm) (the recipes' path), dot_general and mma (FP8), gives the
    code's value times 1: NaN, inf, zeros and subnormals included."""
    import jax
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    a, want, device = _all_codes(fmt)
    ones = jnp.ones((32, 1), jnp.float8_e4m3fn)
    got = hw.gemm(a, ones, device=device, a_format=fmt)
    assert _same(got[:, 0], want), fmt
    assert _same(hw.gemm(a.astype(np.uint16), ones, device=device, a_format=fmt)[:, 0], want)
    got_b = hw.gemm(ones.T, a.T, device=device, b_format=fmt)  # the codes as b
    assert _same(got_b[0], want)
    jitted = jax.jit(lambda x: hw.gemm(x, ones, device=device, a_format=fmt))(a)
    assert _same(jitted[:, 0], want)
    mapped = jax.vmap(lambda x: hw.gemm(x[None], ones, device=device, a_format=fmt))(a)
    assert _same(mapped[:, 0, 0], want)
    dn = (((1,), (0,)), ((), ()))
    assert _same(hw.dot_general(a, ones, dn, device=device, a_format=fmt)[:, 0], want)
    if fmt.startswith("float8"):
        zero = jnp.zeros((a.shape[0], 1), jnp.float32)
        assert _same(hw.mma(a, ones, zero, a_format=fmt)[:, 0], want)
        # and the float8 arrays of the same codes agree with the codes, bit for bit
        typed = jnp.asarray(a).view(jnp.dtype(fmt))
        assert _same(hw.gemm(typed, ones)[:, 0], want)


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_out_of_range_codes_raise_or_poison(fmt):
    """Why: out-of-range codes were masked to the format's width (FP6 0x41 computed as 0x01;
    a uint16 code 0x1FF as 0xFF). Now a ValueError; under jit (no value yet) NaN outputs in
    the code's row only."""
    import jax
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    width = 1 + sum(_FORMATS[fmt][:2])
    device = "h100" if fmt.startswith("float8") else "b200"
    ones = jnp.ones((32, 1), jnp.float8_e4m3fn)
    a = np.zeros((2, 32), np.uint16)
    a[0, 0] = 1 << width  # one past the last code (0x100 for FP8: needs uint16)
    a[1, 0] = 1
    dtype = np.uint8 if width < 8 else np.uint16
    calls = [
        lambda: hw.gemm(a.astype(dtype), ones, device=device, a_format=fmt),
        lambda: hw.gemm(ones.T, a.T.astype(dtype), device=device, b_format=fmt),
        lambda: hw.dot_general(a.astype(dtype), ones, (((1,), (0,)), ((), ())), device=device,
                               a_format=fmt),
    ]  # fmt: skip
    if fmt.startswith("float8"):
        calls.append(lambda: hw.mma(a, ones, jnp.zeros((2, 1), jnp.float32), a_format=fmt))
    for call in calls:
        with pytest.raises(ValueError, match=f"out of {fmt}'s range"):
            call()
    traced = jax.jit(lambda x: hw.gemm(x, ones, device=device, a_format=fmt))(a.astype(dtype))
    assert np.isnan(traced[0, 0]) and traced[1, 0] == _by_hand(1, *_FORMATS[fmt])


def test_the_inf_nan_outcome_does_not_depend_on_the_cpus_summation_order():
    """Specials came from a float32 matmul on the CPU (its order): three bfloat16 products
    1.5 * 2^127 * (1, 1, -1) in one 16-product step sum exactly to a finite 1.5 * 2^127 on the
    tensor core (the scalar reference), but the CPU's left-to-right sum overflowed and the
    GEMM said inf. Across two steps the float32 accumulator does overflow (inf, the IEEE rule
    for an infinite accumulator). Infinite inputs decide by sign whatever their positions:
    +inf and -inf products give NaN, an infinity times zero NaN."""
    import jax.numpy as jnp

    from precisionlab import hardware as hw
    from precisionlab.hardware._reference import chain_reference

    big = 1.5 * 2.0**127
    one_step = np.zeros((1, 16), np.float32)
    one_step[0, :3] = [big, big, -big]
    a = jnp.asarray(one_step, jnp.bfloat16)
    b = jnp.ones((16, 1), jnp.bfloat16)
    step = hw.get_profile("h100", "16bit").step
    ref = chain_reference(one_step[0].tolist(), [1.0] * 16, 0.0, step, "bfloat16", "bfloat16")
    assert ref == big
    assert float(hw.gemm(a, b)[0, 0]) == big
    two_steps = np.zeros((1, 32), np.float32)
    two_steps[0, [0, 1, 16]] = [big, big, -big]  # the overflow happens in the first step
    assert (
        float(hw.gemm(jnp.asarray(two_steps, jnp.bfloat16), jnp.ones((32, 1), jnp.bfloat16))[0, 0])
        == np.inf
    )
    for where in ((0, 1), (0, 31), (30, 2)):
        x = np.zeros((1, 32), np.float32)
        x[0, list(where)] = [np.inf, -np.inf]
        out = hw.gemm(jnp.asarray(x, jnp.bfloat16), jnp.ones((32, 1), jnp.bfloat16))
        assert np.isnan(out[0, 0]), where
    x = np.zeros((1, 32), np.float32)
    x[0, 5] = np.inf
    y = np.ones((32, 2), np.float32)
    y[5, 1] = 0.0
    out = hw.gemm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16))
    assert out[0, 0] == np.inf and np.isnan(out[0, 1])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), products=2**30), "GiB"),
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), split_k=2**40,
                                 split_k_min_k=0), "GiB"),
        (lambda hw, jnp: hw.gemm(jnp.ones((4, 32), jnp.float8_e4m3fn),
                                 jnp.ones((32, 4), jnp.float8_e4m3fn), restart_every=2**40),
         "GiB"),
        (lambda hw, jnp: hw.dot_general(jnp.ones((2, 3), jnp.float16), jnp.ones((3, 2),
                                        jnp.float16), (([5], [0]), ([], []))), "in 0..1"),
        (lambda hw, jnp: hw.dot_general(jnp.ones((2, 0), jnp.float16), jnp.ones((0, 2),
                                        jnp.float16), (([1], [0]), ([], []))), "K >= 1"),
        (lambda hw, jnp: hw.gemm(jnp.ones((2, 0), jnp.float16), jnp.ones((0, 2), jnp.float16)),
         "K >= 1"),
    ],
    ids=["products", "split_k", "restart_every", "axis", "dot-k0", "gemm-k0"],
)  # fmt: skip
def test_gemm_sizes_and_overrides_are_bounded(call, message):
    """Why: huge products/restart_every/split_k overrides ran out of memory or raised
    OverflowError inside XLA; dot_general raised IndexError / ZeroDivisionError for an
    out-of-range axis or K = 0."""
    import jax.numpy as jnp

    from precisionlab import hardware as hw

    with pytest.raises(ValueError, match=message):
        call(hw, jnp)


# --- 3. every read bounded and checked ------------------------------------------------------


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


_MEM = Path(__file__).resolve().parent.parent / "experiments" / "memory.toml"


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


# --- 5. reports a first reader understands --------------------------------------------------


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


def _summary_with(**unit) -> dict:
    ref = {"id": "00-fp32", "name": "range/fp32", "setting": "range", "variant": "fp32",
           "status": "finished", "eval_loss": 1.3, "steps": 300}  # fmt: skip
    return {"kind": "train", "variants": [ref, {**ref, "id": "01-x", "name": "range/x",
                                                "variant": "x", **unit}]}  # fmt: skip


def test_the_divergence_step_and_the_first_inf_nan_are_explained_side_by_side():
    """Why: telemetry's first inf/NaN at step 1 sat beside "diverged@ 2" in the table with
    nothing explaining why they differ."""
    from precisionlab.experiments._report import interpret

    first = {"kind": "op", "layer": "layer0", "site": "integer_pow[0]", "tensor": "out",
             "step": 1, "n_inf": 5, "n_nan": 0, "n": 8, "backward": False}  # fmt: skip
    text = "\n".join(interpret(_summary_with(
        diverged=True, divergence_step=2, eval_loss=float("nan"),
        telemetry={"steps": [1], "targets": [], "first_nonfinite": first},
    )))  # fmt: skip
    assert "diverged at step 2; inf/NaN first appeared inside step 1 (forward pass, " in text
    assert "`layer0:integer_pow[0].out`) while that step's loss stayed finite" in text


def test_the_meters_separate_inf_nan_from_underflow():
    """Why: an "underflow meter 83%" that was mostly NaNs. The train step's meters count zeros
    and subnormals (underflow_fraction) apart from inf/NaN (nonfinite_fraction), and the
    report says each."""
    import jax.numpy as jnp

    from precisionlab.experiments._report import interpret
    from precisionlab.train import nonfinite_fraction, underflow_fraction

    g = {"w": jnp.array([jnp.nan, jnp.inf, 0.0, 1e-6, 1.0, 2.0, jnp.nan, 3.0])}
    assert float(underflow_fraction(g, jnp.float16, nonfinite=False)) == 2 / 8  # 0 and 1e-6
    assert float(nonfinite_fraction(g)) == 3 / 8
    assert float(underflow_fraction(g, jnp.float16)) == 5 / 8  # the combined count, as before
    text = "\n".join(interpret(_summary_with(
        mean_underflow_fraction=0.1, mean_nonfinite_fraction=0.75, eval_loss=9.0,
    )))  # fmt: skip
    assert "inf/NaN in 75% of gradient elements" in text and "underflow meter" not in text


def test_what_if_figures_say_they_are_what_ifs(tmp_path):
    """Why: fp16-dynamic listed a what-if fp16 overflow of 100% with no step skipped, without
    saying the figure is what the target format would do, not what the run did."""
    from precisionlab.experiments._telemetry_views import telemetry_report

    entry = {"kind": "op", "layer": "mul[3]", "tensor": "grad", "target": "fp16",
             "fraction": 1.0, "step": 1}  # fmt: skip
    unit = {"id": "00-x", "name": "x", "telemetry": {
        "steps": [1], "targets": ["fp16"], "worst_underflow": [], "worst_overflow": [entry],
    }}  # fmt: skip
    text = "\n".join(telemetry_report(tmp_path, [unit], None))
    assert "What-if overflow: had the tensor been stored in the target format" in text
    assert "What-if: no finite nonzero value would underflow" in text


# --- 7. every second of a run accounted for -------------------------------------------------


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


# --- 4. emulate keeps subnormals on the CPU -------------------------------------------------


def _bf16_pairs(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random bfloat16 codes: a third subnormal or zero, a third near 2^-126, the rest wide."""
    import ml_dtypes

    rng = np.random.default_rng(seed)

    def codes():
        sub = rng.integers(0, 0x80, n) | (rng.integers(0, 2, n) << 15)
        near = rng.integers(0x0080, 0x0400, n) | (rng.integers(0, 2, n) << 15)
        wide = rng.integers(0, 0x7F80, n) | (rng.integers(0, 2, n) << 15)
        pick = rng.integers(0, 3, n)
        return np.choose(pick, [sub, near, wide]).astype(np.uint16).view(ml_dtypes.bfloat16)

    return codes(), codes()


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div"])
def test_emulate_bf16_arithmetic_keeps_subnormals(op):
    """Why: XLA on the CPU flushes float32 subnormals, which bfloat16's are: emulate's
    bfloat16 + - * / lost subnormal operands and results an H100 keeps. Against float64 numpy
    rounded once to bfloat16 by ml_dtypes (IEEE with subnormals; 53 >= 2 * 8 + 2 bits, so the
    two roundings are one), on 3,000 pairs of which a third are subnormal or zero."""
    import operator

    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import emulate

    fn = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
          "div": operator.truediv}[op]  # fmt: skip
    a, b = _bf16_pairs(3000, seed=len(op))
    with np.errstate(all="ignore"):
        want = fn(a.astype(np.float64), b.astype(np.float64)).astype(ml_dtypes.bfloat16)
    got = np.asarray(emulate(fn, "c=bf16")(jnp.asarray(a), jnp.asarray(b)))
    wv, gv = want.view(np.uint16), got.view(np.uint16)
    same = (wv == gv) | (np.isnan(want.astype(np.float32)) & np.isnan(got.astype(np.float32)))
    assert same.all(), (a[~same][:5], b[~same][:5], want[~same][:5], got[~same][:5])
    sub = (wv & 0x7F80) == 0
    assert (sub & (wv & 0x7F != 0)).sum() > 20  # subnormal results were tested


def test_emulate_exp_ratio_in_bf16_keeps_its_subnormals():
    """Why: on a held-out H100 capture of ``exp(x) / exp(x)`` in bfloat16, 79 of 8,192
    outputs were NaN (0/0) under emulate where the H100 gives 1.0: exp(x) is subnormal there.
    Against float64 numpy and ml_dtypes (exp correctly rounded to bfloat16, then the
    quotient): 1.0 wherever exp(x) is a nonzero subnormal, NaN only where it is 0."""
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import emulate

    x = np.arange(-100.0, -80.0, 0.0625).astype(ml_dtypes.bfloat16)
    e = np.exp(x.astype(np.float64)).astype(ml_dtypes.bfloat16)
    with np.errstate(all="ignore"):
        want = (e.astype(np.float64) / e.astype(np.float64)).astype(ml_dtypes.bfloat16)
    got = np.asarray(emulate(lambda v: jnp.exp(v) / jnp.exp(v), "c=bf16")(jnp.asarray(x)))
    sub = (e.view(np.uint16) & 0x7F80) == 0
    assert sub.sum() > 20 and np.isnan(want.astype(np.float32)).sum() > 0
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))


def test_emulate_check_names_the_operations_with_subnormal_results():
    """Where bit-exactness cannot be promised (an operation other than bfloat16 + - * / that
    reads a subnormal), emulate.check names the operations whose results are subnormal."""
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.emulate import check

    x = jnp.asarray(np.array([-90.0, -1.0, 0.5], ml_dtypes.bfloat16))
    report = check(lambda v: jnp.exp(v) / jnp.exp(v), "c=bf16", x)
    names = [o.name for o in report.subnormal]
    assert names and all(n.startswith("exp") for n in names), names
    assert "subnormal results (below 2^-126, which this CPU flushes) in exp" in report.text()


# --- 6. the same numbers on any machine, or the reason --------------------------------------

_CORES = textwrap.dedent(
    """
    import os, sys, hashlib
    if sys.argv[2] != "all":  # before JAX starts: the cores XLA may split a sum over
        os.sched_setaffinity(0, {int(sys.argv[2])})
    import jax, jax.numpy as jnp, numpy as np
    from precisionlab.train._deterministic import fixed_order
    a = jnp.asarray(np.random.default_rng(0).standard_normal((512, 2048)).astype(np.float32))
    w = jnp.asarray(np.random.default_rng(1).standard_normal((2048, 8)).astype(np.float32))
    f = lambda a, w: (jnp.sum(a), jnp.mean(a, axis=0), a @ w)
    fn = fixed_order(f) if sys.argv[1] == "fixed" else f
    print(hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.jit(fn)(a, w))).hexdigest())
    """
)


def _digest(mode: str, cores: str | None) -> str:
    argv = [sys.executable, "-c", _CORES, mode, "all" if cores is None else cores]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip()


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2,
    reason="compares a sum on one core with the same sum on two, and this process may use "
    "only one core",
)
def test_fixed_order_gives_the_same_bits_on_one_core_and_on_two():
    """Why: the main job's numbers differed between two CPUs with the same jax. One cause
    reproduces on this machine: XLA splits a large sum over the cores the process may use, so
    jnp.sum's last bits change with the core count. The fixed order does not."""
    assert _digest("plain", "0") != _digest("plain", None)  # what the fixed order fixes
    assert _digest("fixed", "0") == _digest("fixed", None)


def _pairwise(t: np.ndarray) -> np.ndarray:
    """numpy reference of the fixed order: zero-pad the last axis to a power of two, halve."""
    k = t.shape[-1]
    width = 1 << max(0, (k - 1).bit_length())
    t = np.concatenate([t, np.zeros((*t.shape[:-1], width - k), t.dtype)], axis=-1)
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


def test_the_fixed_order_is_the_documented_one():
    """pairwise_dot and pairwise_sum against a numpy float32 reimplementation of the order
    (bit for bit), with a batch axis, an odd K and a bfloat16 matmul rounded once."""
    import jax.numpy as jnp
    import ml_dtypes

    from precisionlab.train._deterministic import pairwise_dot, pairwise_sum

    rng = np.random.default_rng(3)
    a = rng.standard_normal((2, 5, 37)).astype(np.float32)
    b = rng.standard_normal((2, 37, 3)).astype(np.float32)
    got = pairwise_dot(jnp.asarray(a), jnp.asarray(b), (((2,), (1,)), ((0,), (0,))), jnp.float32)
    want = _pairwise(np.moveaxis(a[:, :, :, None] * b[:, None, :, :], 2, -1))
    np.testing.assert_array_equal(np.asarray(got), want)
    x = rng.standard_normal((6, 19, 4)).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(pairwise_sum(jnp.asarray(x), (0, 2))),
        _pairwise(np.transpose(x, (1, 0, 2)).reshape(19, -1)),
    )
    a16, b16 = a[0].astype(ml_dtypes.bfloat16), b[0].astype(ml_dtypes.bfloat16)
    got16 = pairwise_dot(jnp.asarray(a16), jnp.asarray(b16), (((1,), (0,)), ((), ())),
                         jnp.bfloat16)  # fmt: skip
    wide = a16.astype(np.float32)[:, :, None] * b16.astype(np.float32)[None, :, :]
    want16 = _pairwise(np.moveaxis(wide, 1, -1)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(got16).view(np.uint16), want16.view(np.uint16))


def test_a_deterministic_run_records_the_cpu_and_trains(work, cli):
    """`run --deterministic` sets train.deterministic, trains through the fixed order (its
    losses are finite and close to the plain run's) and records the CPU's instruction set,
    the usable cores and XLA's version and flags in environment.json."""
    (work / "d.toml").write_text(TINY.format(steps=3).replace(
        "[[variant]]\nname = \"b\"\n", "") + "telemetry = { enabled = false }\n")  # fmt: skip
    base = ["run", "d.toml", "--quiet", "--no-report", "--no-cache"]
    cli([*base, "--out", "plain"], status=0, limit_s=600)  # compiles: slow on a loaded machine
    cli([*base, "--out", "fixed", "--deterministic"], status=0, limit_s=600)
    config = store.read_json(work / "fixed" / "config.json")
    assert config["resolved"]["units"][0]["params"]["deterministic"] is True
    env = store.read_json(work / "fixed" / "environment.json")
    assert env["cpu"]["cores_usable"] >= 1 and env["xla"]["jaxlib"]
    if env["cpu"]["machine"] in ("x86_64", "AMD64"):
        assert "sse4_2" in env["cpu"]["isa"]
    rows = {d: store.read_jsonl(work / d / "variants" / "00-a" / "metrics.jsonl")
            for d in ("plain", "fixed")}  # fmt: skip
    for p, f in zip(rows["plain"], rows["fixed"], strict=True):
        assert np.isfinite(f["loss"]) and f["loss"] == pytest.approx(p["loss"], rel=1e-5)
    _, err = cli(["run", "--resume", "fixed", "--deterministic"])
    assert "--deterministic and --forecast apply to a new run" in err


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
    src = Path(__file__).parents[1] / "experiments" / "fp4_tournament_quick.toml"
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
