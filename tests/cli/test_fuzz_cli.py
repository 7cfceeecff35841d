"""Fuzzing the command line and experiment files (issue 10).

Hypothesis generates arguments for every verb (valid flags with hostile values: huge and
negative numbers, inf/NaN, 400-digit and 100 KB strings, path traversal, unknown names) and
mutated experiment files (values replaced, keys dropped or added, ``name`` set to paths).
Every case runs in-process through :func:`precisionlab.cli.main` under a time limit and must:
exit 0, 1 or 2; never print a traceback or let an exception escape; never hang; never write
outside its working directory.

The default suite runs a sample (460 cases, mostly the fast verbs, about 10 CPU seconds);
``-m slow`` runs 3,300 (``test_fuzz_*_full``).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precisionlab.cli import main

ROOT = Path(__file__).resolve().parents[2]
TIME_LIMIT_S = 120  # per case: a compile on a loaded 2-core machine takes seconds, a hang forever


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang


def run_case(argv: list[str]) -> tuple[int, str]:
    """Exit status and stdout + stderr of ``main(argv)``; fails on a hang or an escape."""
    buffer = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT_S)
    try:
        with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
            try:
                status = main(argv)
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else 2
    except Hang:
        pytest.fail(f"no answer within {TIME_LIMIT_S} s: precisionlab {argv!r}"[:2000])
    except Exception as err:  # an escaped exception is the bug looked for
        pytest.fail(f"precisionlab {argv!r} raised {type(err).__name__}: {err}"[:2000])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    out = buffer.getvalue()
    assert status in (0, 1, 2), f"precisionlab {argv!r} exited {status}:\n{out[-2000:]}"
    assert "Traceback" not in out, f"precisionlab {argv!r} printed a traceback:\n{out[-3000:]}"
    if status == 2:
        errors = [ln for ln in out.splitlines() if ": error: " in ln]
        assert errors or out.startswith("usage:"), out[-2000:]  # bare `precisionlab`: help
        assert all(len(ln) <= 500 for ln in errors), out[-2000:]
    return status, out


# --- hostile values ------------------------------------------------------------------------
WEIRD = [
    "", " ", "-", "--", "0", "-0", "1", "-1", "2", "3", "7", "32", "1024", "65536", "1e400",
    "-1e400", "nan", "-nan", "inf", "-inf", "1e1000000000000000000", "1e-1000000000000000000",
    "9" * 400, "1" * 5000, "x" * 100_000, "../../escape", "/tmp/precisionlab-fuzz-escape",
    "a/../../b", "0x", "0b2", "0xzz", "1/0", "0/0", "1e5/3", "%s%d%%", "{}", "[", "]", "'", '"',
    "é", "\u202e", "1_000", "0.1", "-1.5e-39", "p=f32,c=f16", "bf16", "e4m3fn", "int4",
    "mxfp4", "mxint8", "block:0", "block:100000", "channel:7", "channel:-9", "percentile:101",
    "percentile:nan", "80GiB", "1e30GiB", "0GiB", "-5GB", "2**16", "True", "None",
]  # fmt: skip
weird = st.sampled_from(WEIRD)
numbers = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["0", "1", "2", "3", "8", "16", "64", "256", "1000"]),
)
text = st.text(max_size=30).filter(lambda s: "\x00" not in s)
value = st.one_of(weird, numbers, text)


def _flags(spec: dict[str, st.SearchStrategy | None], positional=None, max_flags=4):
    """argv lists from flag -> value strategy (None: a switch), in any order."""

    @st.composite
    def build(draw):
        argv = []
        if positional is not None:
            argv.append(draw(positional))
        chosen = draw(st.lists(st.sampled_from(sorted(spec)), max_size=max_flags, unique=True))
        for flag in chosen:
            strategy = spec[flag]
            argv.append(flag)
            if strategy is not None:
                argv.append(draw(strategy))
        if draw(st.integers(0, 19)) == 0:
            argv.append(draw(weird))  # a stray argument
        return argv

    return build()


FORMAT_NAMES = ["fp32", "bf16", "fp16", "e4m3fn", "e5m2", "e3m2b5", "int8", "int4", "e8m0"]
fmt_value = st.one_of(st.sampled_from(FORMAT_NAMES), value)
fmt_list = st.lists(fmt_value, min_size=1, max_size=3).map(",".join)

BITS = _flags(
    {
        "--format": st.one_of(fmt_list, value),
        "--rounding": st.one_of(st.sampled_from(["up", "down", "to_odd", "stochastic"]), value),
        "--saturate": None,
        "--json": None,
    },
    positional=value,
)
MEMORY = _flags(
    {
        "--preset": st.one_of(st.sampled_from(["gpt3-small", "gpt3-175b"]), value),
        "--policy": st.one_of(st.sampled_from(["p=f32,c=bf16", "f16", "c=f8"]), value),
        "--optimizer": st.one_of(st.sampled_from(["adam", "sgd", "lion"]), value),
        "--opt-dtype": st.one_of(st.sampled_from(["bf16", "float8_e4m3fn"]), value),
        "--grad-dtype": value,
        "--batch": numbers,
        "--seq": numbers,
        "--checkpoint-every": numbers,
        "--microbatches": numbers,
        "--zero-stage": numbers,
        "--dp": numbers,
        "--budget": st.one_of(st.sampled_from(["80GiB", "1TB", "16 GB"]), value),
        "--recipe": st.one_of(st.sampled_from(["mxfp8", "nvfp4", "delayed", "bf16"]), value),
        "--dropout": None,
        "--json": None,
        "--list-presets": None,
    },
    max_flags=6,
).map(lambda argv: ["memory", *([] if "--preset" in argv else ["--preset", "gpt3-small"]), *argv])
VALUES = st.tuples(fmt_value, st.sampled_from([[], ["--json"]])).map(
    lambda t: ["values", t[0], *t[1]]
)


def mostly(valid: list[str]) -> st.SearchStrategy[str]:
    """Valid values three times out of four, so cases get past validation and do work."""
    good = st.sampled_from(valid)
    return st.one_of(good, good, good, weird)


SURVEY_FORMATS = st.lists(mostly(["int8", "e4m3fn", "mxfp4", "bf16"]), min_size=1, max_size=2)
SURVEY_DISTS = mostly(["normal", "student_t:3", "loguniform:-20:10", "student_t:0"])
# One or two formats and one distribution per case: the default survey (8 formats, 3 inputs)
# compiles for a minute on a loaded 2-core machine, which is work, not a hang.
SURVEY = st.tuples(
    SURVEY_FORMATS.map(",".join),
    SURVEY_DISTS,
    _flags(
        {
            "--granularity": mostly(["tensor", "channel:0", "block:32"]),
            "--scale": mostly(["amax", "mse", "percentile:99.9", "none"]),
            "--rounding": mostly(["nearest_even", "stochastic"]),
            "--seed": numbers,
            "--json": None,
        },
    ),
).map(lambda t: ["survey", "--size", "1024", "--formats", t[0], "--dist", t[1], *t[2]])
#: What a mistyped subcommand must not be (a real one would run).
_SUBCOMMANDS = frozenset(
    ("bits", "formats", "values", "env", "survey", "memory", "run", "report", "compare",
     "bench", "conformance", "diagnose", "emulate-check", "consistency", "verify",
     "forecast", "tournament")
)  # fmt: skip
OTHER = st.one_of(
    st.sampled_from(
        [
            ["formats"],
            ["formats", "--json"],
            ["--help"],
            ["bench", "--help"],
            ["bench", "codecs", "--help"],
            ["bench", "quant", "--help"],
            ["bench", "train", "--help"],
            ["run", "--help"],
            ["report", "--help"],
            ["compare", "--help"],
            ["memory", "--help"],
            ["survey", "--help"],
            ["bits", "--help"],
            ["values", "--help"],
            ["env", "--help"],
            [],
            ["bench"],
            ["run"],
            ["run", "--resume", "."],
        ]
    ),
    st.tuples(st.sampled_from(["report", "compare", "run"]), value).map(list),
    st.tuples(st.sampled_from(["bench codecs", "bench quant", "bench train"]), weird).map(
        lambda t: [*t[0].split(), "--repeats", t[1], "--out", "/nonexistent-fuzz/x.json"]
    ),
    st.tuples(st.sampled_from(["bits", "memory", "survey", "nope"]), weird).map(
        lambda t: [t[0], "--definitely-unknown", t[1]]
    ),
    # issue 39: --version at once, a mistyped subcommand (did you mean), the run's new flags
    st.just(["--version"]),
    st.text("abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=14)
    .filter(lambda s: s not in _SUBCOMMANDS)
    .map(lambda s: [s, "x"]),
    st.tuples(value).map(lambda t: ["run", t[0], "--deterministic", "--force", "--quiet"]),
    st.tuples(value).map(lambda t: ["run", "--resume", t[0], "--deterministic"]),
)


# --- experiment files ----------------------------------------------------------------------
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f'"{k}" = {_toml_value(x)}' for k, x in v.items()) + " }"
    raise TypeError(v)


def to_toml(doc: dict) -> str:
    """A small TOML writer: top-level scalars, then tables, then arrays of tables."""

    def is_table_array(v) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)

    lines = [
        f'"{k}" = {_toml_value(v)}'
        for k, v in doc.items()
        if not isinstance(v, dict) and not is_table_array(v)
    ]
    for k, v in doc.items():
        if isinstance(v, dict):
            lines.append(f'["{k}"]')
            lines += [f'"{kk}" = {_toml_value(vv)}' for kk, vv in v.items()]
        elif is_table_array(v):
            for item in v:
                lines.append(f'[["{k}"]]')
                lines += [f'"{kk}" = {_toml_value(vv)}' for kk, vv in item.items()]
    return "\n".join(lines) + "\n"


BASES = {
    "survey": {
        "kind": "survey",
        "name": "fz",
        "survey": {"formats": ["int8"], "dists": ["normal"], "size": 256, "seed": 0},
    },
    "train": {
        "kind": "train",
        "name": "fz",
        "seeds": [0],
        "train": {
            "model": "mlp",
            "steps": 2,
            "batch_size": 8,
            "lr": 1e-3,
            "optimizer_kwargs": {"eps": 1e-8},
            "model_kwargs": {"width": 8},
        },
        "variant": [{"name": "a", "policy": "f32"}, {"name": "b", "loss_scale": "dynamic"}],
    },
    "memory": {"kind": "memory", "name": "fz", "memory": {"d_model": 8}},
}
TOML_VALUES = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.sampled_from(WEIRD[:60]),
    st.lists(st.one_of(st.integers(-5, 5), st.sampled_from(["a", "normal", "int8"])), max_size=3),
    st.builds(lambda: {"eps": [1, "a"]}),  # a fresh dict each time (mutated in place)
)


@st.composite
def mutated(draw, kinds=("survey", "train", "memory")):
    import copy

    doc = copy.deepcopy(BASES[draw(st.sampled_from(kinds))])
    for _ in range(draw(st.integers(1, 3))):
        tables = [doc] + [v for v in doc.values() if isinstance(v, dict)]
        tables += [x for v in doc.values() if isinstance(v, list) for x in v if isinstance(x, dict)]
        table = draw(st.sampled_from(tables))
        action = draw(st.sampled_from(["set", "set", "drop", "add", "name"]))
        keys = sorted(table)
        if action == "set" and keys:
            table[draw(st.sampled_from(keys))] = draw(TOML_VALUES)
        elif action == "drop" and keys:
            del table[draw(st.sampled_from(keys))]
        elif action == "add":
            table[draw(st.sampled_from(["steps", "size", "lr", "eps", "bogus", "seed"]))] = draw(
                TOML_VALUES
            )
        else:
            names = ["../../x", "/tmp/pl-fuzz-abs", "a/b", "..", ".", "ok"]
            doc["name"] = draw(st.sampled_from(names))
    return doc


# --- the guard against writes outside the working directory ---------------------------------
def _snapshot(dirs) -> set[str]:
    seen = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            seen |= {os.path.join(d, name) for name in os.listdir(d)}
    return seen


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """cwd = a fresh directory; after the test, nothing new outside it (the checkout, /tmp,
    the parent of the sandbox, the home directory)."""
    work = tmp_path / "work"
    work.mkdir()
    bad = work / "bad"
    bad.mkdir()
    open(bad / "empty.npy", "wb").close()
    (bad / "text.npy").write_text("not numpy\n")
    np.save(bad / "int.npy", np.arange(4))
    np.savez(bad / "none.npz")
    monkeypatch.chdir(work)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("PRECISIONLAB_DEBUG", raising=False)
    # /tmp is shared with other processes: only the names the fuzz itself uses are watched there.
    watched = [str(ROOT), str(tmp_path), str(tmp_path.parent)]
    before = _snapshot(watched) | _fuzz_names()
    git_before = _git_status()
    yield work
    new = (_snapshot(watched) | _fuzz_names()) - before
    assert not new, f"files written outside the working directory: {sorted(new)[:10]}"
    assert _git_status() == git_before, "new files in the checkout"


def _fuzz_names() -> set[str]:
    import glob

    return set(glob.glob("/tmp/*fuzz*")) | set(glob.glob("/nonexistent-fuzz*"))


def _git_status() -> str:
    proc = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
        capture_output=True, text=True,
    )  # fmt: skip
    # New files only: an escape creates files; edits to tracked files are someone's work.
    return "\n".join(line for line in proc.stdout.splitlines() if line.startswith("??"))


FAST = settings(
    deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
)  # fmt: skip


def _verbs(n_fast: int, n_survey: int, n_files: int):
    """One fuzz test per family of verbs, with the given numbers of cases."""

    @settings(FAST, max_examples=n_fast)
    @given(st.one_of(BITS.map(lambda a: ["bits", *a]), MEMORY, VALUES, OTHER))
    def fast(sandbox, argv):
        run_case(argv)

    @settings(FAST, max_examples=n_survey)
    @given(
        st.one_of(
            SURVEY,
            st.sampled_from(["empty.npy", "text.npy", "int.npy", "none.npz", "missing.npy"]).map(
                lambda f: ["survey", "--input", f"bad/{f}"]
            ),
        )
    )
    def survey(sandbox, argv):
        run_case(argv)

    @settings(FAST, max_examples=n_files)
    @given(doc=mutated())
    def files(sandbox, doc, monkeypatch_runner):
        path = sandbox / "exp.toml"
        path.write_text(to_toml(doc))
        status, out = run_case(["run", str(path), "--quiet", "--no-report"])
        if status == 0:
            assert doc["kind"] != "train" or "validated" in out

    return fast, survey, files


@pytest.fixture
def monkeypatch_runner(monkeypatch):
    """Train and memory experiments that pass validation are not trained here (that is
    seconds per case): validation, the run directory and the lock are real, the work is not.
    Survey experiments run for real."""
    from precisionlab.experiments import _runner as runner
    from precisionlab.experiments import _store as store

    real = runner.run_locked  # called with the run's lock held (run_file, resume)

    def fake(experiment, run_dir, *, quiet=False, resuming=False, **_):
        if experiment.kind == "survey":
            return real(experiment, run_dir, previous=None, quiet=quiet, resuming=resuming)
        store.write_json(Path(run_dir) / "summary.json", {"kind": "other", "status": "finished"})
        print("validated")
        return Path(run_dir)

    monkeypatch.setattr(runner, "run_locked", fake)


# The default suite's sample is kept to about 10 CPU seconds (the suite's budget); the slow
# tests run the same generators with about seven times as many cases.
_fast, _survey, _files = _verbs(n_fast=400, n_survey=30, n_files=30)
test_fuzz_fast_verbs, test_fuzz_survey, test_fuzz_experiment_files = _fast, _survey, _files

_fast_full, _survey_full, _files_full = _verbs(n_fast=2500, n_survey=300, n_files=500)
test_fuzz_fast_verbs_full = pytest.mark.slow(_fast_full)
test_fuzz_survey_full = pytest.mark.slow(_survey_full)
test_fuzz_experiment_files_full = pytest.mark.slow(_files_full)


def test_to_toml_round_trips():
    import tomllib

    for doc in BASES.values():
        assert tomllib.loads(to_toml(doc)) == doc
