"""Hostile files around a run: devices and links where outputs go, damaged run files, deep nesting;
nothing is written outside its directory (hypothesis)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from _tiny_runs import ONE, one_variant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from precisionlab import _io
from precisionlab.experiments import _store as store


@pytest.fixture
def work(tmp_path, monkeypatch):
    return one_variant(tmp_path, monkeypatch)


DATA = Path(__file__).parents[1] / "data" / "run_tiny"


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (not following links): type, size and content of files."""
    out = {}
    for top, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = os.path.join(top, name)
            info = os.lstat(path)
            kind = stat.S_IFMT(info.st_mode)
            body = Path(path).read_bytes() if stat.S_ISREG(info.st_mode) else None
            link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
            out[os.path.relpath(path, root)] = (kind, body, link, info.st_ino)
    return out


def _device_node(path: Path) -> str:
    """A character device like /dev/null (1, 3) at ``path`` inside the test's directory, or a
    FIFO where this process may not make device nodes; returns its kind's word."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return "a device"
    except (PermissionError, OSError):
        os.mkfifo(path)
        return "a FIFO"


# --- O1: --out onto a device, FIFO or link never replaces it --------------------------------
def test_o1_bench_out_onto_a_device_is_refused_before_measuring(work, cli):
    word = _device_node(work / "null")
    before = os.lstat(work / "null")
    argv = ["bench", "codecs", "--size", "4096", "--repeats", "1", "--formats", "bf16"]
    _, err = cli([*argv, "--out", str(work / "null")])
    assert f"is {word}" in err and "- for stdout" in err
    after = os.lstat(work / "null")
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert after.st_ino == before.st_ino and after.st_rdev == before.st_rdev
    assert sorted(os.listdir(work)) == ["null", "tiny.toml"]  # no null.jsonl either


def test_o1_bench_out_dash_is_stdout(work, cli):
    argv = ["bench", "codecs", "--size", "4096", "--repeats", "1", "--formats", "bf16"]
    out, _ = cli([*argv, "--out", "-"], status=0)
    assert json.loads(out)["benchmark"] == "codecs"
    assert sorted(os.listdir(work)) == ["tiny.toml"]  # no file named "-"


@pytest.mark.parametrize("plant", ["device", "symlink", "dir"])
def test_o1_every_atomic_write_refuses_what_is_not_a_file(work, plant):
    target = work / "t.json"
    outside = work / "outside.json"
    outside.write_text("keep")
    if plant == "device":
        _device_node(target)
    elif plant == "symlink":
        target.symlink_to(outside)
    else:
        target.mkdir()
    before = _snapshot(work)
    for write in (
        lambda: _io.write_json(target, {"a": 1}),
        lambda: _io.JsonlWriter(target).close(),
        lambda: store.write_text(target, "x"),
    ):
        with pytest.raises((_io.UnsafePathError, OSError)):
            write()
    assert _snapshot(work) == before


def test_o1_survey_plot_onto_a_device_is_refused(work, cli):
    word = _device_node(work / "null.png")
    _, err = cli(["survey", "--formats", "int8", "--size", "64", "--plot", "null.png"])
    assert f"is {word}" in err
    assert not stat.S_ISREG(os.lstat(work / "null.png").st_mode)


# --- H1, C2: a damaged run directory is one line, never a hang or a traceback ---------------
BIG = "9" * 400


DAMAGED = {
    "summary.json": [
        "[]", "{}", "null", BIG, "[" * 100000, "", '{"kind": 5}',
        '{"kind": "train", "variants": [1]}',
        '{"kind": "train", "variants": [{"id": "../../x", "name": "a"}]}',
        '{"kind": "train", "variants": [{"id": "00-a", "name": "a", "final_loss": [1]}]}',
        f'{{"kind": "train", "variants": [{{"id": "00-a", "name": "a", "seed": {BIG}}}]}}',
        '{"kind": "train"}', '{"kind": "survey", "result": []}',
    ],
    "config.json": ["[]", '{"document": 1}', '{"document": {}, "resolved": {"report": 1}}'],
    "run.json": ['{"status": []}'],
    "variants/00-a/metrics.jsonl": ["[]\n", '{"loss": [1]}\n', f'{{"step": {BIG}}}\n'],
}  # fmt: skip


CASES = [(f, c) for f, cs in DAMAGED.items() for c in cs]


CASES += [(f, kind) for f in ("summary.json", "config.json") for kind in ("fifo", "zero", "dir")]


def _damage(run: Path, name: str, content: str) -> None:
    path = run / name
    path.unlink()
    if content == "fifo":
        os.mkfifo(path)  # opened for reading, it waited for a writer for ever (H1)
    elif content == "zero":
        path.symlink_to("/dev/zero")  # read to the end, it filled the memory
    elif content == "dir":
        path.mkdir()
    else:
        path.write_text(content)


@pytest.mark.parametrize(("name", "content"), CASES, ids=[f"{f}-{c[:12]}" for f, c in CASES])
def test_c2_damaged_run_files_are_one_line(work, cli, name, content):
    run = work / "r"
    shutil.copytree(DATA, run)
    _damage(run, name, content)
    _, err = cli(["report", str(run), "--no-plots"])
    assert name.split("/")[-1] in err, err
    if name == "summary.json":
        _, err2 = cli(["compare", str(run)])
        assert "summary.json" in err2


@pytest.mark.parametrize("content", ["fifo", "[]", '{"document": 1}', "zero"])
def test_h1_resume_of_a_damaged_run_is_one_line(work, cli, content):
    run = work / "r"
    shutil.copytree(DATA, run)
    _damage(run, "config.json", content)
    _, err = cli(["run", "--resume", str(run), "--quiet", "--no-report"])
    assert "config.json" in err


def test_c2_the_reader_names_the_field(work):
    run = work / "r"
    shutil.copytree(DATA, run)
    (run / "summary.json").write_text('{"kind": "train", "variants": [{"id": "0", "name": 3}]}')
    with pytest.raises(_io.DamagedFileError, match=r"summary.json: variants\[0\]: name"):
        store.read_json(run / "summary.json")


def test_the_undamaged_copy_reports(work, cli):
    run = work / "r"
    shutil.copytree(DATA, run)
    out, _ = cli(["report", str(run), "--no-plots"], status=0)
    assert "report: " in out and (run / "report.md").is_file()


# --- bounds on values (H2, C1, C3, C4, C5, C6, W2-W5, W7) -----------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # H2: a divisor loop over 2^63 never ended
        (["run", "MEM", "--set", "memory.measure_layers=9223372036854775807"], "<= 256"),
        (["run", "MEM", "--set", "memory.measure_microbatches=[0]"], ">= 1"),
        # W4: a bool where a layer index goes; NaN/inf scales
        (["run", "tiny.toml", "--set", "train.model_kwargs.overflow_layer=true"], "overflow_layer"),
        (["run", "tiny.toml", "--set", "train.data=digits", "--set",
          "train.data_kwargs.input_scale=nan"], "input_scale"),
        (["run", "tiny.toml", "--set", "train.model=transformer", "--set", "train.data=markov",
          "--set", "train.model_kwargs={outlier_scale=inf}"], "outlier_scale"),
        # W5: an empty data path read the current directory
        (["run", "tiny.toml", "--set", "train.model=transformer", "--set", "train.data=text",
          "--set", 'train.data_kwargs.path=""'], "path is empty"),
        # W7: every loss underflowed to 0
        (["run", "tiny.toml", "--set", "train.loss_weight=1.2e-38"], ">= 5.42101086e-20"),
        # C3: RecursionError in the TOML parser and every later walk
        (["run", "tiny.toml", "--set", "train.x=" + "[" * 3000 + "]" * 3000], "nested too deeply"),
        # C4: RecursionError in mkdir
        (["run", "tiny.toml", "--out", "a/" * 2000], "components"),
        # C6: OverflowError
        (["survey", "--dist", "loguniform:-1e400:1e400"], "within -45..39"),
        # W2: ran nothing, exit 0
        (["bench", "quant", "--cases", ","], "--cases needs at least one name"),
        # W3: a directory named " "
        (["conformance", "--out", " "], "empty"),
    ],
)  # fmt: skip
def test_meaningless_values_are_one_line(work, cli, argv, message):
    mem = Path(__file__).resolve().parents[2] / "experiments" / "memory.toml"
    argv = [str(mem) if a == "MEM" else a for a in argv]
    if argv[0] == "run":
        argv += ["--quiet", "--no-report"]
    _, err = cli(argv)
    assert message in err, err
    assert not (work / "runs").exists() and not (work / "a").exists()


def test_c3_a_deeply_nested_experiment_file(work, cli):
    (work / "deep.toml").write_text(ONE + "[a]\nb = " + "{c = " * 400 + "1" + "}" * 400 + "\n")
    _, err = cli(["run", "deep.toml", "--quiet"])
    assert "deep.toml: nested deeper than 32 levels" in err


# --- E1-E4 and overwrites: links, hard links, planted links, existing results ----------------
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_e1_bench_rows_never_append_through_a_link(work, cli, link):
    target = work / "target.jsonl"
    target.write_text("mine\n")
    (os.symlink if link == "symlink" else os.link)(target, work / "x.jsonl")
    argv = ["bench", "codecs", "--size", "4096", "--repeats", "1", "--formats", "bf16"]
    if link == "symlink":
        _, err = cli([*argv, "--out", "x.json"])
        assert "x.jsonl: is a symbolic link" in err
    else:
        with pytest.raises(_io.UnsafePathError, match="hard links"):
            _io.JsonlWriter(work / "x.jsonl")
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_e2_report_never_written_through_a_link(work, link):
    outside = work / "outside.md"
    outside.write_text("mine")
    d = work / "d"
    d.mkdir()
    (os.symlink if link == "symlink" else os.link)(outside, d / "report.md")
    if link == "symlink":
        with pytest.raises(_io.UnsafePathError, match="symbolic link"):
            _io.write_text(d / "report.md", "new")
    else:  # the rename replaces this name only; the other name keeps its file
        _io.write_text(d / "report.md", "new")
        assert (d / "report.md").read_text() == "new"
    assert outside.read_text() == "mine"


def test_e2_conformance_keeps_existing_results_unless_forced(work, cli):
    d = work / "d"
    d.mkdir()
    (d / "report.md").write_text("mine")
    argv = ["conformance", "--libs", "numpy", "--formats", "float16", "--out", "d"]
    _, err = cli([*argv, "--sources", "float64"])
    assert "already holds report.md" in err and "--force" in err
    assert (d / "report.md").read_text() == "mine"
    out, _ = cli([*argv, "--sources", "float64,float64", "--force", "--json"], status=0)
    assert len(json.loads(out)["cells"]) == 1  # a source named twice counts once (W3)


def test_e3_a_hard_linked_lock_is_not_truncated(work):
    run = work / "r"
    run.mkdir()
    other = work / "other"
    other.write_text("precious")
    os.link(other, run / ".lock")
    with pytest.raises(ValueError, match="hard links"), store.run_lock(run):
        pass
    assert other.read_text() == "precious"


def test_e4_a_link_planted_during_a_run_is_not_followed(work):
    run = work / "r"
    (run / "variants" / "00-a").mkdir(parents=True)
    outside = work / "outside"
    outside.mkdir()
    before = _snapshot(outside)
    with _io.confined(run):
        store.write_json(run / "variants" / "00-a" / "status.json", {"ok": 1})  # fine
        shutil.rmtree(run / "variants")
        (run / "variants").symlink_to(outside)  # planted after the run started
        for write in (
            lambda: store.write_json(run / "variants" / "00-a" / "status.json", {}),
            lambda: store.JsonlWriter(run / "variants" / "00-a" / "metrics.jsonl"),
            lambda: store.makedirs(run / "variants" / "01-b"),
            lambda: store.read_json(run / "variants" / "00-a" / "status.json"),
        ):
            with pytest.raises(_io.UnsafePathError, match="never follows links"):
                write()
    assert _snapshot(outside) == before


def test_overwrite_run_out_into_a_directory_with_results(work, cli):
    (work / "report.md").write_text("mine")
    (work / "summary.json").write_text("{}")
    _, err = cli(["run", "tiny.toml", "--out", ".", "--quiet"])
    assert "not empty" in err and "--force" in err
    assert (work / "report.md").read_text() == "mine"


# --- property: no write ever lands outside the directory it was given ------------------------
_NAMES = st.sampled_from(["a", "b", "variants", "x.json", "rows.jsonl", ".lock", "plots"])


_PLANTS = st.lists(
    st.tuples(st.lists(_NAMES, min_size=1, max_size=3), st.sampled_from(
        ["symlink_dir", "symlink_file", "hardlink", "fifo", "dir", "file"]
    )), max_size=5,
)  # fmt: skip


_WRITES = st.lists(
    st.tuples(st.lists(_NAMES, min_size=1, max_size=3), st.sampled_from(
        ["json", "jsonl", "text", "mkdir", "lock", "figure"]
    )), min_size=1, max_size=6,
)  # fmt: skip


class _Figure:
    def savefig(self, f, format: str, **_: object) -> None:
        f.write(b"PNG")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(plants=_PLANTS, writes=_WRITES)
def test_property_no_write_lands_outside_its_directory(tmp_path_factory, plants, writes):
    base = tmp_path_factory.mktemp("prop")
    root, outside = base / "out", base / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "victim").write_text("keep")
    (outside / "sub").mkdir()
    for parts, kind in plants:
        path = root.joinpath(*parts)
        if os.path.lexists(path) or not path.parent.is_dir() or path.parent.is_symlink():
            continue
        if kind == "symlink_dir":
            path.symlink_to(outside / "sub")
        elif kind == "symlink_file":
            path.symlink_to(outside / "victim")
        elif kind == "hardlink":
            os.link(outside / "victim", path)
        elif kind == "fifo":
            os.mkfifo(path)
        elif kind == "dir":
            path.mkdir()
        else:
            path.write_text("old")
    before = _snapshot(outside)
    with _io.confined(root):
        for parts, kind in writes:
            path = root.joinpath(*parts)
            try:
                if kind == "json":
                    store.write_json(path, {"v": 1})
                elif kind == "jsonl":
                    with store.JsonlWriter(path) as w:
                        w.write({"v": 1})
                elif kind == "text":
                    store.write_text(path, "v")
                elif kind == "mkdir":
                    store.makedirs(path)
                elif kind == "lock":
                    with store.run_lock(path.parent):
                        pass
                else:
                    store.makedirs(path.parent)
                    store.save_figure(_Figure(), path.with_suffix(".png"))
            except (ValueError, OSError):
                pass  # refused: what matters is that nothing outside changed
    assert _snapshot(outside) == before


_RUN_NAMES = st.sampled_from(
    ["report.md", "plots", "summary.json", "run.json", "variants/00-a/status.json", "variants"]
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    plants=st.lists(
        st.tuples(_RUN_NAMES, st.sampled_from(["symlink", "hardlink", "fifo"])), max_size=3
    )
)
def test_property_report_never_writes_outside_its_run(tmp_path_factory, cli, plants):
    base = tmp_path_factory.mktemp("rep")
    run, outside = base / "r", base / "outside"
    shutil.copytree(DATA, run)
    outside.mkdir()
    (outside / "victim").write_text("{}")
    for name, kind in plants:
        path = run / name
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        if not path.parent.is_dir():
            continue
        if kind == "symlink":
            path.symlink_to(outside if name in ("plots", "variants") else outside / "victim")
        elif kind == "hardlink" and name not in ("plots", "variants"):
            os.link(outside / "victim", path)
        elif kind == "fifo":
            os.mkfifo(path)
    before = _snapshot(outside)
    cli(["report", str(run), "--no-plots"], status=(0, 1, 2))
    assert _snapshot(outside) == before
