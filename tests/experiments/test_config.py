"""Experiment files: strict validation, --set overrides, variants, settings and grids."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from precisionlab.experiments import _kinds as kinds
from precisionlab.experiments._config import (
    ConfigError,
    apply_overrides,
    load_experiment,
    parse_override,
)

BASE = """
kind = "train"
name = "t"
[train]
model = "mlp"
steps = 20
lr = 0.01
model_kwargs = { width = 16 }
"""


def write(tmp_path: Path, body: str, name: str = "exp.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def load(tmp_path: Path, body: str, *overrides: str):
    return load_experiment(write(tmp_path, body), list(overrides))


def error(tmp_path: Path, body: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, body, *overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_defaults_come_from_the_trainer(tmp_path):
    from precisionlab.train import TrainConfig

    exp = load(tmp_path, BASE)
    (unit,) = exp.units
    assert unit.name == "base" and unit.seed == TrainConfig().seed
    assert unit.params["steps"] == 20 and unit.params["lr"] == 0.01
    assert unit.params["batch_size"] == TrainConfig().batch_size
    assert unit.params["model_kwargs"] == {"width": 16}
    assert exp.resolved["units"][0]["params"] == unit.params


@pytest.mark.parametrize(
    ("extra", "override", "needles"),
    [
        ("", "train.stepz=3", ["exp.toml", "train", "'stepz'", "allowed keys", "steps"]),
        ("", "train.steps=abc", ["exp.toml", "train.steps", "expected int", "'abc'"]),
        ("", "train.steps=1.5", ["train.steps", "expected int"]),
        ("", "train.model=resnet", ["train.model", "'resnet'", "mlp", "transformer"]),
        ("", "train.optimizer=sgdd", ["train.optimizer", "adam", "momentum"]),
        ("", "train.policy=p=f32,c=f17", ["train.policy", "f17", "bfloat16"]),
        ("", "train.loss_scale=huge", ["train.loss_scale", "huge", "dynamic"]),
        ("", "train.update_rounding=up", ["train.update_rounding", "stochastic", "kahan"]),
        ("", "train.model_kwargs.widht=3", ["train.model_kwargs", "widht", "width"]),
        ("", "train.optimizer_kwargs.bogus=1", ["train.optimizer_kwargs", "bogus"]),
        ("", "train.loss_weight=-1", ["train.loss_weight", "must be a finite number >= 5.42"]),
        ("", "train.loss_weight=1.2e-38", ["train.loss_weight", ">= 5.42101086e-20"]),
        ("", "train.optimizer_kwargs.eps=[1,'a']", ["train.optimizer_kwargs.eps", "list"]),
        ("", "train.optimizer_kwargs.eps=true", ["train.optimizer_kwargs.eps", "bool True"]),
        ("", "train.optimizer_kwargs.eps=-1e-8", ["train.optimizer_kwargs.eps", ">= 0"]),
        ("", "train.lr=inf", ["train.lr", "finite number > 0", "float32 max"]),
        ("", "train.steps=100000000000000000000", ["train.steps", "<= 2147483647"]),
        ("", "train.batch_size=100000000000", ["train.batch_size", "<= 16777216"]),
        ("", "train.loss_weight=1e308", ["train.loss_weight", "3.40282347e+38", "float32 max"]),
        ("", "kind=nope", ["kind", "'nope'", "train", "survey", "memory"]),
        ("", "colour=1", ["exp.toml", "'colour'", "allowed keys"]),
        ("[[variant]]\nname='a'\nlr='x'\n", "", ["variant[0] (a).lr", "expected float"]),
        ("[[variant]]\nname='a'\nsettings=['zz']\n", "", ["variant[0] (a).settings", "'zz'"]),
        ("[[variant]]\nlr=0.1\n", "", ["variant[0]", "missing required key 'name'"]),
        ("[[variant]]\nname='a b'\n", "", ["variant[0]", "bad name"]),
        ("[[variant]]\nname='a'\n[[variant]]\nname='a'\n", "", ["'a' is used twice"]),
        ("[settings.s]\nsteps='many'\n", "", ["settings.s.steps", "expected int"]),
        ("[grid]\nlr=0.1\n", "", ["grid.lr", "expected list of float"]),
        ("[grid]\npolicy=['p=f32,c=f99']\n", "", ["grid.policy[0]", "f99"]),
        ("[grid]\nwat=[1]\n", "", ["grid", "'wat'", "allowed keys"]),
    ],
)
def test_bad_files_name_file_key_path_and_allowed_values(tmp_path, extra, override, needles):
    message = error(tmp_path, BASE + extra, *([override] if override else []))
    for needle in needles:
        assert needle in message, (needle, message)


def test_missing_kind_and_bad_toml(tmp_path):
    assert "missing required key 'kind'" in error(tmp_path, "[train]\nsteps = 1\n")
    assert "not valid TOML" in error(tmp_path, "kind = \n")
    with pytest.raises(ConfigError, match="no such experiment file"):
        load_experiment(tmp_path / "absent.toml")


def test_set_overrides_are_typed_by_the_schema(tmp_path):
    body = BASE + "[[variant]]\nname = 'a'\n[[variant]]\nname = 'b'\n"
    exp = load(
        tmp_path,
        body,
        "train.steps=7",
        "train.policy=p=f32,c=bf16,o=f32",  # a string key: the value is not parsed as TOML
        "variant.b.lr=0.5",
        "train.model_kwargs.depth=3",
        "seeds=[1, 2]",
    )
    by_name = {(u.variant, u.seed): u for u in exp.units}
    assert set(by_name) == {("a", 1), ("a", 2), ("b", 1), ("b", 2)}
    assert all(u.params["steps"] == 7 for u in exp.units)
    assert all(u.params["policy"] == "p=f32,c=bf16,o=f32" for u in exp.units)
    assert by_name["b", 1].params["lr"] == 0.5 and by_name["a", 1].params["lr"] == 0.01
    assert by_name["a", 2].params["model_kwargs"] == {"width": 16, "depth": 3}
    assert exp.document["train"]["steps"] == 7  # the saved document holds the overrides


def test_override_errors():
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        parse_override("train.steps")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("train..steps=1")
    doc = {"kind": "train", "variant": [{"name": "a"}]}
    with pytest.raises(ConfigError, match="no variant 'zz'; variants: a"):
        apply_overrides(doc, ["variant.zz.lr=1"])
    assert apply_overrides(doc, ["variant.0.lr=2"])["variant"][0]["lr"] == 2
    assert "lr" not in doc["variant"][0]  # the input is not modified


def test_settings_merge_tables_and_restrict_variants(tmp_path):
    body = BASE + textwrap.dedent(
        """
        [settings.small]
        lr = 0.001
        [settings.deep]
        model_kwargs = { depth = 4 }
        [[variant]]
        name = "fp32"
        [[variant]]
        name = "bf16"
        policy = "p=f32,c=bf16,o=f32"
        settings = ["deep"]
        """
    )
    exp = load(tmp_path, body)
    names = [u.name for u in exp.units]
    assert names == ["small/fp32", "deep/fp32", "deep/bf16"]
    deep = exp.units[2]
    assert deep.params["model_kwargs"] == {"width": 16, "depth": 4}
    assert deep.params["policy"] == "p=f32,c=bf16,o=f32"
    assert exp.units[0].params["lr"] == 0.001 and deep.params["lr"] == 0.01
    assert len({u.id for u in exp.units}) == 3
    assert all("/" not in u.id for u in exp.units)


def test_an_empty_settings_list_disables_a_variant(tmp_path):
    body = BASE + "[settings.s]\n[[variant]]\nname = 'a'\n[[variant]]\nname = 'b'\n"
    exp = load(tmp_path, body, "variant.b.settings=")
    assert [u.name for u in exp.units] == ["s/a"]


def test_grid_expands_the_product_and_seeds(tmp_path):
    body = BASE + textwrap.dedent(
        """
        [grid]
        policy = ["p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"]
        loss_scale = ["none", "static:1024", "dynamic"]
        update_rounding = ["nearest"]
        seed = [0, 1]
        """
    )
    exp = load(tmp_path, body)
    assert len(exp.units) == 2 * 3 * 1 * 2
    combos = {(u.params["policy"], u.params["loss_scale"], u.seed) for u in exp.units}
    assert len(combos) == 12
    groups = {u.group for u in exp.units}
    assert len(groups) == 6  # seeds are grouped
    assert all(u.name.endswith(f" s{u.seed}") for u in exp.units)


def test_other_kinds_validate_their_own_table(monkeypatch, tmp_path):
    import sys
    import types

    module = types.ModuleType("fake_kind")
    module.KIND = "fake"

    def validate(section, where):
        if set(section) - {"n"}:
            raise ValueError(f"{where}: unknown key; allowed: n")
        return {"n": section.get("n", 3)}

    module.validate = validate
    module.run = lambda section, out_dir, quiet=False: {"n": section["n"]}
    monkeypatch.setitem(sys.modules, "fake_kind", module)
    monkeypatch.setitem(kinds.KINDS, "fake", module)
    exp = load(tmp_path, 'kind = "fake"\n[fake]\n', "fake.n=5")
    assert exp.resolved["fake"] == {"n": 5}
    with pytest.raises(ValueError) as info:
        load(tmp_path, 'kind = "fake"\n[fake]\nx = 1\n')
    assert "exp.toml: fake: unknown key" in str(info.value)
    assert "'train'" in error(tmp_path, 'kind = "fake"\n[train]\n')


@pytest.mark.parametrize("name", ["fp16_vs_bf16.toml", "loss_scaling.toml"])
def test_shipped_experiments_validate(name):
    path = Path(__file__).parents[2] / "experiments" / name
    exp = load_experiment(path)
    assert exp.kind == "train" and exp.units


def test_cli_reports_config_errors_in_one_line(tmp_path, capsys):
    from precisionlab.cli import main

    path = write(tmp_path, BASE)
    assert main(["run", str(path), "--set", "train.steps=abc", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "train.steps: expected int" in err
    assert main(["run"]) == 2
    assert "CONFIG" in capsys.readouterr().err
    assert main(["run", str(path), "--resume", str(tmp_path)]) == 2
    assert main(["run", "--resume", str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_cli_keeps_the_traceback_of_a_bug(monkeypatch, capsys):
    # Only errors about the user's input are one line (exit 2); a TypeError raised inside a
    # command is a bug and must not be disguised as a usage error.
    from precisionlab import cli

    def buggy(args):
        raise TypeError("unsupported operand type(s) for +: 'int' and 'str'")

    def bad_input(args):
        raise ValueError("bad value 'x'; allowed: a, b")

    monkeypatch.setattr(cli.COMMANDS["env"], "run", buggy)
    with pytest.raises(TypeError, match="unsupported operand"):
        cli.main(["env"])
    monkeypatch.setattr(cli.COMMANDS["env"], "run", bad_input)
    assert cli.main(["env"]) == 2
    assert capsys.readouterr().err == "precisionlab env: error: bad value 'x'; allowed: a, b\n"
