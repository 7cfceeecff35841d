"""The REINFORCE study (precisionlab.consistency._rl): the matched sampler is on-policy (its
recorded log-probabilities are the trainer's), the decode sampler is not, the runs share
their first batch, and the experiment writes the study's table and plot."""

import copy

import numpy as np
import pytest

from precisionlab.consistency._rl import RLConfig, reinforce

TINY = RLConfig(vocab=4, length=3, d_model=8, depth=1, heads=2, batch=8, steps=2, kv_block=2)
EXPERIMENT = {
    "formats": ["bf16"],
    "eval_rows": 2,
    "attribution": [],
    "plots": True,
    "train": {
        "model": "transformer",
        "model_kwargs": {"d_model": 8, "depth": 1, "heads": 2},
        "data": "text",
        "data_kwargs": {"seq_len": 4, "max_bytes": 8192},
        "steps": 2,
        "batch_size": 2,
        "eval_batches": 1,
        "telemetry": {"enabled": False},
    },
    "setups": {"cpu": {"trainer": {}, "sampler": {"mode": "decode"}}},
}


@pytest.mark.slow  # compiles three bf16 programs with gradients (~9 CPU s); the default suite
# checks the settings below and the experiment's REINFORCE code under -m slow too
def test_matched_is_on_policy_and_decode_is_not():
    (m,) = reinforce("bf16", "matched", TINY)
    (d,) = reinforce("bf16", "decode+tis", TINY)
    keys = {"format", "sampler", "seed", "reward", "mismatch_rms", "mismatch_max",
            "clip_share", "tis_change", "noise", "final_reward"}  # fmt: skip
    assert set(m) == keys and len(m["reward"]) == TINY.steps
    # the matched sampler samples from the trainer's own program: its log-probabilities are
    # the trainer's up to float32 rounding of the log-softmax (the gradient program's
    # forward pass is another compilation of the same computation)
    assert max(m["mismatch_max"]) < 1e-5
    assert d["mismatch_rms"][0] > 100 * m["mismatch_rms"][0] > 0 or d["mismatch_rms"][0] > 1e-4
    # the same initial weights and noise: the first batch is the same tokens, so its reward
    assert m["reward"][0] == d["reward"][0]
    assert 0 <= d["clip_share"][0] <= 1 and d["noise"][0] > 0
    assert d["tis_change"][0] > 0


def test_bad_settings():
    with pytest.raises(ValueError, match=r"RLConfig\.vocab"):
        RLConfig(vocab=1)
    with pytest.raises(ValueError, match=r"RLConfig\.lr"):
        RLConfig(lr=0)
    with pytest.raises(ValueError, match="unknown sampler"):
        reinforce("bf16", "greedy", TINY)
    with pytest.raises(ValueError, match="must be even"):
        reinforce("bf16", "decode", RLConfig(batch=3, steps=1))


@pytest.mark.slow  # trains and scores a model and runs the study (~20 CPU s); the study
# itself is tested above, the experiment's other parts in test_consistency_experiment.py
def test_the_experiment_runs_the_study(tmp_path):
    from precisionlab.experiments import _mismatch_kind as mismatch_kind

    table = copy.deepcopy(EXPERIMENT)
    table["rl"] = {"enabled": True, "formats": ["bf16"], "samplers": ["matched", "decode"],
                   "seeds": 1, "steps": 2, "vocab": 4, "length": 3, "d_model": 8, "depth": 1,
                   "heads": 2, "batch": 8, "kv_block": 2}  # fmt: skip
    out = mismatch_kind.run(table, tmp_path, quiet=True)
    groups = out["rl"]["groups"]
    assert [(g["format"], g["sampler"]) for g in groups] == [("bf16", "matched"),
                                                            ("bf16", "decode")]  # fmt: skip
    assert (tmp_path / "rl.jsonl").is_file() and (tmp_path / "rl_reward.png").is_file()
    report = (tmp_path / "report.md").read_text()
    assert "## The consequence: REINFORCE" in report and "update change by TIS" in report
    assert np.isfinite(groups[1]["mismatch_rms"])
