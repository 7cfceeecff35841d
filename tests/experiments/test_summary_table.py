"""``experiments.summary_table``: the report's table for a notebook or a script, with the
columns asked for, split to fit 100 characters; an unknown column raises naming the others."""

from __future__ import annotations

import pytest

from precisionlab.experiments import summary_table


def _unit(name, **kw):
    unit = {"id": name.replace("/", "-"), "name": name, "status": "finished", "steps": 10}
    unit.update(kw)
    return unit


SUMMARY = {
    "variants": [
        _unit("range/fp32", final_loss=1.23456, eval_loss=1.5, mean_underflow_fraction=0.0),
        _unit("range/fp16-noscale", final_loss=None, mean_underflow_fraction=0.969),
    ]
}


def test_the_columns_asked_for_in_their_order():
    text = summary_table(SUMMARY, ["variant", "underflow", "final_loss"])
    assert text.splitlines() == [
        "variant             underflow  final_loss",
        "------------------  ---------  ----------",
        "range/fp32               0.0%       1.235",
        "range/fp16-noscale      96.9%           -",
    ]


def test_all_columns_fit_the_page():
    text = summary_table(SUMMARY)
    assert max(len(line) for line in text.splitlines()) <= 100
    for header in ("variant", "status", "final_loss", "scale_max", "time_s"):
        assert header in text


def test_an_unknown_column_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown columns \['loss'\]; there are \['variant'"):
        summary_table(SUMMARY, ["variant", "loss"])
