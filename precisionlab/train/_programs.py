"""Compiled programs shared between runs: a small in-process cache of jitted functions keyed by
the structure of what they compute.

A run's numeric settings (learning rate, optimizer eps, loss weight, static loss scale, seeds)
are arguments of its programs (``TrainState.values``, the state's leaves), so two runs whose
structure is the same (model, policy, optimizer kind, step options, loop intervals) can run the
same jitted function: JAX then traces and compiles it once. The caller names the structure with
a hashable ``key`` (:func:`precisionlab.train._compose.program_key` for configs); a function
built for one run is reused for another only under the same key, so a key must capture
everything the function closes over except those arguments.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["MAX_PROGRAMS", "clear", "get"]

#: The most entries kept (the oldest goes first): an experiment's distinct structures, with
#: room to spare; each holds a jitted function and its compiled executables.
MAX_PROGRAMS = 64

_cache: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()
_lock = threading.Lock()


def get(key: Hashable, make: Callable[[], Any]) -> Any:
    """The entry under ``key``, made by ``make()`` the first time (thread-safe: a concurrent
    caller with the same key waits and gets the same entry)."""
    with _lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        value = make()
        _cache[key] = value
        while len(_cache) > MAX_PROGRAMS:
            _cache.popitem(last=False)
        return value


def clear() -> None:
    """Forget every entry (their functions compile again when next used)."""
    with _lock:
        _cache.clear()
