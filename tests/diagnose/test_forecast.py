"""The divergence forecaster (issue 37, items 2-4): its rules, the ground truth, fitting,
evaluation against the baselines, ``diagnose --forecast`` and the live option of
``precisionlab run``, on run directories written here by hand (no training: every expected
value below is counted by hand from the rows written).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from precisionlab.cli import main
from precisionlab.diagnose._forecast import (
    Outcome,
    UnitRun,
    evaluate,
    fit,
    forecast_unit,
    ground_truth,
    load_run,
    outcome,
    run_forecast,
    te_model,
)
from precisionlab.experiments import _store as store
from precisionlab.train._forecast import Forecaster, ForecastHook, Rule, load_model, slope

META16 = {"compute": "float16", "params": "float32", "recipe": None, "weight_bits": 16}
META32 = {"compute": "float32", "params": "float32", "recipe": None, "weight_bits": 16}


def _row(step, headroom, amax=100.0, kurt=3.0, meta=META16, layers=("a", "b")):
    n = len(layers)
    return {
        "step": step,
        "layers": list(layers),
        "signals": {
            "headroom": [headroom] + [20.0] * (n - 1),
            "amax": [amax] + [1.0] * (n - 1),
            "kurtosis": [kurt] * n,
            "q_underflow": [0.0] * n,
            "q_mse": [0.0] * n,
        },
        "meta": meta,
        "loss_scale": 1.0,
    }


def _model(threshold=1.0, debounce=2):
    rule = dict(mechanism="fp16-overflow", signal="headroom", feature="value", op="<",
                threshold=threshold, requires="fp16", lead=50.0)  # fmt: skip
    return {"rules": [rule], "debounce": debounce, "window": 5}


def test_slope_by_hand():
    assert slope([0, 10, 20], [1.0, 2.0, 3.0]) == pytest.approx(0.1)
    assert slope([0], [1.0]) is None and slope([5, 5], [1.0, 2.0]) is None
    assert slope([0, 1, 2], [1.0, None, 3.0]) == pytest.approx(1.0)  # a missing value is skipped


def test_rule_fires_after_debounce_names_layer_and_extrapolates():
    f = Forecaster(_model())
    # headroom of layer a: 4, 3, 0.8, 0.6 binades; amax doubles every 10 steps (0.1 binade/step)
    rows = [_row(10 * i, h, amax=100.0 * 2**i) for i, h in enumerate([4.0, 3.0, 0.8, 0.6])]
    got = [f.update(r) for r in rows]
    assert got[:3] == [None, None, None]  # 0.8 < 1 holds once: debounce 2 waits
    alarm = got[3]
    assert alarm is not None and f.alarm is alarm
    assert (alarm.step, alarm.mechanism, alarm.layer) == (30, "fp16-overflow", "a")
    # 0.6 binades left at 0.1 binade per step (least squares over the 4 rows): about 6 steps
    assert alarm.within == 6
    assert "headroom = 0.6 < 1 in a for 2 records" in alarm.evidence
    assert alarm.message().startswith("likely to diverge within about 6 steps; layer a; ")
    assert f.update(_row(40, 0.1)) is None and f.alarm is alarm  # the first alarm is kept
    # the score: the largest ratio of a rule's signal to its threshold (1 / 0.6 here)
    assert f.scores[3] == (30, pytest.approx(1 / 0.6))


def test_rule_needs_its_run_property_and_a_threshold():
    f = Forecaster(_model())
    for i in range(4):  # a float32 run: the fp16 rule does not apply
        assert f.update(_row(i, 0.0, meta=META32)) is None
    off = Forecaster(_model(threshold=None))
    assert all(off.update(_row(i, 0.0)) is None for i in range(4))
    r = Rule("x", "headroom", "value", ">", 2.0)
    assert r.holds(3.0) and not r.holds(2.0) and not r.holds(None) and not r.holds(math.nan)
    assert r.ratio(4.0) == 2.0


def _unit(uid, setting, variant, seed, losses, rows=(), diverged_at=None):
    return UnitRun(uid, f"{setting}/{variant} s{seed}", setting, variant, seed, list(losses),
                   diverged_at, list(rows), len(losses))  # fmt: skip


def test_outcome_diverged_stalled_and_not_precision():
    ref = _unit("r", "s", "fp32", 0, [2.0] * 100)
    # non-finite at step 61: diverged there, a precision failure (the reference trained)
    div = _unit("d", "s", "fp16", 0, [2.0] * 60 + [None] * 40)
    assert outcome(div, ref) == Outcome("diverged", 61, True)
    # 15% above the reference from step 41 to the end (window 1: no smoothing)
    stall = _unit("t", "s", "fp16", 0, [2.0] * 40 + [2.3] * 60)
    assert outcome(stall, ref, margin=0.1, window=1) == Outcome("stalled", 41, True)
    # 5% above: within the margin; 15% above but back at the end: not a stall
    assert outcome(_unit("u", "s", "x", 0, [2.1] * 100), ref, window=1).kind == ""
    back = _unit("v", "s", "x", 0, [2.3] * 90 + [2.0] * 10)
    assert outcome(back, ref, window=1).kind == ""
    # the reference diverges too: not a precision failure
    ref_div = _unit("r2", "s", "fp32", 0, [2.0] * 58 + [None] * 42)
    assert outcome(div, ref_div) == Outcome("diverged", 61, False)
    assert outcome(ref_div, ref_div) == Outcome("diverged", 59, False)


def test_fit_picks_the_separating_threshold_and_evaluate_counts_by_hand():
    # fp16 failing runs: headroom falls to 0.5 from step 20 on, failure at step 100;
    # fp16 controls: headroom stays at 2 or more; all fail/pass against fp32 references
    def rows(hs):
        return [_row(10 * i, h) for i, h in enumerate(hs)]

    ref = [2.0] * 120
    units = [
        _unit("f1", "m-s", "fp16", 0, [2.0] * 99 + [None] * 21, rows([5, 3, 0.5, 0.5, 0.5])),
        _unit("f2", "m-s", "fp16", 1, [2.0] * 99 + [None] * 21, rows([5, 2.5, 0.4, 0.4, 0.3])),
        _unit("c1", "c-s", "fp16", 0, ref, rows([5, 3, 2.0, 2.2, 2.1])),
        _unit("r1", "m-s", "fp32", 0, ref), _unit("r2", "m-s", "fp32", 1, ref),
        _unit("r3", "c-s", "fp32", 0, ref),
    ]  # fmt: skip
    truth = ground_truth(units, "fp32", window=1)
    assert [truth[u].precision for u in ("f1", "f2", "c1", "r1")] == [True, True, False, False]
    model = fit(units, truth, rules=[("fp16-overflow", "headroom", "value", "<", "fp16")])
    (rule,) = model["rules"]
    # any threshold in (0.5, 2.0] separates; the search keeps a candidate beside an observed value
    assert 0.5 < rule["threshold"] <= 2.0
    # alarms at step 30 (second record below): leads 100 - 30 = 70 for both
    assert rule["lead"] == 70.0
    alarms = {u.id: forecast_unit(u, model).alarm for u in units}
    scores, table = evaluate("forecaster", units, truth, alarms, {"m-s": ["a"]})
    assert (scores.tp, scores.fp, scores.fn, scores.positives) == (2, 0, 0, 2)
    assert scores.precision == 1.0 and scores.recall == 1.0 and scores.median_lead == 70.0
    assert scores.median_lead_fraction == pytest.approx(0.7)
    assert scores.layer_share == 1.0 and scores.layer_checked == 2
    assert [r["verdict"] for r in table] == ["TP", "TP", "TN", "TN", "TN", "TN"]
    # TE's thresholds never switch a run without a recipe (q statistics are 0)
    te = {u.id: forecast_unit(u, te_model()).alarm for u in units}
    assert all(a is None for a in te.values())


def test_live_hook_prints_the_first_alarm_once():
    said = []
    hook = ForecastHook(META16, label="unit", say=said.append, model=_model())

    class End:
        def __init__(self, rec):
            self.record = rec

    for i, h in enumerate([4.0, 0.5, 0.5, 0.4]):
        row = _row(10 * i, h)
        row.pop("meta")
        hook.on_step(End({"step": 10 * i, "predictors": row}))
        hook.on_step(End({"step": 10 * i + 1}))  # a step without predictors: nothing
    assert len(said) == 1 and said[0].startswith("forecast: unit: step 20: likely to diverge")


def test_frozen_model_ships_with_the_package():
    model = load_model()
    assert model["rules"] and {"debounce", "window"} <= set(model)
    assert all({"mechanism", "signal", "threshold"} <= set(r) for r in model["rules"])


# --- a run directory written by hand, and the command line ---------------------------------


def _write_run(root: Path) -> Path:
    """A run directory as ``precisionlab run`` leaves it: two settings (-s fits, -m is judged),
    an fp16 variant that diverges at step 100 after its headroom fell, and fp32 references."""
    units, recs = [], []
    for setting, seed in (("fp16-overflow-s", 0), ("fp16-overflow-m", 2)):
        for variant in ("fp32", "fp16"):
            uid = f"{len(recs):02d}-{setting}-{variant}-s{seed}"
            recs.append({"id": uid, "name": f"{setting}/{variant} s{seed}", "setting": setting,
                         "variant": variant, "seed": seed, "params": {"steps": 120}})  # fmt: skip
            fail = variant == "fp16"
            udir = root / "variants" / uid
            udir.mkdir(parents=True)
            n = 100 if fail else 120
            metrics = [
                {"step": s, "loss": "nan" if fail and s == 100 else 2.0} for s in range(1, n + 1)
            ]
            store._io.write_jsonl(udir / "metrics.jsonl", metrics)
            hs = [6, 4, 2, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1] if fail else [60.0] * 12
            rows = [_row(1 + 10 * i, h, meta=META16 if fail else META32) for i, h in enumerate(hs)]
            store._io.write_jsonl(udir / "predictors.jsonl", rows)
            units.append(uid)
    diag = {"forecast_reference": "fp32", "forecast_fit": ["*-s"], "forecast_margin": 0.1}
    store.write_json(
        root / "config.json", {"document": {}, "resolved": {"units": recs, "diagnose": diag}}
    )
    return root


def test_run_forecast_on_a_run_directory(tmp_path):
    run = _write_run(tmp_path / "run")
    units, _ = load_run(run)
    assert [len(u.rows) for u in units] == [12, 10, 12, 10] and units[1].losses[99] is None
    result = run_forecast(run, model=_model())
    fp16 = [u for u in result["units"] if u["variant"] == "fp16"]
    # headroom below 1 at the 4th and 5th records (steps 31, 41): the alarm at 41
    assert [u["alarm"]["step"] for u in fp16] == [41, 41]
    assert all(u["failure"] == "diverged" and u["failure_step"] == 100 for u in fp16)
    ev = result["evaluation"]["forecaster"]["scores"]
    assert (ev["tp"], ev["fp"], ev["fn"], ev["median_lead"]) == (1, 0, 0, 59.0)
    assert set(result["evaluation"]) == {"forecaster", "kurtosis alone", "TE AutoswitchGemm"}


def test_cli_forecast_writes_json_and_report(tmp_path, capsys):
    run = _write_run(tmp_path / "run")
    model = tmp_path / "model.json"
    model.write_text(json.dumps(_model()))
    argv = ["diagnose", "--forecast", str(run), "--model", str(model), "--no-bisect", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fp16-overflow-m/fp16 s2: step 41: likely to diverge within about" in out
    assert "forecaster" in out and (run / "forecast.json").exists()
    report = (run / "forecast.md").read_text()
    assert "| forecaster | 1.00 | 1.00 | 1 (1+0) | 59 |" in report
    # --fit refits on the -s settings and writes the fitted model beside the report
    assert main(["diagnose", "--forecast", str(run), "--fit", "--no-bisect", "--quiet"]) == 0
    fitted = json.loads((run / "forecast_model.json").read_text())
    rule = next(r for r in fitted["rules"] if r["signal"] == "headroom")
    assert rule["threshold"] is not None and 0.4 < rule["threshold"] < 60


def test_forecast_command_takes_typed_options(tmp_path):
    """The library call behind ``diagnose --forecast``: its options are a typed object (a bad
    value or an unknown name raises); a given model replaces the frozen one, and ``fit`` writes
    the refitted model beside the report."""
    from precisionlab.diagnose import ForecastOptions, forecast_command

    run = _write_run(tmp_path / "run")
    model = tmp_path / "model.json"
    model.write_text(json.dumps(_model()))
    path, result, text = forecast_command(run, ForecastOptions(model=model, bisect=False))
    assert path == run / "forecast.md" and result == json.loads((run / "forecast.json").read_text())
    assert "fp16-overflow-m/fp16 s2: step 41: likely to diverge within about" in text
    assert not (run / "forecast_model.json").exists()
    # the frozen model raises no alarm on this short synthetic run: the option has effect
    _, frozen, _ = forecast_command(run, ForecastOptions(bisect=False))
    assert [u["alarm"] is None for u in result["units"]] == [True, False, True, False]
    assert all(u["alarm"] is None for u in frozen["units"])
    forecast_command(run, ForecastOptions(fit=True, bisect=False))
    assert (run / "forecast_model.json").exists()
    with pytest.raises(ValueError, match="quick and overrides apply to an experiment file"):
        forecast_command(run, ForecastOptions(quick=True))
    with pytest.raises(ValueError, match="quick and overrides apply to an experiment file"):
        forecast_command(run, overrides=["train.steps=3"])
    with pytest.raises(TypeError, match="fit must be True or False, got 'yes'"):
        ForecastOptions(fit="yes")
    with pytest.raises(TypeError, match="model must be a path or None, got int"):
        ForecastOptions(model=3)
    with pytest.raises(TypeError, match="model_path"):
        ForecastOptions(model_path="m.json")


def test_cli_forecast_bad_input_is_one_line(tmp_path, capsys):
    assert main(["diagnose", "--forecast", str(tmp_path / "nope")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    assert main(["diagnose", "--forecast", str(tmp_path), "--tolerance", "1"]) == 2
    assert "--tolerance applies to --bisect" in capsys.readouterr().err
    assert main(["diagnose", "--forecast", str(tmp_path)]) == 2
    assert "not a run directory (no config.json)" in capsys.readouterr().err
    assert main(["diagnose", "x.toml", "--bisect", "a", "b", "--fit"]) == 2
    assert "--fit applies to --forecast" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path), "--forecast"]) == 2
    assert "apply to a new run" in capsys.readouterr().err


def test_a_setting_runs_its_own_seeds(tmp_path):
    from precisionlab.experiments._config import load_experiment

    path = tmp_path / "e.toml"
    path.write_text(
        'kind = "train"\nseeds = [7]\n[train]\nsteps = 5\n'
        "[settings.a-s]\nseeds = [0, 1]\n[settings.b-m]\nlr = 0.01\n"
        '[[variant]]\nname = "fp32"\n'
    )
    e = load_experiment(path)
    assert [(u.setting, u.seed) for u in e.units] == [("a-s", 0), ("a-s", 1), ("b-m", 7)]
    assert [u.name for u in e.units] == ["a-s/fp32 s0", "a-s/fp32 s1", "b-m/fp32 s7"]
    assert e.resolved["setting_seeds"] == {"a-s": [0, 1]}
    e2 = load_experiment(path, ["settings.b-m.seeds=[3]"])
    assert [u.seed for u in e2.units] == [0, 1, 3]
    # the suite: fitting and judged settings never share a seed
    suite = load_experiment(Path(__file__).parents[2] / "experiments" / "divergence_suite.toml")
    fit_seeds = {u.seed for u in suite.units if u.setting.endswith("-s")}
    eval_seeds = {u.seed for u in suite.units if u.setting.endswith("-m")}
    assert fit_seeds == {0, 1} and eval_seeds == {2, 3} and len(suite.units) >= 24


@pytest.mark.slow  # trains 4 units of 200 steps with the predictors (~35 CPU s)
def test_quick_subset_of_the_suite_runs_and_evaluates(tmp_path, capsys):
    suite = Path(__file__).parents[2] / "experiments" / "divergence_suite.toml"
    out = tmp_path / "quick"
    argv = ["diagnose", "--forecast", str(suite), "--quick", "--out", str(out), "--quiet"]
    assert main(argv) == 0
    result = json.loads((out / "forecast.json").read_text())
    assert [u["unit"] for u in result["units"]] == [
        "fp16-overflow-s/fp32 s0", "fp16-overflow-s/fp16 s0",
        "fp16-overflow-m/fp32 s2", "fp16-overflow-m/fp16 s2",
    ]  # fmt: skip
    # every 10 steps of 200, up to the divergence where the run stopped there (fp16 at the
    # larger size overflows at 150-160 steps of the 150-step warm-up)
    for u in result["units"]:
        last = 200 if u["failure"] != "diverged" else u["failure_step"]
        assert u["records"] == (last - 1) // 10 + 1, u
    assert [u["failure"] for u in result["units"]].count("diverged") >= 1
    assert set(result["evaluation"]) == {"forecaster", "kurtosis alone", "TE AutoswitchGemm"}
    rows = [json.loads(x) for x in (out / "variants").glob("*fp16-s0/predictors.jsonl")
            .__next__().read_text().splitlines()]  # fmt: skip
    assert rows[0]["meta"]["compute"] == "float16" and rows[0]["layers"][0] == "layer0"


@pytest.mark.slow  # trains one unit
def test_run_forecast_prints_the_live_alarm(tmp_path, capfd):
    exp = tmp_path / "e.toml"
    exp.write_text(
        'kind = "train"\n[train]\nmodel = "mlp"\ndata_kwargs = { input_scale = 12.0 }\n'
        'model_kwargs = { width = 32, depth = 2, activation = "gelu" }\nsteps = 40\n'
        'policy = "p=f32,c=f16,o=f32"\ntelemetry = { enabled = false }\n'
    )
    model = {"rules": [dict(mechanism="fp16-overflow", signal="headroom", feature="value",
                            op="<", threshold=1.0, requires="fp16", lead=30.0)],
             "debounce": 2, "window": 5}  # fmt: skip
    import precisionlab.train._forecast as fc

    path = tmp_path / "model.json"
    path.write_text(json.dumps(model))
    old = fc.MODEL_PATH
    fc.MODEL_PATH = path  # the frozen model's location, for this run only
    try:
        argv = ["run", str(exp), "--forecast", "--out", str(tmp_path / "r"), "--no-report"]
        assert main([*argv, "--quiet"]) == 0
    finally:
        fc.MODEL_PATH = old
    err = capfd.readouterr().err
    # GELU's x^3 of inputs x12 is at float16's max from the first record on; records every 5
    # steps (the automatic interval, max(5, 40 // 50)): the second one, step 6, fires
    assert "forecast: base: step 6: likely to diverge within about" in err
    rows = (tmp_path / "r" / "variants" / "00-base" / "predictors.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1, 6, 11, 16, 21, 26, 31, 36]
