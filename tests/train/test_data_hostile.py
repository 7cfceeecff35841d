"""Hostile data files: an npz member that is not an array is never read; text data reads at most
max_bytes."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest
from _tiny_runs import workdir


@pytest.fixture
def work(tmp_path, monkeypatch):
    return workdir(tmp_path, monkeypatch, {})


def test_c5_an_npz_member_that_is_not_an_array_is_never_read(work):
    from precisionlab import survey

    path = work / "x.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("a.npy", "w") as f:
            np.save(f, np.arange(8, dtype=np.float32))
        archive.writestr("junk.bin", b"\0" * (8 << 20))  # compresses to a few KB
    got = survey.load_inputs(path)
    assert list(got) == ["x:a"] and got["x:a"].tolist() == list(range(8))


def test_w5_text_data_reads_only_max_bytes(work):
    from precisionlab.train._data.text import TextData

    big = work / "big.txt"
    with open(big, "wb") as f:
        f.write(b"hello world\n" * 10_000)
        f.truncate(16 << 30)  # 16 GiB, sparse: NUL bytes past the text (binary if read)
    data = TextData(path=str(big), max_bytes=1 << 16, seq_len=16)
    info = data.describe()
    assert info["bytes"] == 1 << 16 and info["truncated"]
    with pytest.raises(ValueError, match="path is empty"):
        TextData(path="", max_bytes=1 << 16, seq_len=16)
