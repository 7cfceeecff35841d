"""Checkpoint files on disk: a killed write leaves nothing behind, a FIFO or an oversized array
file is refused."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest


def test_a_killed_checkpoint_write_leaves_no_temporary_directory(tmp_path):
    """Why: a checkpoint write killed midway left a .tmp_ckpt_* directory behind for good."""
    from precisionlab.train._checkpoint import list_checkpoints, save_checkpoint

    partial = tmp_path / ".tmp_ckpt_deadbeef"
    partial.mkdir()
    (partial / "arrays.npz").write_bytes(b"PK")
    save_checkpoint(tmp_path, {"w": np.arange(3.0)}, step=4)
    assert sorted(os.listdir(tmp_path)) == ["step_00000004"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004"]


def test_a_fifo_for_a_checkpoint_array_file_is_an_error_not_a_hang(tmp_path):
    """Why: a FIFO in place of a checkpoint's arrays.npz made `run --resume` hang for ever
    (np.load opened it directly, not through precisionlab._io)."""
    from precisionlab import _io
    from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

    state = {"w": np.arange(3.0, dtype=np.float32)}
    path = save_checkpoint(tmp_path, state, step=1)
    (path / "arrays.npz").unlink()
    os.mkfifo(path / "arrays.npz")
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(_catch(lambda: load_checkpoint(tmp_path, state))),
        daemon=True,
    )
    thread.start()
    thread.join(20)
    assert result, "load_checkpoint hung on a FIFO"
    assert isinstance(result[0], _io.UnsafePathError) and "is a FIFO" in str(result[0])


def test_a_checkpoint_array_file_larger_than_its_arrays_is_refused(tmp_path):
    from precisionlab import _io
    from precisionlab.train._checkpoint import load_checkpoint, save_checkpoint

    state = {"w": np.arange(3.0, dtype=np.float32)}
    path = save_checkpoint(tmp_path, state, step=1)
    with open(path / "arrays.npz", "ab") as f:
        f.write(b"\0" * (1 << 20))
    with pytest.raises(_io.UnsafePathError, match="larger than"):
        load_checkpoint(tmp_path, state)
    (path / "arrays.npz").write_bytes(b"not a zip")
    with pytest.raises(_io.DamagedFileError, match="damaged checkpoint"):
        load_checkpoint(tmp_path, state)
    got, step, _ = load_checkpoint(save_checkpoint(tmp_path, state, step=2), state)
    assert step == 2 and got["w"].tolist() == [0.0, 1.0, 2.0]


def _catch(fn):
    try:
        return fn()
    except Exception as err:  # the test inspects it
        return err
