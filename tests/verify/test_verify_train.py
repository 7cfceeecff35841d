"""Recording steps of a training run: the loop's hook and ``precisionlab run --record-steps``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from precisionlab import verify
from precisionlab.cli import main
from precisionlab.train import StepEnd, TrainConfig, train

TINY = dict(model="mlp", model_kwargs={"width": 16, "depth": 2}, batch_size=8, steps=3,
            chunk_steps=1, progress=False)  # fmt: skip


def test_hook_records_the_steps_it_is_asked_for(tmp_path):
    """Steps 1 and 3 of a delayed-scaling run: both verify, and each recorded loss is the
    loop's loss of that step (the recorder replays the train step's loss, key and casts)."""
    cfg = TrainConfig(**TINY, recipe={"name": "delayed", "amax_history_len": 4})
    hook = verify.RecordHook.for_config(cfg, tmp_path / "rec", [3, 1])
    result = train(cfg, hooks=[hook], quiet=True)
    found = verify.find_dumps(tmp_path / "rec")
    assert [p.name for p in found] == ["step_000001", "step_000003"]
    for p, step in zip(found, (1, 3), strict=True):
        rep = verify.check(p)
        assert rep.ok, rep.text()
        m = json.loads((p / "manifest.json").read_text())
        assert m["loop_loss"] == result.metrics[step - 1]["loss"]
        assert m["loop_loss_matches"] is True
    # step 3 starts from a state two updates old: its history holds two amaxes per site
    h = verify.read_dump(found[1]).arrays["state/dot_general[0]/history"]
    assert np.count_nonzero(h[:, 0]) == 2


def test_hook_refuses_what_it_cannot_record(tmp_path):
    cfg = TrainConfig(**{**TINY, "chunk_steps": 3}, recipe="mxfp8")
    hook = verify.RecordHook.for_config(cfg, tmp_path / "rec", [2])
    # a call that ran steps 1 to 3: step 2 never started a call, so it was not recorded
    end = StepEnd(step=3, steps=3, record={"loss": 1.0}, state=None, aggregates=None, last=True)
    hook._start = 0
    with pytest.raises(ValueError, match="step 2 ran inside a compiled call of several steps"):
        hook.on_step(end)
    with pytest.raises(ValueError, match="record step 9: the run has 3 steps"):
        verify.RecordHook.for_config(cfg, tmp_path / "x", [9])
    with pytest.raises(ValueError, match="microbatches = 1"):
        verify.RecordHook.for_config(TrainConfig(**TINY, microbatches=2), tmp_path / "y", [1])
    with pytest.raises(ValueError, match="step numbers >= 1, got '0'"):
        verify._hook.parse_steps("1,0")


RUN = """
kind = "train"
name = "rec"
[train]
model = "mlp"
steps = 2
batch_size = 8
model_kwargs = { width = 8, depth = 2 }
telemetry = { enabled = false }
[[variant]]
name = "fp8"
recipe = "current"
"""


def test_run_record_steps_then_verify(tmp_path, capsys):
    (tmp_path / "rec.toml").write_text(RUN)
    out = tmp_path / "run"
    argv = ["run", str(tmp_path / "rec.toml"), "--out", str(out), "--quiet", "--no-report"]
    assert main([*argv, "--record-steps", "2"]) == 0
    dumps = verify.find_dumps(out)
    assert [(p.parent.parent.name, p.name) for p in dumps] == [("00-fp8", "step_000002")]
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0
    assert "every checked tensor matches" in capsys.readouterr().out
    assert main([*argv[:2], "--out", str(tmp_path / "r2"), "--record-steps", "a"]) == 2
    assert "--record-steps: record steps are step numbers >= 1, got 'a'" in capsys.readouterr().err
