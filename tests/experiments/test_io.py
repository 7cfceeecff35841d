"""precisionlab._io: atomic writes and strict JSON, the same in the run store and checkpoints."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from precisionlab import _io
from precisionlab.train import Aggregates, save_checkpoint
from precisionlab.train._checkpoint import load_checkpoint


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"non-standard JSON literal {name}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_are_explicit_strings():
    data = {"a": math.nan, "b": [math.inf, -math.inf, 1.5], "c": np.float32(2.0), "d": None}
    text = _io.dumps(data)
    assert _strict(text) == {"a": "nan", "b": ["inf", "-inf", 1.5], "c": 2.0, "d": None}
    back = [_io.from_json_float(v) for v in _strict(text)["b"]]
    assert back[0] == math.inf and back[1] == -math.inf and back[2] == 1.5
    assert math.isnan(_io.from_json_float("nan")) and _io.from_json_float(None) is None


def test_atomic_write_keeps_the_old_file_when_the_writer_fails(tmp_path):
    path = tmp_path / "x.json"
    _io.write_json(path, {"v": 1})
    with pytest.raises(RuntimeError), _io.atomic_open(path) as f:
        f.write('{"v": 2')
        raise RuntimeError("killed mid-write")
    assert _io.read_json(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]  # no temporary file left
    assert path.stat().st_mode & 0o644 == 0o644  # not mkstemp's private 0600


def test_checkpoint_meta_is_strict_json_and_aggregates_round_trip(tmp_path):
    # Checkpoints used to write the literal Infinity (not JSON) while the run store wrote "inf".
    agg = Aggregates()  # running_min and min_loss_scale are inf, final_loss nan
    state = {"w": jnp.arange(3.0)}
    path = save_checkpoint(tmp_path, state, step=1, extra={"aggregates": agg.to_dict()})
    meta = _strict((path / "meta.json").read_text())
    assert meta["extra"]["aggregates"]["running_min"] == "inf"
    _, step, extra = load_checkpoint(tmp_path, state)
    back = Aggregates.from_dict(extra["aggregates"])
    assert step == 1 and back.running_min == math.inf and back.max_loss_scale == -math.inf
    assert math.isnan(back.final_loss) and back.evals == ()


def test_jsonl_reader_ignores_a_torn_last_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    with _io.JsonlWriter(path) as w:
        w.write({"loss": math.nan})
    path.write_text(path.read_text() + '{"loss": 1')
    assert _io.read_jsonl(path) == [{"loss": "nan"}]
