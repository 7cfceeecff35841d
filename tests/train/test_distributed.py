"""Multi-process training (``precisionlab run --coordinator ... --num-processes 2``).

Two local CPU processes with 2 devices each train like one process with 4 devices: the same
global batches, split the same way over the 4 devices. The losses are not bit for bit the same:
gloo's all-reduce adds the 4 devices' gradients and losses in another order than XLA's
in-process all-reduce, so each step's mean differs by the rounding of a 4-term float32 sum
(at most 3 ulps of the terms' magnitude; measured: 1 ulp of the loss on some steps), and
the parameters drift apart by such roundings. The tolerance below (relative 1e-5 on the
losses of a few steps) is that rounding with a margin for its growth over the steps; a wrong
data split or a missing all-reduce changes the loss in the second or third digit.

Every process is a subprocess (the device count and the distributed runtime are per process).
Ports come from the OS (bind to port 0); process 1 runs in its own empty directory and is given
the same relative ``--out``, so anything it wrote would show there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from precisionlab.cli import main

TINY = """
kind = "train"
name = "tiny"
[train]
model = "mlp"
data = "teacher"
optimizer = "adam"
lr = 1e-2
steps = {steps}
batch_size = 16
eval_batches = 1
checkpoint_interval = {ckpt}
progress = false
model_kwargs = {{ width = 16, depth = 1 }}
[[variant]]
name = "fp32"
policy = "p=f32,c=f32,o=f32"
"""

# Two settings whose names are not in sorted order: the other processes must train the units
# in process 0's order (a plan sent with sorted keys once swapped them).
SETTINGS = """
[settings.wide]
model_kwargs = { width = 16 }
[settings.narrow]
model_kwargs = { width = 8 }
"""

#: relative tolerance on the per-step losses (see the module docstring)
RTOL = 1e-5
DIST_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def _free_port() -> int:
    """A port the OS reports free, probed as the coordinator binds it (``[::]:PORT``, which
    covers IPv4 too on Linux); another program could still take it before the run does."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:  # no IPv6
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "precisionlab", "run", *args]


def _start_pair(
    tmp: Path, args: list[str], *, timeout: int
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Processes 0 and 1 of a 2-process run (2 devices each), each in its own directory."""
    port = _free_port()
    procs, dirs = [], []
    for i in (0, 1):
        cwd = tmp / f"p{i}"
        cwd.mkdir(exist_ok=True)
        dist = ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
        dist += ["--process-id", str(i), "--timeout", str(timeout)]
        procs.append(
            subprocess.Popen(
                _run_cmd(*args, *dist),
                cwd=cwd,
                env=_env(2),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        dirs.append(cwd)
    return procs, dirs


def _losses(run_dir: Path) -> list[tuple[str, int, float]]:
    """(unit, step, loss) of every step of every unit."""
    out = []
    for unit in sorted((run_dir / "variants").iterdir()):
        rows = [json.loads(x) for x in (unit / "metrics.jsonl").open()]
        out += [(unit.name, r["step"], r["loss"]) for r in rows]
    return out


def _reference(tmp: Path, config: Path, steps: int) -> subprocess.Popen:
    """The single-process run on 4 devices, data parallel (started, not waited for)."""
    out = tmp / "ref"
    args = [str(config), "--out", str(out), "--set", "train.data_parallel=true"]
    args += ["--set", f"train.steps={steps}", "--no-report", "--quiet"]
    return subprocess.Popen(
        _run_cmd(*args), env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _close(losses: list, ref: list) -> None:
    assert [x[:2] for x in losses] == [x[:2] for x in ref]
    for (unit, step, a), (_, _, b) in zip(losses, ref, strict=True):
        assert abs(a - b) <= RTOL * abs(b), (unit, step, a, b)


@pytest.mark.slow  # about 50 s on 2 loaded cores: 3 processes start JAX and compile
def test_two_processes_train_like_one_with_four_devices(tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(steps=4, ckpt=2) + SETTINGS)
    ref = _reference(tmp_path, config, 4)
    procs, dirs = _start_pair(tmp_path, [str(config), "--out", "run", "--no-report"], timeout=60)
    outs = [p.communicate(timeout=300) for p in procs]
    ref_out = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_out[1][-2000:]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "[Gloo]" not in out, err[-3000:]
    run = dirs[0] / "run"
    env = json.loads((run / "environment.json").read_text())
    assert (env["process_count"], env["device_count"]) == (2, 4)
    assert json.loads((run / "run.json").read_text())["status"] == "finished"
    units = sorted(p.name for p in (run / "variants").iterdir())
    assert units == ["00-wide-fp32", "01-narrow-fp32"]
    assert all((run / "variants" / u / "checkpoints/step_00000004").is_dir() for u in units)
    # process 1 wrote nothing and printed no result
    assert sorted(p.name for p in dirs[1].iterdir()) == []
    assert outs[1][0] == ""
    assert outs[0][0].strip() == str(run.relative_to(dirs[0]))
    _close(_losses(run), _losses(tmp_path / "ref"))


@pytest.mark.slow  # about 45 s on 2 loaded cores
def test_a_killed_process_fails_the_run_cleanly(tmp_path):
    timeout = 5
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(steps=100000, ckpt=5))
    procs, dirs = _start_pair(tmp_path, [str(config), "--out", "run", "--quiet"], timeout=timeout)
    metrics = dirs[0] / "run/variants/00-fp32/metrics.jsonl"
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 10):
            assert time.monotonic() < deadline, "the run did not start"
            assert procs[0].poll() is None, procs[0].communicate()[1][-3000:]
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)  # the command a user started, not its child
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=timeout + 60)
        took = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 1
    lines = err.splitlines()
    assert lines[-1].startswith("precisionlab run: error: process 0 of 2 stopped: another process")
    assert "--resume run" in lines[-1]
    # one error line: none of the runtime's multi-line abort report
    assert sum("error" in x.lower() for x in lines) == 1, err
    assert "Traceback" not in err and "Check failure" not in err
    assert took < timeout + 30, took  # the heartbeat timeout, plus a loaded machine's slack
    log = Path(lines[-1].rsplit("(log: ", 1)[1].rstrip(")"))
    assert "detected fatal errors" in log.read_text()
    log.unlink()
    # the run is resumable: its unit is still running, with a checkpoint
    status = json.loads((dirs[0] / "run/variants/00-fp32/status.json").read_text())
    assert status["status"] == "running"
    assert list((dirs[0] / "run/variants/00-fp32/checkpoints").glob("step_*"))


@pytest.mark.slow
def test_a_killed_run_resumes_to_the_single_process_result(tmp_path):
    """Kill process 1 after the first checkpoints, resume both: the losses equal the
    uninterrupted single-process 4-device run's (within RTOL), with no step missing."""
    steps = 40
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(steps=steps, ckpt=5))
    procs, dirs = _start_pair(tmp_path, [str(config), "--out", "run", "--quiet"], timeout=5)
    ckpts = dirs[0] / "run/variants/00-fp32/checkpoints"
    try:
        deadline = time.monotonic() + 240
        while len(list(ckpts.glob("step_*"))) < 2:
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.05)
        procs[1].kill()
        _, err = procs[0].communicate(timeout=120)
        Path(err.splitlines()[-1].rsplit("(log: ", 1)[1].rstrip(")")).unlink()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 1
    run = dirs[0] / "run"
    assert len(_losses(run)) < steps
    ref = _reference(tmp_path, config, steps)
    again, _ = _start_pair(tmp_path, ["--resume", str(run), "--no-report"], timeout=60)
    outs = [p.communicate(timeout=300) for p in again]
    assert all(p.returncode == 0 for p in again), outs
    assert ref.wait(timeout=300) == 0
    assert json.loads((run / "run.json").read_text())["resumed"] == 1
    _close(_losses(run), _losses(tmp_path / "ref"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
        (["--coordinator", "h:70000", "--num-processes", "2", "--process-id", "0"], "1..65535"),
        (["--coordinator", "h:1", "--num-processes", "2"], "missing: --process-id"),
        (["--num-processes", "2", "--process-id", "0"], "missing: --coordinator"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "in [0, 1]"),
        (["--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"], ">= 1"),
        (["--coordinator", "h:1", "--num-processes", "x", "--process-id", "0"], "integer"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "-1"], "in [0, 1]"),
        (
            ["--coordinator", "h:1", "--num-processes", "1", "--process-id", "0", "--timeout", "0"],
            "--timeout must be an int >= 1",
        ),
    ],
)
def test_bad_distributed_flags_are_one_line(args, message, capsys, monkeypatch, tmp_path):
    for key in DIST_ENV:
        monkeypatch.delenv(key, raising=False)
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.format(steps=1, ckpt=0))
    assert main(["run", str(config), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("precisionlab run: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "runs").exists()


def test_partial_environment_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert main(["run", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "missing: --num-processes" in err


def test_the_supervisor_passes_output_and_holds_back_the_runtimes(tmp_path):
    """The pump of a child's stream: the child's own lines pass, gloo's notices and the
    runtime's log lines do not, and a fatal report mutes the rest and is noticed."""
    import collections
    import io

    from precisionlab.cli._supervise import _Pump

    stream = [
        "process 0 of 2 joined the run at localhost:1\n",
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks\n",
        "process 0: run directory: runs/x\n",
        "[1/2] fp32\n",
        "E1123 00:02:16.375842   30968 coordination_service_agent.cc:289] Polled an error\n",
        "1\n",  # continuation lines of the runtime's message
        "The tasks have crashed.\n",
        "F1123 00:02:16.375985   30968 client.h:80] Terminating process because the JAX "
        "distributed service detected fatal errors.\n",
        "    @     0x7fc375440634  absl::log_internal::LogMessage::SendToLog()\n",
    ]
    sink, log = io.StringIO(), collections.deque()
    pump = _Pump(io.BytesIO("".join(stream).encode()), sink, log)
    pump.run()
    assert sink.getvalue().splitlines() == [
        "process 0 of 2 joined the run at localhost:1",
        "process 0: run directory: runs/x",
        "[1/2] fp32",
    ]
    assert pump.fatal and pump.joined and pump.run_dir == "runs/x"
    assert list(log) == stream  # everything is kept for the log file
    quiet = _Pump(io.BytesIO(b"[1/1] fp32\nW0000 00:00:00.1 1 x.cc:1] note\n"), io.StringIO(), log)
    quiet.run()
    assert not quiet.fatal and not quiet.joined and quiet.run_dir is None


def test_the_child_gets_the_same_arguments():
    import argparse

    from precisionlab.cli import _run_cmd as run_cmd
    from precisionlab.cli._supervise import _child_argv

    parser = argparse.ArgumentParser()
    run_cmd.add_arguments(parser)
    argv = ["x.toml", "--out", "o", "--set", "train.steps=2", "--set", "seed=1", "--quiet"]
    argv += ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "1"]
    args = parser.parse_args(argv)
    spec = run_cmd.distributed_spec(args)
    assert spec == ("h:1", 2, 1, 60)
    child = _child_argv(args, spec)
    assert child[:4] == [sys.executable, "-m", "precisionlab", "run"]
    again = parser.parse_args(child[4:])
    assert vars(again) == {**vars(args), "timeout": "60"}


BROADCAST = """
import json, sys
import ml_dtypes, numpy as np
from precisionlab.train import _distributed as distributed, save_checkpoint

port, index, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
distributed.initialize(f"localhost:{port}", 2, index, timeout_s=60)
main = distributed.is_main()
# process 0's values; the other process holds different ones of the same shapes
bf16 = ml_dtypes.bfloat16
tree = {
    "z": np.array([-0.0, np.nan, np.inf, 1e-45], np.float32) if main else np.ones(4, np.float32),
    "b": np.array([1.5, -0.0, 3.0], bf16) if main else np.zeros(3, bf16),
    "k": np.array([7, 2**31 + 5], np.uint32) if main else np.zeros(2, np.uint32),
    "f": np.array([True, False, True]) if main else np.zeros(3, bool),
}
got = distributed.broadcast_tree(tree)
plan = {"zeta": 1, "alpha": [2.5, "x"], "mid": None} if main else None
got_plan = distributed.broadcast_json(plan)
template = {"w": np.zeros(5, np.float32), "n": np.zeros((), np.int32)}
if main:
    state = {"w": np.array([-0.0, 1, 2, 3, 4], np.float32), "n": np.int32(9)}
    save_checkpoint(ckpt, state, step=3, extra={"a": 1})
restored = distributed.restore_checkpoint(ckpt if main else ckpt + "-absent", template)
# a state holding NaN placed on both processes' devices (device_put's check would refuse it)
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
mesh = Mesh(np.asarray(jax.devices()), ("d",))
nan = np.array([np.nan, -0.0], np.float32)
placed = distributed.place({"x": nan}, NamedSharding(mesh, PartitionSpec()))
placed = {"x": np.asarray(placed["x"])}
hexes = lambda t: {k: [v.dtype.name, v.tobytes().hex()] for k, v in t.items()}
print("RESULT", json.dumps([hexes(got), list(got_plan), got_plan, hexes(restored[0]),
                            list(restored[1:]), hexes(placed)]))
"""


def test_broadcasts_are_bit_exact_and_keep_key_order(tmp_path):
    """Two processes (1 device each): process 0's pytree (-0.0, NaN, bfloat16, uint32 above
    2^31, bool), JSON plan (keys in their order) and checkpoint reach process 1 bit for bit;
    process 1 reads no file (it is given a directory that does not exist); a state holding NaN
    is placed on both processes' devices."""
    port = _free_port()
    env = _env(1)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BROADCAST, str(port), str(i), str(tmp_path / "ckpt")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    results = [next(x for x in o.splitlines() if x.startswith("RESULT ")) for o, _ in outs]
    assert results[0] == results[1]
    got, keys, plan, restored, meta, placed = json.loads(results[1][len("RESULT ") :])
    assert placed["x"] == ["float32", "0000c07f" + "00000080"]
    assert keys == ["zeta", "alpha", "mid"] and plan["alpha"] == [2.5, "x"]
    # little-endian bytes: -0.0, the default NaN, inf, the smallest subnormal
    assert got["z"] == ["float32", "00000080" + "0000c07f" + "0000807f" + "01000000"]
    assert got["k"] == ["uint32", "07000000" + "05000080"]
    assert got["f"] == ["bool", "010001"]
    assert got["b"] == ["bfloat16", "c03f" + "0080" + "4040"]  # 1.5, -0.0, 3.0
    assert restored["w"][1].startswith("00000080") and restored["n"] == ["int32", "09000000"]
    assert meta == [3, {"a": 1}]


@pytest.mark.slow  # about 20 s: two processes start JAX
def test_other_kinds_are_refused_by_every_process(tmp_path):
    config = tmp_path / "survey.toml"
    config.write_text('kind = "survey"\n[survey]\nformats = ["bf16"]\nsize = 64\n')
    procs, dirs = _start_pair(tmp_path, [str(config), "--out", "run", "--quiet"], timeout=60)
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, err
        assert err.splitlines()[-1].startswith("precisionlab run: error: several processes run")
    assert sorted(p.name for p in dirs[1].iterdir()) == []
