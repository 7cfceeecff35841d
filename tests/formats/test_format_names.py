"""Format names a person types: the OCP names of the six-bit formats, family names, did-you-mean."""

from __future__ import annotations

import ml_dtypes
import pytest

from precisionlab.cli import main
from precisionlab.formats import get_format


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
