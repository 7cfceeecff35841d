"""Timing helpers shared by the benchmarks (``precisionlab bench ...``).

- :func:`time_call` runs a callable a few times after warm-up (which also compiles jitted
  functions) and waits for JAX results with ``jax.block_until_ready``, so the time covers the
  work and not only its dispatch. It returns the best and the median wall time in seconds.
- :func:`time_interleaved` times several callables in alternating rounds, so that peers
  compared as ratios see the same machine load (other processes come and go).
- :func:`copy_bandwidth` measures this machine's memory copy speed in bytes/s, counting bytes
  read plus bytes written, so a kernel that reads ``r`` and writes ``w`` bytes per element at
  ``n`` elements/s runs at ``n * (r + w) / copy_bandwidth()`` of the copy roofline.

Benchmarks report ratios between peers timed in the same run; absolute numbers depend on the
machine and on whatever else runs on it, so take the best of several repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "Timing",
    "copy_bandwidth",
    "minor_faults",
    "positive_int",
    "repeats_int",
    "time_call",
    "time_interleaved",
]


class Timing(NamedTuple):
    """Wall times of one measured callable, in seconds."""

    best: float
    median: float
    repeats: int

    def rate(self, count: float) -> float:
        """``count`` per second at the best time (e.g. elements/s)."""
        return count / self.best if self.best > 0 else float("inf")


#: Most a bench flag that counts takes (JAX reads sizes and step numbers as int32).
INT_MAX = 2**31 - 1
#: Most timed rounds (or steps per timed chunk) a benchmark runs: a benchmark takes minutes;
#: 1e18 rounds would never end.
REPEATS_MAX = 1000


def _int_in(text: str, high: int, why: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"need an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"need an integer >= 1, got {text!r}")
    if value > high:
        raise argparse.ArgumentTypeError(f"need an integer <= {high} ({why}), got {text[:40]!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type of the bench flags that count (sizes, steps, repeats): an int in
    [1, 2**31 - 1]."""
    return _int_in(text, INT_MAX, "an int32")


def repeats_int(text: str) -> int:
    """argparse type of the bench flags that repeat timed work (rounds, steps per timed chunk):
    an int in [1, :data:`REPEATS_MAX`]."""
    return _int_in(text, REPEATS_MAX, "a benchmark takes minutes")


def time_call(
    fn: Callable[..., Any], *args: Any, repeats: int = 5, warmup: int = 1, **kwargs: Any
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Each call's result is passed through ``jax.block_until_ready`` (a no-op for numpy and
    Python values) before the clock stops.

    Raises:
      ValueError: if ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args, **kwargs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
    return Timing(best=min(times), median=statistics.median(times), repeats=repeats)


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 1
) -> dict[str, Timing]:
    """Time each zero-argument callable of ``fns``, one call of each per round.

    ``warmup`` untimed rounds, then ``repeats`` timed rounds; results pass through
    ``jax.block_until_ready``. Returns a :class:`Timing` per name.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats=} {warmup=}")
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return {
        name: Timing(best=min(t), median=statistics.median(t), repeats=repeats)
        for name, t in times.items()
    }


def minor_faults(fn: Callable[[], Any]) -> int:
    """Minor page faults of this process during one call of ``fn`` (its result waited for):
    on Linux, about one per fresh 4 KiB page of output touched. -1 where not counted."""
    try:
        import resource  # noqa: PLC0415  resource exists on POSIX only
    except ImportError:  # not on this platform
        return -1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(fn())
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def copy_kernel(nbytes: int = 64 << 20) -> tuple[Callable[[], Any], int]:
    """A memcpy of ``nbytes`` into a preallocated buffer (no page faults on the output), and
    the bytes it moves (read + written), for use with :func:`time_interleaved`."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    return (lambda: np.copyto(dst, src)), 2 * nbytes


def xla_copy_kernel(nbytes: int = 64 << 20) -> tuple[Callable[[], Any], int]:
    """Like :func:`copy_kernel`, but a jitted XLA kernel (XOR with a runtime zero, so it cannot
    be optimized away) writing into a donated buffer: XLA may use several threads, where the
    numpy memcpy uses one. Returns the callable and the bytes it moves (read + written)."""
    if nbytes < 4:
        raise ValueError(f"nbytes must be >= 4, got {nbytes}")
    n = nbytes // 4
    src = jax.device_put(np.ones(n, dtype=np.uint32))
    zero = jax.device_put(np.zeros((), dtype=np.uint32))
    kernel = jax.jit(lambda x, z, out: x ^ z, donate_argnums=2, keep_unused=True)
    box = [jax.device_put(np.empty(n, dtype=np.uint32))]

    def run() -> Any:
        box[0] = kernel(src, zero, box[0])
        return box[0]

    return run, 8 * n


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """Memory copy bandwidth of this machine in bytes/s (bytes read + bytes written).

    Copies a buffer of ``nbytes`` (default 64 MiB, larger than the caches) into a
    preallocated destination, with ``numpy.copyto`` (a memcpy) and with a jitted XLA kernel,
    so page faults on a fresh output buffer are not counted; the faster of the two, best of
    ``repeats`` rounds after one warm-up round.
    """
    fns = dict(zip(("numpy", "xla"), (copy_kernel(nbytes), xla_copy_kernel(nbytes)), strict=True))
    t = time_interleaved({k: fn for k, (fn, _) in fns.items()}, repeats=repeats)
    return max(t[k].rate(moved) for k, (_, moved) in fns.items())
