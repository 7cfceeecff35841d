"""The pieces the benches share: how a result is printed and written (bench/_output.py), one
model's entry of an interval bench (bench/_interval.py), the transformer's size
(bench/_recipes.py)."""

import argparse
import json

import jax
import jax.numpy as jnp
import pytest

from precisionlab.bench import _interval, _output
from precisionlab.bench._recipes import ModelSize, add_model_arguments, init_params


def test_rows_text_is_head_rule_and_lines():
    assert _output.rows_text("a  bb", ["1  2", "3  4"]) == "a  bb\n-----\n1  2\n3  4"
    assert _output.rows_text("head", []) == "head\n----"


@pytest.mark.parametrize("as_json", [False, True])
def test_print_result_writes_out_and_prints_json_or_the_rendering(as_json, tmp_path, capsys):
    result = {"b": [1, 2], "a": 0.5}
    out = tmp_path / "r.json"
    args = argparse.Namespace(json=as_json, out=out)
    _output.print_result(result, args, lambda r: f"rendered {sorted(r)}", indent=1)
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == result
    assert printed == (json.dumps(result, indent=1) if as_json else "rendered ['a', 'b']") + "\n"


def test_print_result_without_an_out_option_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _output.print_result([1], argparse.Namespace(json=True), str)  # no args.out at all
    assert capsys.readouterr().out == "[\n  1\n]\n"
    assert list(tmp_path.iterdir()) == []


class _Counted:
    def param_count(self, params):
        return sum(params)


def test_model_result_ratios_are_each_variant_over_the_first():
    runs = {"a-plain": lambda: None, "b-x": lambda: None, "c-y": lambda: None}
    entry = _interval.model_result("m", _Counted(), [3, 4], runs, steps=2, repeats=1)
    ms = entry["ms_per_step"]
    assert entry["model"] == "m" and entry["params"] == 7 and list(ms) == list(runs)
    assert entry["ratios"] == {"b/a": ms["b-x"] / ms["a-plain"], "c/a": ms["c-y"] / ms["a-plain"]}


def test_interval_measure_orders_settings_models_verdict_and_machine():
    def measure_model(name, batch, interval, steps, repeats):
        return {"model": name, "args": [batch, interval, steps, repeats]}

    result = _interval.measure(
        measure_model, ("x", "y"), 2, 3, 4, 5,
        settings={"targets": ["t"]}, verdict=lambda rs: {"n": len(rs)},
    )  # fmt: skip
    keys = ["batch", "interval", "targets", "steps_per_round", "repeats", "models", "n"]
    assert list(result)[: len(keys)] == keys
    assert set(result) - set(keys) == {"backend", "devices", "jax", "cpu_count"}
    assert result["models"] == [
        {"model": "x", "args": [2, 3, 4, 5]},
        {"model": "y", "args": [2, 3, 4, 5]},
    ]


def test_model_size_options_round_trip():
    defaults = ModelSize(batch=2, seq=8, d_model=16, layers=1, heads=2, vocab=32)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, defaults)
    assert ModelSize.from_args(parser.parse_args([])) == defaults
    args = parser.parse_args(["--d-model", "24", "--vocab", "7"])
    assert ModelSize.from_args(args) == defaults._replace(d_model=24, vocab=7)
    assert "model width (default 16)" in parser.format_help()


def test_model_size_inputs_are_the_benches_keys_0_and_1():
    size = ModelSize(batch=2, seq=8, d_model=16, layers=1, heads=2, vocab=7)
    params, tokens = size.inputs()
    # what bench recipes and bench overhead each wrote before ModelSize
    want = init_params(jax.random.key(0), d=16, layers=1, vocab=7, seq=8)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params, want))
    want_tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 7, jnp.int32)
    assert tokens.dtype == jnp.int32 and bool((tokens == want_tokens).all())
