"""Where a command's wall and CPU seconds go, from the start of its process (ground floor:
imports nothing of precisionlab).

:func:`start` opens the process's clock (``precisionlab run --timings`` does, first thing);
``with phase("plan"):`` adds a block's wall and CPU seconds to the open clock (nothing when
none is open); :func:`snapshot` returns every phase with the time the process had run before
the clock opened (``startup``: the interpreter and the imports that reach the command) and the
total so far, so that the phases can be checked to account for the whole run. CPU seconds are
the process's (all threads) plus its waited-for children's (the report's worker processes).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Clock", "cpu_seconds", "phase", "process_age", "snapshot", "start"]


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its waited-for children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def process_age() -> float | None:
    """Wall seconds since this process started (Linux: /proc; None elsewhere)."""
    try:
        with open("/proc/self/stat", "rb") as f:  # a kernel file, never a user's path
            fields = f.read().rsplit(b")", 1)[1].split()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, in ticks
    return max(0.0, uptime - started)


class Clock:
    """Phases (name -> [wall_s, cpu_s]) of this process since :func:`start`."""

    def __init__(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), cpu_seconds()
        age = process_age()
        # before the clock: the interpreter's start and the imports that led here
        self.phases: dict[str, list[float]] = {
            "startup": [age if age is not None else 0.0, self.cpu0]
        }

    def add(self, name: str, wall: float, cpu: float) -> None:
        entry = self.phases.setdefault(name, [0.0, 0.0])
        entry[0] += wall
        entry[1] += cpu

    def total(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the process started."""
        return (
            self.phases["startup"][0] + time.perf_counter() - self.wall0,
            cpu_seconds(),
        )


_current: Clock | None = None


def start() -> Clock:
    """Open (or reopen) the process's clock and return it."""
    global _current
    _current = Clock()
    return _current


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall and CPU seconds to phase ``name`` of the open clock, if any."""
    clock = _current
    if clock is None:
        yield
        return
    wall, cpu = time.perf_counter(), cpu_seconds()
    try:
        yield
    finally:
        clock.add(name, time.perf_counter() - wall, cpu_seconds() - cpu)


def snapshot() -> dict[str, Any] | None:
    """The open clock as JSON-able data: ``phases`` (name -> {wall_s, cpu_s}), ``total``
    ({wall_s, cpu_s} since the process started) and ``unaccounted`` (the total less the
    phases); None when no clock is open."""
    if _current is None:
        return None
    wall, cpu = _current.total()
    phases = {k: {"wall_s": w, "cpu_s": c} for k, (w, c) in _current.phases.items()}
    return {
        "phases": phases,
        "total": {"wall_s": wall, "cpu_s": cpu},
        "unaccounted": {
            "wall_s": wall - sum(p["wall_s"] for p in phases.values()),
            "cpu_s": cpu - sum(p["cpu_s"] for p in phases.values()),
        },
    }
