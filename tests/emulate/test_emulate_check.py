"""emulate.check and `precisionlab emulate-check`: per-operation differences between a native
jit run and an emulated one.

Oracle: float16 arithmetic by hand (exp(12) = 162755 > 65504 overflows a float16 kernel, so
exp(x)/exp(x) is inf/inf = NaN there for x > 11.09, and 1 in XLA:CPU's float32 fusion). XLA:CPU
up to jax 0.10 keeps that fusion in float32, so the native run hides the overflow; from jax 0.11
(seen on 0.11.2) it stores float16 like a GPU kernel, and the native run agrees with emulate.
"""

from __future__ import annotations

import json
import textwrap

import jax.numpy as jnp
import numpy as np
from _xla_facts import cpu_keeps_float32_in_float16_fusions

from precisionlab.cli import main
from precisionlab.emulate import check


def _f(x):
    return jnp.sum(jnp.exp(x) / jnp.exp(x) * x)


X = jnp.linspace(-12, 12, 64, dtype=jnp.float16)
OVER = int(np.sum(np.asarray(X, np.float64) > np.log(65504)))  # exp overflows in float16


def test_check_names_the_first_operation_that_differs_and_counts_elements():
    report = check(_f, "c=f16", X)
    names = [o.name for o in report.ops]
    assert names == ["exp[0]", "exp[1]", "div[2]", "mul[3]", "convert_element_type[4]",
                     "reduce_sum[5]", "convert_element_type[6]"]  # fmt: skip
    div = report.ops[2]
    assert 0 < OVER < 64 and div.emulated_nan == OVER
    if not cpu_keeps_float32_in_float16_fusions():  # the native run overflows too: no difference
        assert div.native_nan == OVER and not report.differing
        assert report.text().endswith("0 of 7 operations differ under c=f16")
        return
    assert report.differing[0] is div
    assert div.differ == OVER and div.native_nan == 0
    assert "first: div[2]" in report.text()


def test_a_program_without_hidden_differences_reports_none():
    report = check(lambda x: x * 2 + 1, "c=f16", X)
    assert report.ops and not report.differing
    assert report.text().endswith("0 of 2 operations differ under c=f16")


def _module(tmp_path):
    path = tmp_path / "mymodel.py"
    path.write_text(
        textwrap.dedent("""
        import jax.numpy as jnp

        def model(x):
            return jnp.sum(jnp.exp(x) / jnp.exp(x) * x)

        def inputs():
            return (jnp.linspace(-12, 12, 64, dtype=jnp.float16),)
    """)
    )
    return str(path)


def test_cli_lists_differing_operations(tmp_path, capsys):
    path = _module(tmp_path)
    assert main(["emulate-check", f"{path}:model", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    hidden = cpu_keeps_float32_in_float16_fusions()
    want = "5 of 7 operations differ under c=f16; first: div[2]" if hidden else "0 of 7"
    if hidden:
        assert rows[0]["name"] == "div[2]" and rows[0]["differ"] == OVER
    else:
        assert rows == []
    assert main(["emulate-check", path]) == 0
    assert want in capsys.readouterr().out
    assert main(["emulate-check", path, "--hardware", "float32"]) == 0  # no matmul: the same
    assert want in capsys.readouterr().out


def _write(tmp_path, name: str, text: str) -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_cli_refuses_bad_targets_in_one_line(tmp_path, capsys):
    path = _module(tmp_path)
    for argv, needle in (
        ([f"{path}:nope"], "no function 'nope'; functions: inputs, model"),
        ([str(tmp_path / "missing.py")], "no such file"),
        (["model.txt"], "name a Python file"),
        ([path, "--policy", "c=f17"], "unknown dtype 'f17'"),
        ([path, "--hardware", "h200"], "hardware must be one of h100-xla, float32, h100-cub"),
        ([_write(tmp_path, "broken.py", "def model(:\n")], "importing it failed: SyntaxError"),
        ([_write(tmp_path, "noinputs.py", "def model(x):\n    return x\n")], "define inputs()"),
    ):
        assert main(["emulate-check", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
