"""What XLA allocates for a jitted step, read from the compiled executable.

``jax.jit(step).lower(*args).compile()`` gives ``memory_analysis()`` (argument, output, alias
and temporary sizes in bytes, decided by XLA's buffer assignment before anything runs) and
``cost_analysis()`` (FLOPs). Where the backend offers ``device.memory_stats()`` (GPU, TPU; not
CPU), the peak bytes in use after running the step are read too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from precisionlab.memory._estimate import StepEstimate

__all__ = ["Measured", "compare_rows", "measure", "time_step"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """Sizes in bytes of one compiled step; ``None`` where the backend does not say.

    Attributes:
      arguments, outputs, aliased, temporaries: ``memory_analysis()`` sizes; ``aliased`` is the
        part of the outputs written into donated arguments.
      peak: XLA's ``peak_memory_in_bytes`` of the compiled program, if reported.
      device_peak: ``device.memory_stats()["peak_bytes_in_use"]`` after one run (process-wide).
      flops: ``cost_analysis()["flops"]``. XLA counts the body of a loop (``lax.scan``) once, so
        for scanned layers or micro-batches this is the FLOPs of one iteration.
      compile_s: seconds to lower and compile.
      backend: platform name (cpu, gpu, tpu).
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int | None
    device_peak: int | None
    flops: float | None
    compile_s: float
    backend: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flops(compiled: Any) -> float | None:
    try:
        cost = compiled.cost_analysis()
    except Exception:  # some backends do not implement it
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost or "flops" not in cost:
        return None
    return float(cost["flops"])


def _device_peak(compiled: Any, args: Sequence[Any]) -> int | None:
    device = jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    # Donation consumes the arguments: run on copies.
    copies = jax.tree_util.tree_map(lambda a: a.copy(), tuple(args))
    jax.block_until_ready(compiled(*copies))
    return int(device.memory_stats()["peak_bytes_in_use"])


def measure(
    step: Callable[..., Any],
    *args: Any,
    donate_argnums: tuple[int, ...] = (0, 1),
    run: bool = True,
) -> Measured:
    """Compile ``step(*args)`` with ``donate_argnums`` and read its sizes.

    Args:
      step: the (unjitted) function.
      args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
      donate_argnums: arguments whose buffers the outputs may reuse (params, optimizer state).
      run: run it once to read ``device.memory_stats()`` where available (needs real arrays).
    """
    start = time.perf_counter()
    compiled = jax.jit(step, donate_argnums=donate_argnums).lower(*args).compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    if stats is None:  # a backend that reports no buffer assignment
        raise ValueError(f"XLA gives no memory analysis on {jax.default_backend()}")
    peak = getattr(stats, "peak_memory_in_bytes", None)
    concrete = all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(args))
    return Measured(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        peak=None if peak is None else int(peak),
        device_peak=_device_peak(compiled, args) if run and concrete else None,
        flops=_flops(compiled),
        compile_s=compile_s,
        backend=jax.default_backend(),
    )


def time_step(
    step: Callable[..., Any],
    *args: Any,
    repeats: int = 5,
    donate_argnums: tuple[int, ...] = (0, 1),
) -> float:
    """Best-of-``repeats`` seconds per call of the jitted step (after one warm-up call); the
    minimum is the least disturbed by other processes on a shared machine.

    The step's outputs feed the next call (``(params, opt_state, batch)`` in, ``(params,
    opt_state, ...)`` out), so donated buffers are never reused.
    """
    fn = jax.jit(step, donate_argnums=donate_argnums)
    state = jax.tree_util.tree_map(lambda a: a.copy(), tuple(args))
    out = jax.block_until_ready(fn(*state))
    times = []
    for _ in range(max(1, repeats)):
        state = (out[0], out[1], *state[2:])
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*state))
        times.append(time.perf_counter() - start)
    return min(times)


def compare_rows(estimated: StepEstimate, measured: Measured) -> list[tuple[str, int, int, float]]:
    """(name, estimated bytes, measured bytes, measured / estimated) for arguments, outputs and
    temporaries."""
    rows = []
    for name in ("arguments", "outputs", "temporaries"):
        est, got = getattr(estimated, name), getattr(measured, name)
        rows.append((name, est, got, got / est if est else float("nan")))
    return rows
