"""One process of a multi-process ``precisionlab run``: a supervisor and its training child.

When a process of a multi-process JAX run dies, the runtime's coordination service notices the
missing heartbeats and aborts every survivor from C++ (``LOG(FATAL)``: a multi-line report and
SIGABRT), which Python cannot catch. So the command the user starts (:func:`supervise`, which
never starts a JAX backend) runs the real work in a child process (:func:`child`, the same command
with ``PRECISIONLAB_DIST_CHILD=1``), passes its output through without the runtime's log lines,
and turns such an abort into one error line and exit status 1; the runtime's lines are kept in a
log file named in that line. The child dies with its supervisor (``PR_SET_PDEATHSIG`` on
Linux), so killing the command kills the process.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import IO, Any

from precisionlab.cli._common import UsageError, exit_now, one_line

__all__ = ["CHILD_ENV", "child", "supervise"]

CHILD_ENV = "PRECISIONLAB_DIST_CHILD"

#: The child says when it has joined the run, and where the run directory is (the error line
#: repeats it).
JOINED_LINE = " joined the run at "
RUN_DIR_LINE = "run directory: "

# C++ runtime log lines (absl: "E1123 00:02:16.375842   30968 file.cc:289] ...") and gloo's
# connection notices, which it prints on stdout.
_ABSL = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\]")
_GLOO = "[Gloo] "
#: Logged by the runtime's client just before it aborts the process.
_FATAL = "JAX distributed service detected fatal errors"
#: The child's first line about a collective that failed in Python (``lost_peer``).
_LOST = "precisionlab: lost another process: "


def _child_argv(args: argparse.Namespace, spec: tuple[str, int, int, int]) -> list[str]:
    coordinator, n, i, timeout = spec
    argv = [sys.executable, "-m", "precisionlab", "run"]
    if args.config:
        argv.append(args.config)
    if args.resume:
        argv += ["--resume", args.resume]
    if args.out:
        argv += ["--out", args.out]
    argv += ["--force"] if getattr(args, "force", False) else []
    for item in args.overrides:
        argv += ["--set", item]
    argv += ["--quiet"] if args.quiet else []
    argv += ["--no-report"] if args.no_report else []
    argv += ["--coordinator", coordinator, "--num-processes", str(n), "--process-id", str(i)]
    return [*argv, "--timeout", str(timeout)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # not Linux: the child may outlive a killed supervisor
        pass


class _Pump(threading.Thread):
    """Copies the child's ``source`` to ``sink`` line by line, keeping every line in ``log``
    and holding back the runtime's: its log lines, and everything after a warning, error or
    fatal one (their messages go on over lines that cannot be told from the child's own)."""

    def __init__(self, source: IO[bytes], sink: IO[str], log: collections.deque) -> None:
        super().__init__(daemon=True)
        self.source, self.sink, self.log = source, sink, log
        self.fatal = self.joined = self.muted = False
        self.run_dir: str | None = None

    def run(self) -> None:
        for raw in iter(self.source.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            self.log.append(line)
            if _FATAL in line or _LOST in line or (line.startswith("F") and _ABSL.match(line)):
                self.fatal = True
            self.muted = self.muted or self.fatal or bool(_ABSL.match(line) and line[0] in "WEF")
            if self.muted or _ABSL.match(line) or line.startswith(_GLOO):
                continue
            self.joined = self.joined or JOINED_LINE in line
            if RUN_DIR_LINE in line:
                self.run_dir = line.split(RUN_DIR_LINE, 1)[1].strip()
            self.sink.write(line)
            self.sink.flush()


def supervise(args: argparse.Namespace, spec: tuple[str, int, int, int]) -> int:
    """Run this process's share of a multi-process run in a child; returns the exit status."""
    coordinator, n, i, timeout = spec
    env = {**os.environ, CHILD_ENV: "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _child_argv(args, spec),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )
    log: collections.deque = collections.deque(maxlen=5000)
    assert proc.stdout is not None and proc.stderr is not None  # both piped above
    pumps = [_Pump(proc.stdout, sys.stdout, log), _Pump(proc.stderr, sys.stderr, log)]
    for p in pumps:
        p.start()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # the child got the terminal's SIGINT too: let it stop
        rc = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    for p in pumps:
        p.join()
    if rc == 0:
        return 0
    if any(p.fatal for p in pumps) or rc < 0:
        path = _write_log(log, i)
        run_dir = next((p.run_dir for p in pumps if p.run_dir), None)
        again = f"; continue with --resume {run_dir} on every process" if run_dir else ""
        if not any(p.fatal for p in pumps):
            what = f"was killed by signal {-rc}{again}"
        elif not any(p.joined for p in pumps):
            what = (
                f"could not join the run at {coordinator} within {timeout} s (are all {n} "
                "processes started, with the same --coordinator?)"
            )
        else:
            what = (
                f"stopped: another process of the run stopped or cannot be reached (no "
                f"heartbeat for {timeout} s, or the coordinator went away){again}"
            )
        sys.stderr.write(f"precisionlab run: error: process {i} of {n} {what} (log: {path})\n")
        return 1
    return rc


def _write_log(log: collections.deque, index: int) -> str:
    fd, path = tempfile.mkstemp(prefix=f"precisionlab-run-process{index}-", suffix=".log")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(log)
    return path


def _exit(status: int, message: str | None = None) -> None:
    """Leave now, without JAX's exit-time shutdown barrier (it would wait ``--timeout`` for
    processes that are not coming)."""
    if message:
        sys.stderr.write(f"precisionlab run: {message}\n")
    exit_now(status)


def child(
    args: argparse.Namespace,
    spec: tuple[str, int, int, int],
    train: Callable[[argparse.Namespace], Any],
    finish: Callable[[argparse.Namespace, Any], int],
) -> int:
    """This process's part of the run: join it, train (process 0 writes the run store, the
    others follow it), leave the distributed runtime, then (process 0) write the report."""
    import jax

    from precisionlab.experiments import runner
    from precisionlab.train import distributed

    coordinator, n, i, timeout = spec
    try:
        distributed.initialize(coordinator, n, i, timeout_s=timeout)
    except Exception as err:
        _exit(
            1,
            f"error: process {i} of {n} could not join the run at {coordinator} within "
            f"{timeout} s: {one_line(str(err))}",
        )
    sys.stderr.write(f"process {i} of {n}{JOINED_LINE}{coordinator}\n")
    try:
        if distributed.is_main():
            run_dir = train(args)
        else:
            run_dir = runner.follow(None if args.resume else args.config, args.overrides)
        jax.distributed.shutdown()
        return finish(args, run_dir) if i == 0 else 0
    except (UsageError, ValueError) as err:
        _exit(2, f"error: {one_line(str(err)) or type(err).__name__}")
    except OSError as err:
        where = f"{err.filename}: " if getattr(err, "filename", None) else ""
        _exit(2, f"error: {one_line(f'{where}{err.strerror or err}')}")
    except KeyboardInterrupt:
        _exit(130, "interrupted")
    except BaseException as err:
        if distributed.lost_peer(err):  # the supervisor writes the error line
            sys.stderr.write(f"{_LOST}{one_line(str(err))}\n")
            traceback.print_exc()
            _exit(1)
        traceback.print_exc()
        _exit(1)
    return 1  # not reached
