"""Keep large host buffers resident between calls (glibc malloc settings for XLA on CPU; ground
floor: imports nothing of precisionlab).

Shared with the benchmarks; not part of the public API (docs/reference/public_api.txt).

Why: XLA's CPU client allocates every output with ``malloc``. glibc serves blocks above
32 MiB (and every block of a thread arena above 64 MiB) with a fresh ``mmap`` and unmaps it
on ``free``, so each whole-array call that returns a 2^24-element float32 array first
faults in 16,384 zeroed 4 KiB pages: about three quarters of the time of a decode
(``precisionlab bench codecs --whole-array`` measures it). numpy escapes most of that cost
by asking for transparent huge pages; XLA does not.

The settings, on Linux with glibc: one malloc arena (thread arenas cannot hold blocks above
64 MiB), no ``mmap`` for large blocks (they come from the heap and are reused after
``free``), and freed memory kept up to 1 GiB before it is returned to the system. They are
process-wide (a process keeps up to 1 GiB of freed heap mapped, and every thread shares one
arena), so a library must not impose them: they are opt-in. ``PRECISIONLAB_MALLOC_TUNING=1``
applies them when :mod:`precisionlab.bits` is imported; :func:`apply_malloc_tuning` applies
them on request (``precisionlab bench codecs --malloc-tuning`` does). They only reach
threads that have not allocated yet, so they take full effect when precisionlab is imported
before JAX runs its first computation. Not every call escapes the faults: XLA asks for
aligned blocks, and glibc (2.36) serves an aligned request from a freed block of the same
size only once it has merged with a free neighbour, so a loop of calls alternates between
reused and fresh outputs (``faults/call`` in the benchmark shows it).
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["apply_malloc_tuning", "malloc_tuning"]

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_FREED = 1 << 30  # bytes of freed heap kept mapped before trimming

_applied: dict[str, int] | None = None


def malloc_tuning() -> dict[str, int] | None:
    """The glibc settings applied in this process (name -> value), or None where none were."""
    return None if _applied is None else dict(_applied)


def apply_malloc_tuning() -> dict[str, int] | None:
    """Apply the settings (idempotent); returns what was applied, None where glibc is absent.
    Call it before JAX runs its first computation for full effect."""
    global _applied  # records a process-wide side effect the caller asked for
    if _applied is not None or not sys.platform.startswith("linux"):
        return malloc_tuning()
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has no mallopt tunables)
    except (OSError, AttributeError):
        return None
    settings = {"M_ARENA_MAX": 1, "M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": _KEEP_FREED}
    codes = {"M_ARENA_MAX": _M_ARENA_MAX, "M_MMAP_MAX": _M_MMAP_MAX}
    codes["M_TRIM_THRESHOLD"] = _M_TRIM_THRESHOLD
    done = {name: value for name, value in settings.items() if libc.mallopt(codes[name], value)}
    _applied = done or None
    return malloc_tuning()


if os.environ.get("PRECISIONLAB_MALLOC_TUNING", "0").strip().lower() in ("1", "true", "yes"):
    apply_malloc_tuning()
