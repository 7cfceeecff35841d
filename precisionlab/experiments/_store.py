"""The run store: one directory per run, written so that a killed run leaves valid files.

Layout of a run directory::

    config.json         source, --set overrides, the document and the resolved config
    environment.json    python, jax, jaxlib, ml_dtypes versions; backend, device kind/count
    run.json            status (running / interrupted / finished) and timestamps
    summary.json        per-unit results and per-group mean/std (atomic, rewritten as units end)
    variants/<id>/      per unit: metrics.jsonl (one JSON object per step, appended and
                        flushed), status.json, data.json (the dataset's describe(): options,
                        corpus files and content hash), hist.jsonl, telemetry.jsonl (one
                        row per telemetry step, layer and tensor), error.log, checkpoints/
    report.md, plots/   written by :mod:`precisionlab.experiments._report`
    variants/<id>/tb/   TensorBoard event files, only if ``tensorboardX`` is installed

JSON files are strict JSON written atomically through :mod:`precisionlab._io` (a temporary file,
fsynced, moved into place with :func:`os.replace`); JSONL files are appended line by line and
flushed, and readers ignore a torn last line. Every file gets the same mode (0666 less the umask,
0644 usually); symbolic links are never followed inside a run directory (a run or resume refuses a
directory that holds one), and the process writing a run directory holds an advisory lock on
``.lock`` in it (:func:`run_lock`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import stat
import sys
import time
from collections.abc import Iterable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

from precisionlab import _io
from precisionlab.experiments import _runfiles as runfiles

__all__ = [
    "JsonlWriter",
    "confined",
    "cpu_description",
    "environment",
    "lock_holder",
    "locked_run",
    "makedirs",
    "new_run_dir",
    "read_json",
    "read_jsonl",
    "run_lock",
    "safe_name",
    "save_figure",
    "to_jsonable",
    "write_json",
    "write_text",
]


# every read of a run file is bounded and checked against its file's schema (runfiles)
read_json = runfiles.read_json
read_jsonl = runfiles.read_jsonl
to_jsonable = _io.to_jsonable
from_json_float = _io.from_json_float
JsonlWriter = _io.JsonlWriter
makedirs = _io.makedirs
confined = _io.confined
write_text = _io.write_text
save_figure = _io.save_figure


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as strict JSON atomically (see :mod:`precisionlab._io`)."""
    _io.makedirs(Path(path).parent)
    _io.write_json(path, data)


def truncate_jsonl(path: Path, keep: Iterable[dict[str, Any]]) -> None:
    """Rewrite ``path`` atomically with only ``keep`` (used when a resumed unit restarts from a
    checkpoint older than its last recorded step)."""
    _io.write_jsonl(path, keep)


def resume_jsonl(path: Path, step: int) -> None:
    """Prepare a resumed unit's JSONL file: keep the whole rows recorded before ``step`` and
    drop the rest, including a line torn by a kill, so appending continues a valid file."""
    path = Path(path)
    if path.exists():
        truncate_jsonl(path, [r for r in read_jsonl(path) if int(r.get("step", -1)) < step])


def tensorboard_writer(log_dir: Path) -> Any | None:
    """A TensorBoard ``SummaryWriter`` for ``log_dir`` when ``tensorboardX`` is installed (it is
    not a dependency), else None."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(log_dir))


def _version(module: str) -> str | None:
    try:
        return version(module)
    except Exception:
        return None


def environment() -> dict[str, Any]:
    """Versions and the device this run used (JAX is imported here)."""
    import jax  # noqa: PLC0415  the run store is JAX-free (reports and compare read it without JAX)

    devices = jax.devices()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "ml_dtypes": _version("ml_dtypes"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "precisionlab": _version("precisionlab"),
        "backend": jax.default_backend(),
        # what decides a CPU run's last bits without train.deterministic: the instruction set
        # XLA compiles for, the cores a reduction may be split over, XLA's build and flags
        "cpu": cpu_description(),
        "xla": {"jaxlib": _version("jaxlib"), "flags": os.environ.get("XLA_FLAGS", "")},
        "device_kind": devices[0].device_kind if devices else None,
        "device_count": len(devices),  # of all processes in a multi-process run
        "process_count": jax.process_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


#: The x86 instruction-set extensions recorded (those XLA's CPU code generation may use).
_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
        "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")  # fmt: skip


def cpu_description() -> dict[str, Any]:
    """The CPU model, its instruction-set extensions that matter to XLA (x86 ``/proc/cpuinfo``
    flags; on other machines the architecture only) and the cores this process may use."""
    model = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        text = _io.read_head("/proc/cpuinfo", 1 << 20)[0].decode(errors="replace")
    except (OSError, ValueError):
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        if key.strip() in ("flags", "Features") and not flags:
            present = set(value.split())
            flags = [f for f in _ISA if f in present] or sorted(present)[:40]
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": model, "machine": platform.machine(), "isa": flags, "cores_usable": usable}


_UNSAFE = re.compile(r"[^A-Za-z0-9_.+=^-]+")


def safe_name(name: str) -> str:
    """``name`` as one safe path component: runs of other characters than letters, digits and
    ``_ . + = ^ -`` become ``-``, leading dots and dashes are dropped, at most 100 characters
    (``"../../x"`` -> ``"x"``, ``"/tmp/a b"`` -> ``"tmp-a-b"``); ``"run"`` if nothing is left."""
    cleaned = _UNSAFE.sub("-", str(name)).lstrip(".-")[:100].rstrip(".-")
    return cleaned or "run"


def new_run_dir(root: Path, name: str) -> Path:
    """A fresh directory ``root/<name>-<UTC timestamp>`` (suffixed if it exists); ``name`` is
    made one path component (:func:`safe_name`) and the result checked to stay under ``root``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    root = Path(root)
    base = root / f"{safe_name(name)}-{stamp}"
    if not base.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"run name {name!r} leads outside {str(root)!r}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def check_no_symlinks(run_dir: Path) -> None:
    """Refuse a run directory holding a symbolic link (writes would follow it elsewhere)."""
    for top, dirs, files in os.walk(run_dir, followlinks=False):
        for entry in dirs + files:
            if os.path.islink(os.path.join(top, entry)):
                link = os.path.join(top, entry)
                raise ValueError(
                    f"{link} is a symbolic link; precisionlab does not follow links inside a run "
                    "directory: remove it"
                )


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[str | None]:
    """Hold an exclusive advisory lock on ``run_dir/.lock`` (with this process's pid in it)
    while writing the run; a second writer gets a ValueError naming the holder's pid. Yields
    the pid the file named before (a process that ended holding it: killed), or None."""
    try:
        import fcntl  # noqa: PLC0415  fcntl exists on POSIX only
    except ImportError:  # pragma: no cover - no advisory locks on this platform
        yield None
        return
    run_dir = Path(run_dir)
    path = run_dir / ".lock"
    try:  # a link, FIFO or hard-linked file planted as .lock is refused, never truncated
        fd = _io.open_existing_or_new(path, append=False)
    except OSError as err:
        raise ValueError(f"{path}: cannot open the run's lock file ({err.strerror})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _pid_text(os.pread(fd, 32, 0)) or "unknown"
            raise ValueError(
                f"{run_dir} is being written by another precisionlab process (pid {holder}); "
                "wait for it to finish or stop it"
            ) from None
        previous = _pid_text(os.pread(fd, 32, 0))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield previous
    finally:
        os.close(fd)  # releases the lock


def _pid_text(data: bytes) -> str | None:
    text = data.decode(errors="replace").strip()
    return text if text.isdigit() else None


def lock_holder(run_dir: Path) -> tuple[str, bool] | None:
    """``(pid, alive)`` of the process named in ``run_dir/.lock``: ``alive`` while a process
    holds the lock (this one included), False when the process that wrote it has ended
    without releasing the run (killed); None when there is no readable lock file. Reads only."""
    try:
        import fcntl  # noqa: PLC0415  fcntl exists on POSIX only
    except ImportError:  # pragma: no cover
        return None
    path = Path(run_dir) / ".lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        pid = _pid_text(os.pread(fd, 32, 0))
        if pid is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return pid, True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return pid, False
    finally:
        os.close(fd)


@contextlib.contextmanager
def locked_run(run_dir: Path) -> Iterator[str | None]:
    """Create ``run_dir`` if needed, refuse it if it holds a symbolic link, then hold
    :func:`run_lock` on it with every path below it :func:`confined`; yields what
    :func:`run_lock` yields. Take it before writing anything in the directory."""
    run_dir = Path(run_dir)
    _io.makedirs(run_dir)
    check_no_symlinks(run_dir)
    # confined: a link planted in the run directory after this check is still never
    # followed by a write or read through precisionlab._io
    with _io.confined(run_dir), run_lock(run_dir) as previous:
        yield previous
