"""Hostile input to the commands added in the second wave (diagnose, memory --measure/--recipe,
run's multi-process flags and new [train] keys, experiment and survey files): each case is one
line ``precisionlab CMD: error: ...`` naming the bad value, exit status 2, no traceback, and it
answers before any training starts. Found by ``tools/hostile_sweep.py`` (a subprocess sweep);
run here in-process, so the whole file takes a few seconds."""

from __future__ import annotations

import os

import pytest
from _tiny_runs import ONE

# the tiny experiment with a second, float16 variant
TINY = ONE + '[[variant]]\nname = "b"\npolicy = "p=f32,c=f16"\n'
DIST = ["--num-processes", "2", "--process-id", "0"]
BIG = "9" * 5000  # past Python's 4300-digit limit for str -> int


@pytest.fixture
def work(tmp_path, monkeypatch):
    """cwd = tmp_path holding tiny.toml, a directory, a binary, a UTF-16 and a FIFO file."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PRECISIONLAB_DEBUG", raising=False)
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(key, raising=False)
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "adir.toml").mkdir()
    (tmp_path / "binary.toml").write_bytes(bytes(range(256)))
    (tmp_path / "utf16.toml").write_bytes(TINY.encode("utf-16"))
    (tmp_path / "huge.toml").write_text(TINY + "#" * (4 << 20) + "\n")
    (tmp_path / "longint.toml").write_text(TINY.replace("steps = 2", f"steps = {BIG}"))
    os.mkfifo(tmp_path / "fifo.toml")  # opening it for reading would wait for a writer
    return tmp_path


# --- configuration files: experiment (run, diagnose, memory --measure) and survey ---------------
FILES = {
    "adir.toml": "is a directory",
    "fifo.toml": "not a regular file",
    "/dev/zero": "not a regular file",  # read to the end, it filled the memory
    "binary.toml": "not UTF-8 text (byte 128)",
    "utf16.toml": "not UTF-8 text (byte 0)",
    "huge.toml": "larger than 4 MiB",
    "longint.toml": "Exceeds the limit (4300 digits)",
}
COMMANDS = {
    "run": lambda f: ["run", f, "--quiet", "--no-report"],
    "diagnose": lambda f: ["diagnose", f, "--quiet", "--compare", "a", "b"],
    "memory": lambda f: ["memory", "--measure", f],
    "survey": lambda f: ["survey", "--config", f],
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", FILES)
def test_a_config_that_is_not_a_toml_file_is_one_line(work, cli, command, name):
    _, err = cli(COMMANDS[command](name))
    assert FILES[name] in err and name in err, err
    assert not (work / "runs").exists()


# --- --set values and keys ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        (f"train.steps={BIG}", "--set 'train.steps=999"),
        ("variant.\u00b2.lr=1", "no variant '\u00b2'"),  # isdigit() but not int()
        (f"variant.{BIG}.lr=1", "no variant '999"),
        ("train.model_kwargs.depth=100000000", "depth must be an int <= 65536"),  # hung
        # a string flag was truthy ("no" turned the Hadamard transform on); a huge history
        ('train.recipe={name="nvfp4",hadamard="no"}', "hadamard must be true or false"),
        ('train.recipe={name="delayed",amax_history_len=1000000000000}', "1..65536"),
    ],
)
def test_bad_set_is_one_line(work, cli, override, message):
    _, err = cli(["run", "tiny.toml", "--quiet", "--set", override])
    assert message in err, err
    assert not (work / "runs").exists()


# --- run: multi-process flags -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--coordinator", "h:\u00b2", *DIST], "port must be 1..65535, got '\u00b2'"),
        (["--coordinator", "h:\u0663", *DIST], "port must be 1..65535"),  # int() reads it as 3
        (["--coordinator", "h" * 300 + ":1", *DIST], "at most 253 characters"),  # was looked up
        (
            ["--coordinator", "h:1", "--num-processes", str(2**31), "--process-id", "0"],
            "--num-processes must be an int <= 2147483647",
        ),
        (["--coordinator", "h:1", *DIST, "--timeout", str(2**63)], "--timeout must be an int <="),
    ],
)
def test_bad_process_flags_are_one_line(work, cli, flags, message):
    _, err = cli(["run", "tiny.toml", "--quiet", *flags])
    assert message in err, err


# --- --out --------------------------------------------------------------------------------------
@pytest.mark.parametrize("out", ["", " "])
def test_run_refuses_an_empty_out(work, cli, out):
    _, err = cli(["run", "tiny.toml", "--quiet", "--out", out])
    assert "empty" in err
    assert not (work / "config.json").exists()  # it was a run written into the cwd


@pytest.mark.parametrize("out", ["", "full", "afile"])
def test_diagnose_out_is_a_new_or_empty_directory(work, cli, out):
    (work / "full").mkdir()
    (work / "full" / "mine.txt").write_text("x")
    (work / "afile").write_text("x")
    _, err = cli(["diagnose", "tiny.toml", "--quiet", "--compare", "a", "b", "--out", out])
    assert {"": "empty", "full": "not empty", "afile": "not a directory"}[out] in err, err
    assert not (work / "config.json").exists() and not (work / "full" / "config.json").exists()


# --- memory -------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", [["--preset", "gpt3-small"], ["--measure", "tiny.toml"]])
def test_memory_empty_recipe_is_unknown_not_none(work, cli, where):
    _, err = cli(["memory", *where, "--recipe", ""])
    assert "unknown recipe ''" in err


# --- bench: flags checked before anything compiles ----------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["recipes", "--layers", "1" + "0" * 18], "<= 2147483647"),  # an XLA abort (status -6)
        (["recipes", "--vocab", "100000000"], "params (--layers"),  # > 2**64 random bits
        (["recipes", "--seq", "100000"], "attention scores"),
        (["recipes", "--recipes", ","], "name at least one recipe"),  # ran nothing, status 0
        (["recipes", "--repeats", "1001"], "<= 1000"),  # 1e18 rounds: a hang
        (["train", "--steps", "1" + "0" * 18], "<= 1000"),
        (["telemetry", "--interval", "1" + "0" * 18], "<= 2147483647"),  # jit OverflowError
        (["codecs", "--repeats", "1" + "0" * 18], "<= 1000"),  # a hang
        (["telemetry", "--repeats", "1" + "0" * 18], "<= 1000"),  # a hang
        (["telemetry", "--steps", "1" + "0" * 18], "<= 1000"),  # a hang
        (["telemetry", "--batch", "1000000000"], "--batch must be at most 65536"),
        (["quant", "--repeats", "1" + "0" * 18], "<= 1000"),  # a hang
        (["quant", "--rows", "1" + "0" * 18], "<= 2147483647"),  # "array is too big"
        (["quant", "--rows", "65536", "--cols", "65536"], "at most 2^28 elements"),
        (["codecs", "--size", "1" + "0" * 18], "<= 2^30"),  # numpy MemoryError traceback
        (["codecs", "--size", "2^99999999999"], "not a size"),  # 1 << 10**11: a hang
    ],
)
def test_bench_bad_sizes_and_repeats_are_one_line(cli, argv, message):
    _, err = cli(["bench", *argv])
    assert message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["diagnose", "tiny.toml", "--compare", "a", "b", "--threshold", "-inf"], "got -inf"),
        (["diagnose", "tiny.toml", "--bisect", "b", "a", "--tolerance", "-nan"], "got nan"),
        (["memory", "--preset", "gpt3-small", "--budget", "-1GiB"], "malformed size '-1GiB'"),
        # diagnose's flags in the ranges of the file's [diagnose] table (these ran, or trained)
        (["diagnose", "tiny.toml", "--bisect", "b", "a", "--tail", BIG[:19]], "--tail: must be"),
        (["diagnose", "tiny.toml", "--compare", "a", "b", "--every", BIG[:19]], "--every: must"),
        (["diagnose", "tiny.toml", "--compare", "a", "b", "--steps", str(2**31)], "--steps: must"),
    ],
)
def test_flag_values_are_checked_with_their_names(work, cli, argv, message):
    # -inf and -1GiB: argparse took them for flags ("expected one argument"), hiding the cause
    _, err = cli(argv)
    assert message in err, err
