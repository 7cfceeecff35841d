"""Test configuration: every test runs on CPU with float32 defaults unless it says otherwise."""

import gc
import os
import pathlib
import shutil
import signal
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# `precisionlab run` turns JAX's persistent compilation cache on (in ~/.cache by default); tests
# must not write there: pytest_configure points it at a directory of the test process's own.
os.environ.setdefault("PRECISIONLAB_CACHE_DIR", "off")
# Reports draw telemetry figures in worker processes; each starts an interpreter that imports
# JAX (seconds of CPU), more than the small figures of a test cost: in-process unless a test
# asks (tests/experiments/test_report_workers.py).
os.environ.setdefault("PRECISIONLAB_REPORT_WORKERS", "1")

import _host_devices
import _xdist_quiet_end
import hypothesis
import pytest

hypothesis.settings.register_profile("ci", max_examples=200, deadline=None, derandomize=True)
hypothesis.settings.register_profile("dev", max_examples=100, deadline=None)
hypothesis.settings.load_profile("ci" if os.environ.get("CI") else "dev")

_CACHE_DIRS: list[str] = []


def pytest_configure(config):
    """A persistent compilation cache private to this test process (each xdist worker its own,
    removed at the end), shared with the processes its tests start: a program one test compiled
    is loaded, not compiled again, by every later test that builds the same one (same HLO,
    options, devices and versions: the loaded executable is the one XLA compiled, so results
    are bit-identical). A run or its resume in a child process uses it as a user's run uses
    ~/.cache. PRECISIONLAB_TEST_COMPILE_CACHE=0 turns it off (every program compiled)."""
    # an xdist worker ignores the SIGINT execnet sends it when its teardown is slow
    config.pluginmanager.register(_xdist_quiet_end, "xdist_quiet_end")
    controller = config.getoption("numprocesses", None) and not hasattr(config, "workerinput")
    if controller or os.environ.get("PRECISIONLAB_TEST_COMPILE_CACHE", "1") == "0":
        return
    from precisionlab.train._compile_cache import ENV, enable_compilation_cache

    path = tempfile.mkdtemp(prefix="precisionlab-test-jax-cache-")
    _CACHE_DIRS.append(path)
    enable_compilation_cache(path)  # every program, however fast it compiled
    os.environ[ENV] = path  # `precisionlab run` in a child: the same cache
    # any other child that imports JAX (a script on 4 or 8 host devices)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


#: PRECISIONLAB_TEST_DEADLINE=epoch seconds: a test that would start after it is skipped, not
#: run. CI's slow phase has a time budget; cut short this way, pytest still ends normally and
#: reports what ran (a failure among it fails CI), where a killed pytest reports nothing.
_DEADLINE = os.environ.get("PRECISIONLAB_TEST_DEADLINE")
if _DEADLINE and not _DEADLINE.strip().isdigit():
    raise ValueError(
        f"PRECISIONLAB_TEST_DEADLINE must be whole seconds since the epoch, got {_DEADLINE!r}"
    )
_PAST_DEADLINE = (
    "not started: past PRECISIONLAB_TEST_DEADLINE (CI's time budget for the slow phase ran "
    "out first); run it alone with `pytest -m slow` and its id"
)

if _DEADLINE:

    @pytest.hookimpl(tryfirst=True)  # before the fixtures are set up
    def pytest_runtest_setup(item):
        if time.time() > float(_DEADLINE):
            pytest.skip(_PAST_DEADLINE)

    def pytest_terminal_summary(terminalreporter):
        cut = [
            r
            for r in terminalreporter.stats.get("skipped", [])
            if _PAST_DEADLINE in str(r.longrepr)
        ]
        if cut:
            terminalreporter.write_line(
                f"{len(cut)} tests not started: past the time budget "
                f"(PRECISIONLAB_TEST_DEADLINE); the first: {cut[0].nodeid}"
            )


#: A test process keeps every program it compiled (JAX's caches hold the executables) and each
#: XLA:CPU executable maps three memory regions; past the kernel's vm.max_map_count (65,530 by
#: default) the next compilation dies inside XLA (segmentation fault or abort: xdist workers of
#: the slow phase after about 500 tests, in test_recipes_apply.py and a docs example). Above this
#: many mappings JAX's caches are cleared between tests; the programs are then loaded from the
#: process's persistent compilation cache when needed again.
MAX_MAPPINGS = 20_000
_last_maps_check = [0.0]


def memory_mappings() -> int:
    """The mappings of this process (lines of /proc/self/maps; 0 where there is none)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # reading the maps costs milliseconds at tens of thousands: at most every 2 s
    now = time.monotonic()
    if now - _last_maps_check[0] < 2.0:
        return
    _last_maps_check[0] = now
    if memory_mappings() > MAX_MAPPINGS:
        import jax

        jax.clear_caches()
        gc.collect()


SLOW_BY_COST = pathlib.Path(__file__).with_name("slow_by_cost.txt")


def slow_by_cost() -> set[str]:
    """The test ids and files listed in slow_by_cost.txt (run only under ``-m slow``)."""
    lines = SLOW_BY_COST.read_text().splitlines()
    return {ln.split(None, 1)[1].strip() for ln in lines if ln.strip() and not ln.startswith("#")}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects
def pytest_collection_modifyitems(config, items):
    listed = slow_by_cost()
    for item in items:
        if item.nodeid in listed or item.nodeid.split("::", 1)[0] in listed:
            item.add_marker(pytest.mark.slow)
    if "not slow" not in (config.option.markexpr or ""):
        # CI's slow phase has a time budget and runs in this order: the documentation's
        # regenerations (whole experiments, minutes each, checking pages) go after the numerics,
        # training and multi-process checks, which the alphabetical order put after them
        items.sort(key=lambda item: item.nodeid.startswith("tests/docs/"))


def pytest_sessionfinish(session):
    # here, before an xdist worker reports its results: after that, a slow teardown is cut short
    for path in _CACHE_DIRS:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def no_compile_cache():
    """Turns the test processes' compilation cache off for one test (one that counts what it
    compiles or loads), and back on afterwards."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PRECISIONLAB_CACHE_DIR", "off")
        mp.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
        yield
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()


@pytest.fixture
def run_on_host_devices():
    """``run(script, devices=4, timeout=600) -> stdout``: runs the Python ``script`` in a
    subprocess on ``devices`` CPU host devices (the count must be set before jax is imported)
    and fails unless it exits 0 with ``OK`` as its last output."""
    return _host_devices.run_on_host_devices


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def _run_cli(
    capsys, argv: list[str], status: int | tuple[int, ...] = 2, limit_s: int = 30
) -> tuple[str, str]:
    from precisionlab.cli import main

    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse's errors (a flag's type)
        got = exit_.code
    except _Hang:
        pytest.fail(f"no answer within {limit_s} s: precisionlab {' '.join(argv)[:300]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    allowed = status if isinstance(status, tuple) else (status,)
    assert got in allowed, (got, out[-2000:], err[-2000:])
    assert "Traceback" not in out + err
    if got == 2:
        head = err.split(": error: ")[0]  # argparse names the subcommand: bench recipes
        assert head in (f"precisionlab {argv[0]}", f"precisionlab {' '.join(argv[:2])}"), err
        assert err.count("\n") == 1, err
    return out, err


@pytest.fixture
def cli(capsys):
    """``cli(argv, status=2, limit_s=30) -> (stdout, stderr)``: runs ``precisionlab argv``
    in-process and fails unless it exits ``status`` (or one of a tuple of them) within
    ``limit_s`` seconds without a traceback; an error (status 2) must be the one line
    ``precisionlab CMD: error: ...``. The hostile-input tests' shared checker."""
    return lambda argv, status=2, limit_s=30: _run_cli(capsys, argv, status, limit_s)


_CPU_PROFILE = os.environ.get("PRECISIONLAB_TEST_CPU_PROFILE")


if _CPU_PROFILE:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """PRECISIONLAB_TEST_CPU_PROFILE=path appends one line per test to path: the CPU seconds
        (user + system, this process and its waited-for children) and wall seconds of its setup,
        call and teardown, then its node id. A module-scoped fixture is charged to the first test
        that uses it. CPU, not wall: on a shared machine wall time measures the neighbours."""
        import time

        before, start = os.times(), time.perf_counter()
        yield
        after, wall = os.times(), time.perf_counter() - start
        cpu = sum(after[i] - before[i] for i in range(4))
        with open(_CPU_PROFILE, "a") as out:  # one write per line: xdist workers share the file
            out.write(f"{cpu:9.2f} {wall:9.2f} {item.nodeid}\n")
