"""The ``mismatch`` experiment kind on a reduced configuration: its files and their contents,
the control pair, the ratios and the attribution; resuming reads back what was written; the
runner and the experiment file; bad tables are one error line naming the key."""

import copy
import json
import shutil

import pytest

from precisionlab.consistency import Runner
from precisionlab.experiments import _mismatch_kind as mismatch_kind
from precisionlab.experiments import load_experiment
from precisionlab.experiments._runner import run_file

TINY = {
    "formats": ["bf16", "fp16"],
    "eval_rows": 4,
    "control": "bf16",
    "attribution": ["native/bf16"],
    "plots": False,  # the plots: test_plots_are_written (slow)
    "train": {
        "model": "transformer",
        "model_kwargs": {"d_model": 16, "depth": 1, "heads": 2},
        "data": "text",
        "data_kwargs": {"seq_len": 8, "max_bytes": 65536},
        "steps": 4,
        "batch_size": 4,
        "eval_batches": 1,
        "checkpoint_interval": 2,
        "telemetry": {"enabled": False},
    },
    "setups": {
        "native": {
            "trainer": {"hardware": "native", "mode": "full"},
            "sampler": {"hardware": "native", "mode": "decode", "batch_size": 2, "kv_block": 2},
        }
    },
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    return out, mismatch_kind.run(copy.deepcopy(TINY), out, quiet=True)


def test_the_run_writes_what_it_says(finished):
    out, summary = finished
    files = ["mismatch.json", "report.md", "pairs.jsonl", "attribution.jsonl", "params.npz",
             "train.json"]  # fmt: skip
    for f in files:
        assert (out / f).is_file(), f
    assert summary["files"][:2] == ["mismatch.json", "report.md"]
    saved = json.loads((out / "mismatch.json").read_text())
    assert [p["key"] for p in saved["pairs"]] == ["native/bf16", "native/fp16"]
    for p in saved["pairs"]:
        assert {"a", "b", "mean_nats", "rms_nats", "max_nats", "clip_share", "flip_rate",
                "kl"} <= set(p)  # fmt: skip
        assert p["rms_nats"] > 0 and p["a"].endswith("native full") and "decode/2" in p["b"]
        assert len(p["by_position"]) == 7  # 8 tokens: 7 predicted
    c = saved["control"]
    assert c["rms_nats"] == c["max_nats"] == c["kl"] == c["flip_rate"] == 0
    r = saved["ratios"]["native"]
    assert r["ratio"] == pytest.approx(r["bf16_rms_nats"] / r["fp16_rms_nats"])
    assert r["reproduced"] == (r["ratio"] >= 5.0)
    (att,) = saved["attribution"]
    assert att["key"] == "native/bf16" and att["layers"][-1]["layer"] == "lm_head"
    assert att["layers"][-1]["rms_nats"] == 0
    report = (out / "report.md").read_text()
    for part in ("## The gaps", "## bf16 against fp16 (Qi et al.)", "arXiv 2510.26788",
                 "## Where the gap comes from: native/bf16", "exactly 0"):  # fmt: skip
        assert part in report
    assert ("reproduced" if r["reproduced"] else "NOT reproduced") in report


@pytest.mark.slow  # matplotlib and three figures (~2 CPU s) on the finished run
def test_plots_are_written(finished):
    from precisionlab.experiments import _mismatch_report as mismatch_report

    out, summary = finished
    files = mismatch_report.plots(summary, out)
    assert files == ["ratio_hist.png", "gap_by_position.png", "gap_by_layer.png"]
    for f in files:
        assert (out / f).stat().st_size > 10_000, f


def test_a_rerun_reads_back_instead_of_recomputing(finished, monkeypatch, tmp_path):
    # it damages pairs.jsonl and runs again: on its own copy of the shared run
    out = shutil.copytree(finished[0], tmp_path / "mismatch")
    summary = finished[1]
    calls = []
    real = Runner.run

    def counting(self, *a, **k):
        calls.append(a[0].label)
        return real(self, *a, **k)

    monkeypatch.setattr(Runner, "run", counting)
    import precisionlab.train as train_pkg

    monkeypatch.setattr(train_pkg, "train", lambda *a, **k: pytest.fail("retrained"))
    again = mismatch_kind.run(copy.deepcopy(TINY), out, quiet=True)
    assert calls == [] and again["pairs"] == summary["pairs"]
    # a pair lost (killed before its row was written) is the only one computed again
    lines = (out / "pairs.jsonl").read_text().splitlines()
    (out / "pairs.jsonl").write_text("\n".join(lines[:1]) + "\n")
    third = mismatch_kind.run(copy.deepcopy(TINY), out, quiet=True)
    assert calls == ["fp16 native full", "fp16 native decode/2 kv2", "bf16 native full",
                     "bf16 native full"]  # fmt: skip
    assert [p["rms_nats"] for p in third["pairs"]] == [p["rms_nats"] for p in summary["pairs"]]


@pytest.mark.parametrize(("change", "message"), [
    ({"colour": 1}, "unknown key 'colour'"),
    ({"formats": ["bf17"]}, "mismatch.formats[0]: unknown dtype"),
    ({"formats": []}, "give at least one format"),
    ({"attribution": ["h100/bf16"]}, "is not SETUP/FORMAT"),
    ({"eval_rows": 3}, "must divide eval_rows=3"),
    ({"setups": {"x": {"trainer": {}}}}, "exactly 'trainer' and 'sampler'"),
    ({"setups": {"x": {"trainer": {"policy": "bf16"}, "sampler": {}}}}, "unknown key 'policy'"),
    ({"setups": {"x": {"trainer": {"hardware": "h100"}, "sampler": {}}}}, "ambiguous"),
    ({"train": {"model": "mlp", "data": "teacher"}}, "'transformer', got 'mlp'"),
    ({"train": {"steps": 0}}, "mismatch.train.steps"),
])  # fmt: skip
def test_bad_tables_name_the_key(change, message):
    table = {**copy.deepcopy(TINY), **change}
    with pytest.raises(ValueError) as err:
        mismatch_kind.validate(table, "mismatch")
    assert message in str(err.value) and "\n" not in str(err.value)


def _tiny_toml(tmp_path):
    toml = tmp_path / "tiny.toml"
    lines = ['kind = "mismatch"', "[mismatch]", 'formats = ["fp16"]', "eval_rows = 2",
             'control = "fp16"', "attribution = []", "plots = false", "[mismatch.train]",
             'model = "transformer"', "model_kwargs = { d_model = 8, depth = 1, heads = 2 }",
             'data = "text"', "data_kwargs = { seq_len = 4, max_bytes = 8192 }", "steps = 2",
             "batch_size = 2", "eval_batches = 1", "telemetry = { enabled = false }",
             "[mismatch.setups.cpu]", "trainer = { }", 'sampler = { mode = "decode" }']  # fmt: skip
    toml.write_text("\n".join(lines) + "\n")
    return toml


def test_the_experiment_file_and_the_runner(tmp_path, monkeypatch):
    exp = load_experiment("experiments/rl_mismatch.toml")
    assert exp.kind == "mismatch" and exp.resolved["mismatch"]["formats"] == ["fp32", "bf16",
                                                                               "fp16"]  # fmt: skip
    assert set(exp.resolved["mismatch"]["setups"]) == {"h100", "gemm-library", "native"}
    seen = []

    def fake(section, out_dir, *, quiet=False):
        seen.append((section, out_dir.name))
        return {"kind": "mismatch"}

    monkeypatch.setattr(mismatch_kind, "run", fake)
    run_dir = run_file(_tiny_toml(tmp_path), out=tmp_path / "run", quiet=True)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "finished"
    ((section, where),) = seen
    assert where == "mismatch" and section["formats"] == ["fp16"]
    assert section["setups"]["cpu"]["sampler"] == {"mode": "decode"}


@pytest.mark.slow  # trains and scores a model through the runner (~8 CPU s); the tests above
# run the kind itself and check the runner's dispatch to it
def test_the_runner_runs_the_kind(tmp_path):
    run_dir = run_file(_tiny_toml(tmp_path), out=tmp_path / "run", quiet=True)
    done = json.loads((run_dir / "summary.json").read_text())
    assert done["status"] == "finished", done["error"]
    assert done["result"]["pairs"][0]["key"] == "cpu/fp16"
    assert (run_dir / "mismatch" / "report.md").is_file()
