"""Where a training run's time goes: compilation, the first call, steady steps, host syncs.

:class:`LoopTimings` is filled by :func:`~precisionlab.train._loop.train_loop` when given one
(``timings=``); :class:`CompileMeter` counts the compilations JAX reports through its public
``jax.monitoring`` events while it is open (trace, lowering and XLA compile seconds, persistent
cache hits). Times are wall-clock seconds (``time.perf_counter``) plus the process's CPU seconds
(``time.process_time``, all threads), so a measurement on a shared machine can be read both ways.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any

import jax

__all__ = ["CompileMeter", "LoopTimings"]

#: jax.monitoring duration events -> the CompileMeter field they add to.
_DURATIONS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s",
}
_HITS = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_open: list[CompileMeter] = []
_registered = False


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
    # parameter names as jax.monitoring's listener protocol declares them
    field = _DURATIONS.get(event)
    if field is None:
        return
    with _lock:
        for meter in _open:
            setattr(meter, field, getattr(meter, field) + duration_secs)
            if field == "compile_s":  # reported for compilations and cache loads alike
                meter.programs += 1


def _on_event(event: str, **_: str | int) -> None:
    if event == _HITS:
        with _lock:
            for meter in _open:
                meter.cache_hits += 1


@dataclasses.dataclass
class CompileMeter:
    """Compilation work JAX reported while the meter was open (``with CompileMeter() as m``).

    ``programs``: executables made (compiled or loaded); ``cache_hits``: those loaded from the
    persistent cache; ``compiles``: the others; ``trace_s``, ``lower_s``, ``compile_s``,
    ``cache_load_s``: seconds of tracing to a jaxpr, lowering to MLIR, XLA compilation (cache
    loads included) and of the cache loads alone.
    """

    programs: int = 0
    cache_hits: int = 0
    trace_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0
    cache_load_s: float = 0.0

    def __enter__(self) -> CompileMeter:
        global _registered
        with _lock:
            if not _registered:  # once per process: jax keeps its listeners for good
                jax.monitoring.register_event_duration_secs_listener(_on_duration)
                jax.monitoring.register_event_listener(_on_event)
                _registered = True
            _open.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        with _lock:
            _open.remove(self)

    @property
    def compiles(self) -> int:
        return self.programs - self.cache_hits

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "compiles": self.compiles}


@dataclasses.dataclass
class LoopTimings:
    """What :func:`~precisionlab.train._loop.train_loop` measured (pass one as ``timings=``).

    chunk_steps: steps per compiled call. first_call_s / first_call_steps: the first call of the
    step program (tracing and compiling included) and the steps it ran. step_s: seconds per
    step of every later call (a call's time divided by its steps). host_syncs: the loop's
    blocking device-to-host fetches. probe_s, eval_s, hooks_s, data_s: histogram/shadow probes,
    evaluation, hooks (callback, checkpoints, progress), batch generation. compile: the
    :class:`CompileMeter` of the whole loop.
    """

    chunk_steps: int = 1
    calls: int = 0
    first_call_s: float = float("nan")
    first_call_steps: int = 0
    step_s: list[float] = dataclasses.field(default_factory=list)
    host_syncs: int = 0
    probe_s: float = 0.0
    eval_s: float = 0.0
    hooks_s: float = 0.0
    data_s: float = 0.0
    compile: CompileMeter = dataclasses.field(default_factory=CompileMeter)

    def call(self, seconds: float, steps: int) -> None:
        """Record one call of the step program that ran ``steps`` steps in ``seconds``."""
        if self.calls == 0:
            self.first_call_s, self.first_call_steps = seconds, steps
        else:
            self.step_s.extend([seconds / steps] * steps)
        self.calls += 1

    def steady_step_s(self) -> float:
        """The median seconds per step after the first call (nan when there was one call)."""
        return statistics.median(self.step_s) if self.step_s else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_steps": self.chunk_steps,
            "calls": self.calls,
            "first_call_s": self.first_call_s,
            "first_call_steps": self.first_call_steps,
            "steady_step_s": self.steady_step_s(),
            "host_syncs": self.host_syncs,
            "probe_s": self.probe_s,
            "eval_s": self.eval_s,
            "hooks_s": self.hooks_s,
            "data_s": self.data_s,
            **{f"compile_{k}" if not k.startswith("compile") else k: v
               for k, v in self.compile.to_dict().items()},
        }  # fmt: skip


class Stopwatch:
    """Wall and CPU seconds since it was made (``elapsed() -> (wall_s, cpu_s)``)."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu
