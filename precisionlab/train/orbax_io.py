"""Checkpoints in Orbax's format, for other JAX tools (needs the ``orbax`` extra).

An Orbax checkpoint written here is a composite of two items:

- ``state``: the state pytree as a nested dict of arrays (``StandardSave``), keyed by the names
  of its path (``params/hidden/0/w``; a NamedTuple's fields by name, a list's items by index),
  every leaf in its own dtype (bfloat16 and float8 included), so any Orbax user can restore it
  with ``ocp.StandardCheckpointer().restore(path / "state")``;
- ``precisionlab``: JSON with the step and the caller's ``extra`` (data position, ...).

:func:`save_orbax` / :func:`load_orbax` write and read a state directly;
:func:`export_checkpoint` / :func:`import_checkpoint` convert between precisionlab's own
checkpoints (:mod:`precisionlab.train._checkpoint`) and Orbax's, bit for bit.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

__all__ = ["export_checkpoint", "import_checkpoint", "load_orbax", "save_orbax"]


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:  # optional dependency
        raise ImportError(
            "Orbax checkpoints need orbax-checkpoint: pip install 'precisionlab[orbax]'"
        ) from err
    return ocp


def _name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    raise TypeError(f"cannot name pytree path entry {entry!r}")


def _nested(tree: Any, leaf_fn: Callable[[Any], Any]) -> dict[str, Any]:
    """``tree``'s leaves as a nested dict keyed by their path names."""
    out: dict[str, Any] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not path:
            raise ValueError("the state must be a pytree with named leaves, not a bare array")
        node = out
        for entry in path[:-1]:
            node = node.setdefault(_name(entry), {})
        node[_name(path[-1])] = leaf_fn(leaf)
    return out


def _get(nested: dict[str, Any], path: Any) -> Any:
    node = nested
    for entry in path:
        node = node[_name(entry)]
    return node


def _array(x: Any) -> np.ndarray:
    x = np.asarray(jax.device_get(x))
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise TypeError("typed PRNG keys cannot be saved; store jax.random.key_data(key)")
    return x


def _absolute(directory: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(directory).expanduser().resolve()


def save_orbax(
    directory: str | os.PathLike,
    state: Any,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
) -> pathlib.Path:
    """Write ``state`` (a pytree of arrays) as an Orbax checkpoint at ``directory`` (which must
    not exist). Returns its absolute path."""
    ocp = _ocp()
    path = _absolute(directory)
    if path.exists():
        raise ValueError(f"Orbax checkpoint directory {str(path)!r} already exists")
    tree = _nested(state, _array)
    meta = {"step": int(step), "extra": extra or {}}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(
            path,
            ocp.args.Composite(
                state=ocp.args.StandardSave(tree), precisionlab=ocp.args.JsonSave(meta)
            ),
        )
    return path


def load_orbax(directory: str | os.PathLike, template: Any) -> tuple[Any, int, dict[str, Any]]:
    """Read an Orbax checkpoint written by :func:`save_orbax` into ``template``'s structure.

    Returns ``(state, step, extra)`` (numpy leaves, as :func:`load_checkpoint`). ValueError if
    a leaf is missing or its dtype or shape differs from the template's."""
    ocp = _ocp()
    path = _absolute(directory)
    if not (path / "state").is_dir():
        raise ValueError(f"no Orbax checkpoint with a 'state' item at {str(path)!r}")
    saved = ocp.StandardCheckpointer().metadata(path / "state")
    saved = getattr(saved, "item_metadata", saved)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    for p, leaf in leaves:
        name = "/".join(_name(e) for e in p)
        try:
            have = _get(saved, p)
        except (KeyError, TypeError):
            raise ValueError(f"Orbax checkpoint {str(path)!r} has no leaf {name!r}") from None
        want = np.asarray(leaf) if not hasattr(leaf, "dtype") else leaf
        if np.dtype(have.dtype) != np.dtype(want.dtype) or tuple(have.shape) != tuple(want.shape):
            raise ValueError(
                f"Orbax leaf {name!r}: {np.dtype(have.dtype).name}{list(have.shape)} does not "
                f"match the template's {np.dtype(want.dtype).name}{list(want.shape)}"
            )
    target = _nested(template, lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        got = ckptr.restore(
            path,
            ocp.args.Composite(
                state=ocp.args.StandardRestore(target), precisionlab=ocp.args.JsonRestore()
            ),
        )
    out = [np.asarray(_get(got.state, p)) for p, _ in leaves]
    meta = got.precisionlab or {}
    return (
        jax.tree_util.tree_unflatten(treedef, out),
        int(meta.get("step", 0)),
        meta.get("extra", {}),
    )


def export_checkpoint(
    checkpoint: str | os.PathLike, directory: str | os.PathLike, template: Any
) -> pathlib.Path:
    """Convert a precisionlab checkpoint (a ``step_N`` directory, or a directory of them: the
    newest) to an Orbax checkpoint at ``directory``; ``template``: a state of the same
    structure (e.g. the one the run starts from)."""
    state, step, extra = load_checkpoint(checkpoint, template)
    return save_orbax(directory, state, step=step, extra=extra)


def import_checkpoint(
    directory: str | os.PathLike, checkpoints: str | os.PathLike, template: Any
) -> pathlib.Path:
    """Convert an Orbax checkpoint written by :func:`save_orbax` into a precisionlab checkpoint
    under ``checkpoints`` (so ``precisionlab run`` can resume from it); returns its path."""
    state, step, extra = load_orbax(directory, template)
    return save_checkpoint(checkpoints, state, step=step, extra=extra, keep=None)
