"""The test suite's own machinery: a passing run prints no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parents[1]

# A worker slow to tear down after it has sent its results (a loaded machine, a heap of compiled
# programs): execnet sends it SIGINT 5 s after the controller closes it, and SIGKILL at 10 s. It
# says whether the SIGINT interrupted it (or that it was still sleeping when killed).
SLOW_END = """
import time, traceback
import pytest

@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside xdist's wrapper, which sends results
def pytest_sessionfinish(session):
    yield
    if not hasattr(session.config, "workerinput"):
        return
    with open({ended!r}, "w") as f:
        f.write("sleeping")
    try:
        time.sleep(9)
        ended = "finished"
    except KeyboardInterrupt:
        traceback.print_exc()
        ended = "interrupted"
    with open({ended!r}, "w") as f:
        f.write(ended)
"""


def test_a_worker_slow_to_end_is_not_interrupted_and_prints_no_traceback(tmp_path):
    ended = tmp_path / "ended"
    (tmp_path / "conftest.py").write_text(textwrap.dedent(SLOW_END.format(ended=str(ended))))
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    argv = ["-n", "1", "-q", "-p", "no:cacheprovider", "-p", "_xdist_quiet_end", "test_one.py"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *argv],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,  # the worker's stderr too: it holds the pipe until it exits
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "1 passed" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert ended.read_text() in ("finished", "sleeping")  # not "interrupted"


def test_every_test_listed_slow_by_cost_exists():
    # a renamed or deleted test must leave tests/slow_by_cost.txt too (else the list rots and a
    # new test of the same name would be moved to the slow phase unseen)
    from conftest import slow_by_cost

    root = Path(__file__).parents[2]
    for entry in slow_by_cost():
        path, _, name = entry.partition("::")
        assert (root / path).is_file(), entry
        if name:
            assert f"def {name.split('[')[0]}(" in (root / path).read_text(), entry


# Folders beside the packages' own: the user-style models, the site's examples, project rules.
OTHER_SUBJECTS = {"models": "the user-style models", "docs": "the site", "project": "the rules"}
HISTORY_WORDS = ("wave", "hardening", "rough_edges", "regressions", "trust", "fixes", "pass")


def test_tests_live_by_subject():
    """Every test file sits in tests/<subject>/, a subject being a package or top-level module
    of precisionlab or one of OTHER_SUBJECTS; its name says what it checks, not when it was
    written; names are unique across folders (pytest imports test files by their name)."""
    package = TESTS.parent / "precisionlab"
    subjects = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    subjects |= {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
    subjects |= set(OTHER_SUBJECTS)
    problems, seen = [], {}
    for path in sorted(TESTS.rglob("test_*.py")):
        rel = path.relative_to(TESTS)
        if rel.parts[0] == "data":
            continue
        if len(rel.parts) != 2 or rel.parts[0] not in subjects:
            problems.append(f"{rel}: put it in tests/<subject>/ (subjects: {sorted(subjects)})")
        if any(word in path.stem for word in HISTORY_WORDS):
            problems.append(f"{rel}: name it after what it checks, not when it was written")
        if path.name in seen:
            problems.append(f"{rel}: the same file name as {seen[path.name]}")
        seen[path.name] = rel
    assert not problems, "\n".join(problems)


def test_tests_past_the_deadline_are_skipped_and_counted():
    """PRECISIONLAB_TEST_DEADLINE (CI's slow phase): a test that would start after it is
    skipped with its reason, the run ends normally (exit 0) and says how many were cut."""
    here = "tests/project/test_suite_hygiene.py"
    ids = [
        f"{here}::test_tests_live_by_subject",
        f"{here}::test_every_test_listed_slow_by_cost_exists",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "1", "-q", "-p", "no:cacheprovider", "-rs", *ids],
        cwd=TESTS.parent,
        env={**os.environ, "PRECISIONLAB_TEST_DEADLINE": "1"},  # 1970: long past
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "2 skipped" in out, out
    assert "past PRECISIONLAB_TEST_DEADLINE" in out, out
    summary = "2 tests not started: past the time budget (PRECISIONLAB_TEST_DEADLINE)"
    assert f"{summary}; the first: {here}::" in out, out


def test_the_mappings_hook_clears_caches_only_past_the_limit(monkeypatch):
    """The hook's decision, on any system (the mapping count given): JAX's caches are cleared
    past MAX_MAPPINGS and not below it, and the maps are read at most every 2 s. The effect
    on a real process's mappings is the Linux-only test below."""
    import conftest
    import jax

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    monkeypatch.setattr(conftest, "memory_mappings", lambda: 500)
    monkeypatch.setattr(conftest, "MAX_MAPPINGS", 1000)
    monkeypatch.setattr(conftest, "_last_maps_check", [0.0])
    conftest.pytest_runtest_teardown(None, None)
    assert cleared == []
    monkeypatch.setattr(conftest, "MAX_MAPPINGS", 100)
    conftest.pytest_runtest_teardown(None, None)  # within 2 s of the last read: not read
    assert cleared == []
    monkeypatch.setattr(conftest, "_last_maps_check", [0.0])
    conftest.pytest_runtest_teardown(None, None)
    assert cleared == [True]


@pytest.mark.skipif(
    not os.path.exists("/proc/self/maps"),
    reason="Linux only: it measures the lines of /proc/self/maps, which this system lacks (the "
    "hook's decision is tested on every system above)",
)
def test_compiled_programs_are_released_when_the_mappings_pile_up(monkeypatch):
    """Past MAX_MAPPINGS memory mappings the suite clears JAX's caches between tests (a worker
    that reached vm.max_map_count died inside XLA's compiler): the executables' mappings go."""
    import conftest
    import jax
    import jax.numpy as jnp

    kept = [jax.jit(lambda x, i=i: x * i + 1) for i in range(100)]  # 100 programs held alive
    for f in kept:
        f(jnp.ones(3)).block_until_ready()
    before = conftest.memory_mappings()
    monkeypatch.setattr(conftest, "_last_maps_check", [0.0])
    monkeypatch.setattr(conftest, "MAX_MAPPINGS", 10**9)
    conftest.pytest_runtest_teardown(None, None)  # below the limit: nothing is cleared
    assert conftest.memory_mappings() >= before - 10
    monkeypatch.setattr(conftest, "_last_maps_check", [0.0])
    monkeypatch.setattr(conftest, "MAX_MAPPINGS", 0)
    conftest.pytest_runtest_teardown(None, None)
    assert conftest.memory_mappings() <= before - 200  # about three a program
