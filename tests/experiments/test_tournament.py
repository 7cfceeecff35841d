"""The tournament experiment kind: its schema, its plan, its statistics (on hand-made unit
files, checked against hand-computed intervals), and (slow) the quick tournament end to end,
killed and resumed."""

import math
import pathlib
import shutil

import numpy as np
import pytest

from precisionlab.experiments import _store as store
from precisionlab.experiments import _tournament as tournament
from precisionlab.experiments import _tournament_report as report
from precisionlab.experiments._config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = {"model": "transformer", "data": "markov", "steps": 4, "batch_size": 2,
         "model_kwargs": {"d_model": 16, "depth": 1, "heads": 2}}  # fmt: skip


def _section(**kw):
    entries = kw.pop("entry", [{"name": "bf16"}, {"name": "nvidia_fp4",
                                                   "formats": ["nvfp4", "mxfp4"]}])  # fmt: skip
    return tournament.validate({"train": TRAIN, "entry": entries, **kw}, "t.toml: tournament")


def test_validate_fills_defaults_and_plans_entry_format_seed():
    s = _section(seeds=[0, 5, 9], eval_every=2, stats_every=4)
    assert s["match_fraction"] == 0.5 and s["layers"] == "linear"
    units = tournament.plan(s)
    # seed-major: a run stopped early has every variant from its first seeds
    assert [u.id for u in units[:4]] == [
        "bf16-s0", "nvidia_fp4-nvfp4-s0", "nvidia_fp4-mxfp4-s0", "bf16-s5"
    ]  # fmt: skip
    assert len(units) == 9 and units[-1].id == "nvidia_fp4-mxfp4-s9"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"entry": [{"name": "bf16"}, {"name": "quartet9"}]}, "entry[1].name: unknown recipe"),
        ({"entry": [{"name": "bf16"}, {"name": "quartet", "formats": ["nvfp4"]}]},
         "quartet runs on mxfp4, not 'nvfp4'"),
        ({"entry": [{"name": "bf16"}, {"name": "current", "formats": ["nvfp4"]}]},
         "only the FP4 recipes take formats"),
        ({"entry": [{"name": "nvidia_fp4"}]}, "baseline: 'bf16' is not an entry"),
        ({"seeds": [1, 1]}, "seeds: give distinct seeds"),
        ({"eval_every": 3, "stats_every": 4}, "stats_every: must be a multiple of eval_every"),
        ({"entry": [{"name": "bf16"}, {"name": "quartet2", "fields": {"block": 8}}]},
         "entry[1].fields: recipe 'quartet2' has no field"),
        ({"layers": "some"}, "layers"),
    ],
)  # fmt: skip
def test_validate_names_what_is_wrong(bad, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _section(**bad)


def test_the_train_table_may_not_set_seed_or_recipe():
    with pytest.raises(ConfigError, match=r"train.seed: set by the tournament"):
        tournament.validate({"train": {**TRAIN, "seed": 3}, "entry": [{"name": "bf16"}]}, "t")


def test_ci95_is_the_student_t_interval():
    m, _, hi = report.ci95([0.10, 0.12, 0.14])
    sd = np.std([0.10, 0.12, 0.14], ddof=1)
    assert m == pytest.approx(0.12)
    assert hi - m == pytest.approx(4.303 * sd / math.sqrt(3))  # t(0.975, 2 df)
    assert report.ci95([0.3]) == (0.3, None, None)
    assert report.ci95([]) == (None, None, None)


def _write_unit(out, unit, loss, curve, stats=()):
    d = out / "units" / unit.id
    store.makedirs(d)
    store.write_json(d / "result.json", {"final_eval_loss": loss, "tokens": curve[-1][0],
                                         "wall_s": 1.0, "cpu_s": 2.0, "params": 100,
                                         "diverged": False})  # fmt: skip
    with store.JsonlWriter(d / "evals.jsonl") as w:
        for i, (t, l_) in enumerate(curve):
            w.write({"step": i + 1, "tokens": t, "eval_loss": l_})
    with store.JsonlWriter(d / "stats.jsonl") as w:
        for r in stats:
            w.write(r)


def test_summary_gaps_intervals_tokens_to_match_and_claims(tmp_path):
    s = _section()
    units = tournament.plan(s)  # seeds 0, 1, 2; bf16, nvidia nvfp4, nvidia mxfp4
    base = {0: 2.00, 1: 2.10, 2: 2.05}
    nv = {0: 2.02, 1: 2.13, 2: 2.06}  # gaps 0.02, 0.03, 0.01
    mx = {0: 2.20, 1: 2.31, 2: 2.24}  # gaps 0.20, 0.21, 0.19
    curves = {"bf16": [(100, 3.0), (200, 2.0)], "nvidia_fp4-nvfp4": [(100, 3.2), (200, 2.0)],
              "nvidia_fp4-mxfp4": [(100, 3.5), (200, 2.5)]}  # fmt: skip
    wgrad = [{"step": 2, "site": "all", "gemm": g, "norm": 1.0, "rel_bias": 0.0,
              "rel_var": 0.01, "cosine": 0.99, "ratio": 1.5 if g == "wgrad" else 9.0}
             for g in ("fprop", "dgrad", "wgrad")]  # fmt: skip
    for u in units:
        loss = {"bf16": base, "nvidia_fp4-nvfp4": nv, "nvidia_fp4-mxfp4": mx}[u.variant][u.seed]
        _write_unit(tmp_path, u, loss, curves[u.variant], wgrad if "fp4" in u.variant else ())
    out = report.summarize(s, units, tmp_path, measure_quantizers=False)
    v = out["variants"]["nvidia_fp4-nvfp4"]
    assert v["gap_nats"] == pytest.approx(0.02)
    half = 4.303 * np.std([0.02, 0.03, 0.01], ddof=1) / math.sqrt(3)
    assert v["ci95_high"] == pytest.approx(0.02 + half)
    assert v["significant"] is False  # 3 seeds, spread 0.01: the interval holds 0
    assert out["variants"]["nvidia_fp4-mxfp4"]["significant"] is True
    # target: the baseline's mean curve at 50% of 200 tokens = 3.0 (100 tokens); nvfp4's curve
    # 3.2 -> 2.0 crosses 3.0 at 100 + 100 * 0.2 / 1.2 tokens; mxfp4's 3.5 -> 2.5 at 150
    assert out["match_loss"] == pytest.approx(3.0)
    assert v["tokens_to_match"] == pytest.approx(100 + 100 * 0.2 / 1.2)
    assert out["variants"]["nvidia_fp4-mxfp4"]["tokens_to_match"] == pytest.approx(150)
    assert out["variants"]["nvidia_fp4-mxfp4"]["tokens_to_match_vs_baseline"] == 1.5
    assert [r["variant"] for r in out["ranking"]] == ["bf16", "nvidia_fp4-nvfp4",
                                                       "nvidia_fp4-mxfp4"]  # fmt: skip
    assert out["ranking"][1]["vs_next"]["significant"] is True
    pair = out["claims"]["nvfp4_gap_below_mxfp4"]["pairs"][0]
    assert pair["nvfp4_minus_mxfp4"] == pytest.approx(-0.18) and pair["verdict"] == "reproduced"
    assert out["claims"]["sqrt3_crossing"]["crossing_step"]["nvidia_fp4-nvfp4"] == 2
    md = report.report_markdown(out)
    assert "| 2 | nvidia_fp4-nvfp4 | +0.020 |" in md and "reproduced" in md
    assert "quantizer-level claims (MS-EDEN, SR, Hadamard): not measured" in md


@pytest.mark.slow  # the quantizer claims draw many quantizations (a minute of CPU)
def test_quantizer_claims_reproduce_the_papers():
    c = report.quantizer_claims(rows=64, cols=512, draws=32)
    assert c["ms_eden_vs_sr"]["reproduced"] and c["sr_unbiased"]["reproduced"]
    assert c["hadamard_lowers_sr_variance"]["reproduced"]


@pytest.mark.slow  # 8 units of a tiny model, then a resumed unit: minutes of CPU
def test_the_quick_tournament_runs_and_resumes(tmp_path):
    from precisionlab.experiments import _runner as runner

    run_dir = runner.run_file(ROOT / "experiments" / "fp4_tournament_quick.toml",
                              out=tmp_path / "run", quiet=True)  # fmt: skip
    out = run_dir / "tournament"
    summary = store.read_json(out / "tournament.json")
    assert summary["units_done"] == summary["units_total"] == 8
    for name in ("report.md", "loss_curves.png", "gaps.png", "gemm_stats.png"):
        assert (out / name).exists()
    for v in summary["variants"].values():
        for key in ("gap_nats", "ci95_low", "ci95_high", "seeds", "tokens_to_match"):
            assert key in v
    assert summary["variants"]["tetrajet_v2"]["gemm_stats"]["steps"] == [8]
    # a kill in the middle of a unit: its result goes, its last checkpoint stays
    unit = out / "units" / "tetrajet_v2-s1"
    before = store.read_json(unit / "result.json")
    (unit / "result.json").unlink()
    (run_dir / "summary.json").unlink()  # killed before the run's end
    shutil.rmtree(unit / "checkpoints" / "step_00000008")
    runner.resume(run_dir, quiet=True)
    after = store.read_json(unit / "result.json")
    assert after["resumed_from"] == 4  # from its checkpoint, state (OutControl, OsciReset) too
    assert after["final_eval_loss"] == before["final_eval_loss"]  # bit for bit
    assert [r["step"] for r in store.read_jsonl(unit / "evals.jsonl")] == [4, 8]
