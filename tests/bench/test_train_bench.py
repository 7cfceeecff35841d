"""``precisionlab bench train``: argument errors are one line on stderr with exit status 2."""

import pytest

from precisionlab.cli import main


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--model", "cnn"], "--model must be mlp, transformer or conv"),
        (["--compute", "float32"], "--compute must be bfloat16 or float16"),
        (["--compute", "fp12"], "unknown dtype"),
    ],
)
def test_bad_arguments(argv, match, capsys):
    assert main(["bench", "train", *argv]) == 2
    err = capsys.readouterr().err
    assert match in err and len(err.strip().splitlines()) == 1


def test_bad_count(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "train", "--repeats", "0"])
    assert info.value.code == 2
    assert "need an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.slow
def test_conv_model_is_timed(tmp_path):
    from precisionlab.bench._train import measure

    result = measure("conv", batch=8, steps=2, repeats=1)
    assert result["model"] == "conv" and set(result["ms_per_step"]) >= {"a-fp32", "b-bf16"}
