"""A misspelt key in an experiment file gets a suggestion."""

from __future__ import annotations

import pytest

from precisionlab.cli import main


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
