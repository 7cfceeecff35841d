"""JAX's persistent compilation cache for runs: a rerun or a resume loads its programs instead
of compiling them again.

:func:`enable_compilation_cache` turns it on in a directory chosen, first to last, by the
``directory`` argument (the CLI's ``--cache-dir``), the environment variable
``PRECISIONLAB_CACHE_DIR``, JAX's own setting (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.jax_compilation_cache_dir``, left as it is), and the default
``$XDG_CACHE_HOME/precisionlab/jax`` (``~/.cache/precisionlab/jax``). The value ``off`` (CLI
``--no-cache``, or ``PRECISIONLAB_CACHE_DIR=off``) leaves the cache off. On GPUs, JAX also keeps
XLA's per-fusion autotuning results in the cache directory (its option
``jax_persistent_cache_enable_xla_caches``, on by default), so a rerun skips autotuning too.

Entries are keyed by the program, the JAX/XLA versions, the backend and its flags, so a stale
entry is never used; deleting the directory is always safe.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

__all__ = ["ENV", "OFF", "default_cache_dir", "enable_compilation_cache"]

#: The environment variable naming the cache directory (or ``off``).
ENV = "PRECISIONLAB_CACHE_DIR"
#: The value that turns the cache off.
OFF = "off"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/precisionlab/jax``, else ``~/.cache/precisionlab/jax``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precisionlab" / "jax"


def enable_compilation_cache(directory: str | Path | None = None) -> Path | None:
    """Turn the persistent cache on (see the module docstring); returns its directory, or None
    when it is off. Every program is cached, however fast it compiled (a run's small programs
    add up). ValueError when the directory cannot be created."""
    choice = str(directory) if directory is not None else os.environ.get(ENV, "").strip()
    if choice.lower() == OFF:
        return None
    if not choice:
        current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # the user's JAX setting wins (jax.config's options are made at run time)
        choice = current if current else str(default_cache_dir())
    path = Path(choice).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"compilation cache directory {path}: {err.strerror or err}; give another with "
            f"--cache-dir or {ENV}, or turn the cache off with --no-cache ({ENV}={OFF})"
        ) from None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
