"""Run directories (issue 10): names are one path component, nothing is written outside the
chosen root, symbolic links inside a run are refused, one writer at a time, one file mode."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest

from precisionlab.cli import main
from precisionlab.experiments import _store as store

SURVEY = """\
kind = "survey"
name = {name}

[survey]
formats = ["int8"]
dists = ["normal"]
size = 256
"""


def _write(tmp_path, name='"tiny"'):
    path = tmp_path / "exp.toml"
    path.write_text(SURVEY.format(name=name))
    return path


def _files(root):
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize(
    ("name", "expected"),
    [("../../x", "x"), ("/tmp/abs", "tmp-abs"), ("a b/c", "a-b-c"), ("..", "run"),
     (".hidden", "hidden"), ("ok-name_1.2", "ok-name_1.2"), ("x" * 300, "x" * 100)],
)  # fmt: skip
def test_safe_name_is_one_component(name, expected):
    got = store.safe_name(name)
    assert got == expected
    assert "/" not in got and got not in (".", "..")


@pytest.mark.parametrize("name", ['"../../escape"', '"/tmp/escape-abs"', '"a/../../b"'])
def test_top_level_name_cannot_leave_runs(tmp_path, monkeypatch, capsys, name):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    path = _write(tmp_path, name)
    before = _files(tmp_path) - _files(work)
    assert main(["run", str(path), "--quiet", "--no-report"]) == 0
    capsys.readouterr()
    assert _files(tmp_path) - _files(work) == before  # nothing new outside work/
    (run_dir,) = (work / "runs").iterdir()
    assert run_dir.parent == work / "runs"


def test_symlink_inside_a_run_is_refused(tmp_path, capsys):
    path = _write(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-report"]) == 0
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    (out / "run.json").unlink()
    (out / "run.json").symlink_to(outside)
    capsys.readouterr()
    assert main(["run", "--resume", str(out), "--quiet", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and err.count("\n") == 1
    assert outside.read_text() == "{}"


def test_jsonl_writer_does_not_follow_a_link(tmp_path):
    target = tmp_path / "target.jsonl"
    target.write_text("")
    (tmp_path / "m.jsonl").symlink_to(target)
    with pytest.raises((OSError, ValueError), match="symbolic link"):
        store.JsonlWriter(tmp_path / "m.jsonl")
    assert target.read_text() == ""


def test_second_writer_gets_the_holders_pid(tmp_path, capsys):
    path = _write(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-report"]) == 0
    capsys.readouterr()
    # Another process holds the lock (the way a running `precisionlab run` does).
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from precisionlab.experiments import _store as store
            with store.run_lock({str(out)!r}):
                print("locked", flush=True)
                time.sleep(60)
        """)],
        stdout=subprocess.PIPE, text=True, env={**os.environ},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        status = main(["run", "--resume", str(out), "--quiet", "--no-report"])
        err = capsys.readouterr().err
        assert status == 2
        assert f"another precisionlab process (pid {holder.pid})" in err
        assert err.count("\n") == 1
    finally:
        holder.kill()
        holder.wait()
    assert main(["run", "--resume", str(out), "--quiet", "--no-report"]) == 0  # released


def test_run_files_have_one_mode(tmp_path, capsys):
    path = _write(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet"]) == 0
    modes = {
        p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode)
        for p in out.rglob("*")
        if p.is_file()
    }
    assert "config.json" in modes and "summary.json" in modes
    mask = os.umask(0o022)  # what open() gives a new file: 0o666 less the umask
    os.umask(mask)
    assert set(modes.values()) == {0o666 & ~mask}, modes


def test_report_refuses_a_run_with_a_symlink(tmp_path, capsys):
    path = _write(tmp_path)
    out = tmp_path / "run"
    assert main(["run", str(path), "--out", str(out), "--quiet", "--no-report"]) == 0
    elsewhere = tmp_path / "elsewhere.md"
    elsewhere.write_text("mine\n")
    (out / "report.md").symlink_to(elsewhere)
    capsys.readouterr()
    assert main(["report", str(out)]) == 2
    assert "is a symbolic link" in capsys.readouterr().err
    assert elsewhere.read_text() == "mine\n"
