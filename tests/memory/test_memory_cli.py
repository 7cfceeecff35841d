"""``precisionlab memory``: the breakdown table, --budget, --json, --list-presets, --measure,
and its errors (one line on stderr, exit status 2)."""

from __future__ import annotations

import json
import textwrap

import pytest

from precisionlab.cli import main


def run_cli(capsys, *argv):
    code = main(["memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_gpt3_175b_textbook_table(capsys):
    code, out, err = run_cli(
        capsys,
        "--preset",
        "gpt3-175b",
        "--policy",
        "p=f32,c=f16",
        "--optimizer",
        "adam",
        "--batch",
        "1",
        "--seq",
        "2048",
    )
    assert code == 0 and err == ""
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert "350,000,000,000" in lines["weights (float16)"]
    assert "350.00" in lines["weights (float16)"]
    assert "700,000,000,000" in lines["master weights (float32)"]
    assert "350,000,000,000" in lines["gradients (float16)"]
    assert "1,400,000,000,000" in lines["optimizer state (adam, float32)"]
    states = lines["model states (weights..optimizer)"]
    assert "2,800,000,000,000" in states and states.split()[-1] == "16"
    assert "GB (1e9)" in out and "GiB (2^30)" in out


def test_json_output(capsys):
    code, out, _ = run_cli(
        capsys,
        "--preset",
        "gpt3-175b",
        "--policy",
        "p=f32,c=f16",
        "--json",
        "--checkpoint-every",
        "8",
        "--zero-stage",
        "3",
        "--dp",
        "64",
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["bytes"]["bytes_per_param"] == 16 / 64
    assert doc["setup"]["checkpoint_every"] == 8
    assert doc["bytes"]["activations_boundary"] == (12 + 8) * 2048 * 12288 * 2


def test_budget_fits_and_does_not_fit(capsys):
    code, out, _ = run_cli(capsys, "--preset", "gpt3-small", "--budget", "80GiB")
    assert code == 0 and "fits (" in out
    code, out, _ = run_cli(capsys, "--preset", "gpt3-175b", "--budget", "80GiB")
    assert code == 0 and "does not fit" in out and "ZeRO stage 3 over dp=" in out
    assert max(len(line) for line in out.splitlines()) <= 100  # the site's code blocks
    code, out, _ = run_cli(capsys, "--preset", "gpt3-175b", "--budget", "80GiB", "--json")
    assert json.loads(out)["budget"]["fits"] is False


def test_list_presets(capsys):
    code, out, _ = run_cli(capsys, "--list-presets")
    assert code == 0
    assert "Brown et al. 2020" in out and "gpt3-175b" in out and "175,000,000,000" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--preset", "gpt3-9b"], "unknown preset 'gpt3-9b'"),
        (["--preset", "gpt3-xl", "--budget", "80"], "malformed size '80'"),
        (["--preset", "gpt3-xl", "--budget", "80 GB/s"], "malformed size"),
        (["--preset", "gpt3-xl", "--budget", "12 XB"], "unknown unit 'XB'"),
        (["--preset", "gpt3-xl", "--budget", "1e400GB"], "beyond 1 ZiB"),
        (["--preset", "gpt3-xl", "--policy", "p=f32,c=f12"], "f12"),
        (["--preset", "gpt3-xl", "--optimizer", "adagrad"], "adagrad"),
        (["--preset", "gpt3-xl", "--checkpoint-every", "25"], "1..24"),
        (["--preset", "gpt3-xl", "--batch", "6", "--microbatches", "4"], "divisible"),
        (["--preset", "gpt3-xl", "--zero-stage", "5"], "zero_stage"),
        ([], "name a model"),
        (["--preset", "gpt3-xl", "--measure", "x.toml"], "either"),
    ],
)
def test_errors_are_one_line_and_exit_2(capsys, argv, match):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert match in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_measure_a_train_config(capsys, tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(
        textwrap.dedent("""
        kind = "train"
        [train]
        model = "mlp"
        batch_size = 32
        steps = 2
        [[variant]]
        name = "fp32"
        policy = "p=f32,c=f32,o=f32"
        [[variant]]
        name = "bf16"
        policy = "p=f32,c=bf16,o=f32"
    """)
    )
    code, out, err = run_cli(capsys, "--measure", str(path))
    assert code == 0, err
    assert out.count("arguments") == 2 and "XLA/est" in out
    assert max(len(line) for line in out.splitlines()) <= 100  # the heading wraps
    for line in out.splitlines():
        if line.strip().startswith(("arguments", "outputs")):
            assert line.split()[-1] == "1.000"


def test_measure_rejects_other_kinds_and_missing_files(capsys, tmp_path):
    code, _, err = run_cli(capsys, "--measure", str(tmp_path / "nope.toml"))
    assert code == 2 and "nope.toml" in err
    path = tmp_path / "mem.toml"
    path.write_text('kind = "memory"\n[memory]\nmeasure = false\nplots = false\n')
    code, _, err = run_cli(capsys, "--measure", str(path))
    assert code == 2 and "kind 'train'" in err


def test_wrap_breaks_a_heading_after_commas_within_the_width():
    from precisionlab.cli._memory_cmd import _wrap

    text = "fp32: transformer (107,776 params), batch 32, p=f32,c=f32,o=f32, adam, loss scale none"
    assert _wrap(text, width=200) == text
    lines = _wrap(text, width=40).splitlines()
    assert all(len(line) <= 40 for line in lines), lines
    # nothing lost or reordered: the parts joined back give the text
    assert " ".join(line.strip() for line in lines) == text
    assert lines[1].startswith("  ") and lines[0].endswith(",")
