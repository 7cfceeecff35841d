"""The rough edges a new user hits first: names, version, missing libraries, misspelt keys,
wide tables, and user-facing text that speaks of the project's internal issue numbers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import pytest

from precisionlab import __version__, recipes
from precisionlab.cli import main
from precisionlab.experiments import _compare as compare
from precisionlab.experiments import _store as store
from precisionlab.formats import get_format

PACKAGE = Path(__file__).parent.parent / "precisionlab"


# --- 6-bit (and 8-bit) family names -------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp6_e2m3", ml_dtypes.float6_e2m3fn), ("fp6_e3m2", ml_dtypes.float6_e3m2fn),
     ("e2m3", ml_dtypes.float6_e2m3fn), ("e3m2", ml_dtypes.float6_e3m2fn)],
)  # fmt: skip
def test_six_bit_formats_by_their_ocp_names(name, dtype):
    fmt = get_format(name)
    info = ml_dtypes.finfo(dtype)
    assert fmt.bits == 6 and fmt.max == float(info.max)
    assert fmt.smallest_normal == float(info.smallest_normal)


@pytest.mark.parametrize(
    ("family", "members"),
    [("fp6", ("fp6_e2m3", "fp6_e3m2")), ("FP8", ("fp8_e4m3", "fp8_e5m2"))],
)
def test_a_family_name_names_its_formats(family, members, capsys):
    with pytest.raises(ValueError, match="more than one format") as err:
        get_format(family)
    for m in members:
        assert m in str(err.value)
        get_format(m)  # each suggestion is itself a valid name
    assert main(["values", family]) == 2
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and all(m in line for m in members)


def test_did_you_mean_names_the_six_bit_formats():
    with pytest.raises(ValueError, match="did you mean float6_e2m3fn or float6_e3m2fn"):
        get_format("float6_")


# --- recipes.apply pads like training ------------------------------------------------------
def test_apply_by_name_pads_a_ten_class_output_under_grad():
    """Forward and backward GEMMs of a 10-class head (the data gradient contracts over 10, not a
    multiple of MX's 32-element block): a recipe named to apply pads, as training pads; a
    Recipe object keeps what it says (pad=False refuses, naming pad=True)."""

    def mlp(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"]

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    p = {"w1": jax.random.normal(k1, (32, 32)), "w2": jax.random.normal(k2, (32, 10))}
    x = jax.random.normal(k3, (32, 32))
    by_name = recipes.apply(mlp, "mxfp8")
    assert by_name.recipe == recipes.get_recipe("mxfp8", pad=True)
    g = jax.jit(jax.grad(lambda q: by_name(q, x).sum()))(p)
    assert all(bool(jnp.isfinite(v).all()) and v.shape == p[k].shape for k, v in g.items())
    strict = recipes.apply(mlp, recipes.get_recipe("mxfp8", pad=False))
    with pytest.raises(ValueError, match="pad=True"):
        jax.eval_shape(jax.grad(lambda q: strict(q, x).sum()), p)  # raised while tracing
    assert recipes.apply(mlp, "current").recipe == recipes.get_recipe("current")  # no pad field


# --- --version, missing libraries ----------------------------------------------------------
def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"precisionlab {__version__}"


def test_conformance_names_a_missing_library(tmp_path, capsys, monkeypatch):
    from precisionlab.conformance import _adapters as adapters

    # a library that is never installed here: torch's adapter reports it missing
    real = adapters._import
    monkeypatch.setattr(adapters, "_import", lambda name: None if name == "torch" else real(name))
    out = tmp_path / "c"
    assert main(["conformance", "--libs", "torch", "--formats", "e4m3", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'torch'" in err and "not installed" in err
    assert not out.exists()  # nothing ran, nothing written


# --- did you mean, for config keys ---------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "hint"),
    [("[train]\nsetps = 3\n", "did you mean 'steps'"),
     ("[train]\nsteps = 3\noptimzer = 'adam'\n", "did you mean 'optimizer'"),
     ("[train]\nsteps = 3\noptimizer = 'adma'\n", "did you mean 'adam'"),
     ("[train]\nsteps = 3\n[[variant]]\nname = 'a'\npolcy = 'p=f32,c=f32,o=f32'\n",
      "did you mean 'policy'")],
)  # fmt: skip
def test_a_misspelt_config_key_gets_a_suggestion(tmp_path, capsys, text, hint):
    path = tmp_path / "x.toml"
    path.write_text('kind = "train"\nname = "x"\n' + text)
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and hint in err


# --- compare fits 100 columns --------------------------------------------------------------
def _fake_run(path: Path, names: list[str], loss: float) -> Path:
    units = [
        {"id": f"{i:02d}-v{i}", "name": n, "status": "finished", "final_loss": loss + i,
         "eval_metric": 0.5, "skipped_steps": 3, "diverged": False, "divergence_step": None}
        for i, n in enumerate(names)
    ]  # fmt: skip
    path.mkdir(parents=True)
    store.write_json(path / "summary.json", {"kind": "train", "variants": units})
    return path


def test_compare_table_fits_100_columns(tmp_path, capsys):
    names = ["underflow/fp16-noscale s0", "range/fp16-dynamic s0", "swamping/bf16-pure-nearest s0"]
    dirs = [
        _fake_run(tmp_path / f"fp16_vs_bf16-20261126-2015{i:02d}-quick-check", names, float(i))
        for i in range(4)
    ]
    headers, _, text = compare.compare_runs(dirs)
    assert len(headers) == 1 + 4 * len(compare.COLUMNS)  # the data is all there
    assert max(map(len, text.splitlines())) <= compare.WIDTH
    for i, d in enumerate(dirs):  # each run is labelled in a legend, and its losses shown
        letter = "ABCD"[i]
        assert f"{letter}: {d.name}" in text and f"{letter}:loss" in text
        for k in range(len(names)):
            assert re.search(rf"\b{float(i + k):.4g}\b", text)
    assert main(["compare", *map(str, dirs)]) == 0
    assert max(map(len, capsys.readouterr().out.splitlines())) <= compare.WIDTH


# --- no internal issue numbers in user-facing text -----------------------------------------
def test_no_internal_issue_numbers_in_user_facing_strings():
    """String literals (messages, docstrings, printed text) of the package never say "issue N"
    (an internal tracker number means nothing to a user); references to other projects'
    trackers ("ml_dtypes issue #298") are fine."""
    pattern = re.compile(r"\bissues? \d", re.IGNORECASE)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if pattern.search(node.value):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, found


def test_results_table_fits_100_columns():
    """The summary table `run` and `report` print: split into column groups that fit, each
    repeating the variant column, every header and cell kept."""
    from precisionlab.experiments._report import WIDTH, fitted_table, headers

    heads = headers()
    cols = range(len(heads) - 2)
    rows = [
        [f"swamping/bf16-pure-stochastic s{i}", "finished", *(f"{i}.{k:04d}" for k in cols)]
        for i in range(3)
    ]
    text = fitted_table(rows, heads)
    assert max(map(len, text.splitlines())) <= WIDTH
    blocks = text.split("\n\n")
    assert len(blocks) >= 2 and all(b.startswith("variant") for b in blocks)
    for h in heads:
        assert h in text
    for row in rows:
        for cell in row:
            assert cell in text


def test_bench_telemetry_table_fits_100_columns():
    from precisionlab.bench._telemetry import render

    ms = {"a-plain": 128.4, "b-telemetry": 216.8, "c-no-targets": 170.4, "d-matmuls-only": 180.0}
    model = {"model": "transformer", "params": 107776, "ms_per_step": ms,
             "ratios": {"b/a": 1.69, "c/a": 1.33, "d/a": 1.40}}  # fmt: skip
    result = {"interval": 10, "targets": ["fp16", "bf16", "e4m3:tensor"], "batch": 128,
              "backend": "cpu", "repeats": 7, "steps_per_round": 40, "models": [model],
              "target_met": {"transformer": False}}  # fmt: skip
    text = render(result)
    assert max(map(len, text.splitlines())) <= 100
    assert "transformer (108k)" in text and "216.800" in text and "NOT met" in text
