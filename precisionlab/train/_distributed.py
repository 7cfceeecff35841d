"""Multi-process training on JAX's own distributed runtime (multi-controller SPMD).

Every process runs the same program: :func:`initialize` connects it to the coordinator
(``jax.distributed.initialize``) before anything touches a backend; afterwards ``jax.devices()``
lists every process's devices and the data-parallel step (:mod:`precisionlab.train._parallel`)
runs over all of them. Each process builds the same deterministic global batch and contributes
the rows of its own devices, so the data order equals a single process's.

Process 0 (:func:`is_main`) is the only writer of a run store and of checkpoints; the others
take every decision that depends on files from it (:func:`broadcast_json`,
:func:`broadcast_tree`, :func:`restore_checkpoint`), so they never read or write the run
directory. On CPU the cross-process collectives use gloo.

When a process dies, a collective waiting on it may fail at once (gloo: connection reset, a
``JaxRuntimeError``, see :func:`lost_peer`); otherwise its heartbeats stop, and after
``timeout_s`` the coordination service aborts the survivors (a C++ fatal error, not a Python
exception). ``precisionlab run`` trains in a child process and turns either into one error
line (:mod:`precisionlab.cli._supervise`).
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from precisionlab._text import check_processes
from precisionlab.train._checkpoint import latest_checkpoint, load_checkpoint

__all__ = [
    "broadcast_json",
    "broadcast_tree",
    "initialize",
    "is_main",
    "lost_peer",
    "place",
    "process_count",
    "process_index",
    "restore_checkpoint",
]


def initialize(
    coordinator: str, num_processes: int, process_id: int, *, timeout_s: int = 60
) -> None:
    """Join the distributed run: process ``process_id`` of ``num_processes``, coordinated by
    process 0 listening on ``coordinator`` (HOST:PORT).

    Call before any JAX computation (JAX raises RuntimeError otherwise). ``timeout_s`` bounds
    the wait for all processes to connect, the heartbeat silence after which a process counts
    as dead (the survivors are then aborted) and the shutdown barrier. Selects gloo for
    collectives across CPU processes.
    """
    check_processes(coordinator, num_processes, process_id, timeout_s)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
        heartbeat_timeout_seconds=timeout_s,
        shutdown_timeout_seconds=timeout_s,
    )


def is_main() -> bool:
    """Whether this process writes (process 0; True without a distributed run)."""
    return jax.process_index() == 0


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a runtime error of a multi-process run: a collective with another
    process failed (gloo: "Connection reset by peer"), so the run, not a unit, has failed."""
    return jax.process_count() > 1 and isinstance(err, jax.errors.JaxRuntimeError)


def place(tree: Any, sharding: Any) -> Any:
    """``jax.device_put(tree, sharding)``, also for a sharding over several processes' devices:
    there every process holds the same host values (the same deterministic batch, a state
    received bit for bit) and places its own devices' parts of them. ``device_put`` would
    first check that the values agree across processes, with an all-gather per leaf, and
    that check fails on a NaN (NaN != NaN): the state of a diverged run."""
    if sharding.is_fully_addressable:
        return jax.device_put(tree, sharding)

    def one(x: Any) -> jax.Array:
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree_util.tree_map(one, tree)


def process_count() -> int:
    """How many processes train together (1 without a distributed run)."""
    return jax.process_count()


def process_index() -> int:
    """This process's index in ``[0, process_count())``."""
    return jax.process_index()


def _words(x: np.ndarray) -> np.ndarray:
    # A leaf travels as its raw bytes packed into uint32 words: a sum with the other processes'
    # zeros is exact on unsigned integers (a float sum would turn -0.0 into +0.0), and uint32
    # is what JAX keeps without x64 (uint8 would be summed into a wider type, uint64 narrowed).
    raw = np.frombuffer(np.ascontiguousarray(x).tobytes(), np.uint8)
    return np.concatenate([raw, np.zeros(-raw.size % 4, np.uint8)]).view(np.uint32)


def _unwords(words: np.ndarray, like: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(words, np.uint32).view(np.uint8)[: like.nbytes]
    return raw.view(like.dtype).reshape(like.shape).copy()


def broadcast_tree(tree: Any) -> Any:
    """Process 0's values of ``tree`` (a pytree of arrays of the same shapes and dtypes on every
    process) as numpy arrays on every process, bit for bit."""
    if jax.process_count() == 1:
        return jax.tree_util.tree_map(np.asarray, tree)

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    host = [np.asarray(jax.device_get(x)) for x in leaves]
    sent = multihost_utils.broadcast_one_to_all([_words(x) for x in host])
    out = [_unwords(np.asarray(w), x) for w, x in zip(sent, host, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, out)


def broadcast_json(value: Any) -> Any:
    """Process 0's ``value`` (JSON-able; the others' is ignored) on every process, dicts in
    their key order."""
    if jax.process_count() == 1:
        return value
    # key order kept: it is meaningful (an experiment's settings order its units)
    data = json.dumps(value if is_main() else None).encode()
    (n,) = broadcast_tree([np.asarray(len(data), np.uint32)])
    buf = np.zeros(int(n), np.uint8)
    if is_main():
        buf[:] = np.frombuffer(data, np.uint8)
    (got,) = broadcast_tree([buf])
    return json.loads(got.tobytes().decode())


def restore_checkpoint(directory: Any, template: Any) -> tuple[Any, int, dict[str, Any]] | None:
    """The newest checkpoint under ``directory`` as ``(state, step, extra)``, or None.

    In a distributed run only process 0 reads the directory; the others receive its state
    bit for bit (:func:`broadcast_tree`) and never look at their file system.
    """
    if jax.process_count() == 1:
        if latest_checkpoint(directory) is None:
            return None
        return load_checkpoint(directory, template)
    found = None
    if is_main() and latest_checkpoint(directory) is not None:
        state, step, extra = load_checkpoint(directory, template)
        found = {"step": step, "extra": extra}
        template = state
    found = broadcast_json(found)
    if found is None:
        return None
    return broadcast_tree(template), int(found["step"]), found["extra"]
