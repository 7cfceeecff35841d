"""``diagnose --compare`` pairs tensors by model layer and role, so a variant whose layers are
scanned (``scan_layers``: one interception site serves every stacked layer) compares with an
unrolled one, and says which tensors it could not pair."""

import dataclasses
from pathlib import Path

import pytest

from precisionlab import diagnose as d
from precisionlab.diagnose._capture import Tensor
from precisionlab.diagnose._compare import match_tensors

ROOT = Path(__file__).resolve().parents[2]
FP16 = str(ROOT / "experiments" / "fp16_vs_bf16.toml")


def _mm(layer: str, site: int, k: int, part: str, kind: str = "grad") -> Tensor:
    return Tensor(layer, f"dot_general[{site}].{part}", kind, 0, f"{layer}:matmul[{k}].{part}")


def test_match_pairs_unrolled_with_scanned_sites_and_lists_the_rest():
    # unrolled: layer0 has sites 0, 1; layer1 has sites 2, 3. scanned: sites 0, 1 serve both
    # layers; the scanned variant also has an extra activation, the unrolled a head matmul.
    unrolled = [_mm(f"layer{i}", 2 * i + j, j, "out", "output") for i in (0, 1) for j in (0, 1)]
    unrolled += [_mm("out", 4, 0, "out", "output"), Tensor("-", "loss", "loss", 5, "-:loss")]
    scanned = [_mm(f"layer{i}", j, j, "out", "output") for i in (0, 1) for j in (0, 1)]
    scanned += [Tensor("layer1", "act:pre", "activation", 4, "layer1:act:pre")]
    scanned += [Tensor("-", "loss", "loss", 5, "-:loss")]
    pairs, unmatched = match_tensors(unrolled, scanned)
    got = [(t.key, u.key) for t, u in pairs]
    assert got == [
        ("layer0:dot_general[0].out", "layer0:dot_general[0].out"),
        ("layer0:dot_general[1].out", "layer0:dot_general[1].out"),
        ("layer1:dot_general[2].out", "layer1:dot_general[0].out"),
        ("layer1:dot_general[3].out", "layer1:dot_general[1].out"),
        ("-:loss", "-:loss"),
    ]
    assert unmatched == ["ref out:dot_general[4].out", "other layer1:act:pre"]
    # a name that occurs twice in one variant is ambiguous: it pairs nothing, and is listed
    dup = [_mm("layer0", 0, 0, "grad"), _mm("layer0", 1, 0, "grad")]
    pairs, unmatched = match_tensors(dup, [_mm("layer0", 7, 0, "grad")])
    assert pairs == [] and len(unmatched) == 3


@pytest.mark.slow  # three compares of two variants (about 40 s on a loaded machine)
def test_compare_unrolled_with_scanned_finds_the_unrolled_break():
    sets = ["train.steps=2", "train.model_kwargs.depth=5"]
    _, (a, b) = d.load_units(FP16, ["underflow/fp32", "underflow/fp16-noscale"], sets)

    def scanned(u, **kw):
        return dataclasses.replace(u, config=dataclasses.replace(u.config, scan_layers=True, **kw))

    results = {
        "unrolled": d.compare(a, b, d.CompareOptions(steps=1)),
        "scan": d.compare(a, scanned(b), d.CompareOptions(steps=1)),
        "remat": d.compare(scanned(a, remat_every=2), b, d.CompareOptions(steps=1)),
    }
    u = results["unrolled"]
    assert u.first is not None and u.first.kind == "grad" and u.unmatched == []
    for name in ("scan", "remat"):
        r = results[name]
        assert r.unmatched == [], name
        assert r.first is not None, name
        assert (r.first.step, r.first.layer, r.first.kind) == (u.first.step, u.first.layer, "grad")
        assert r.first.rel == pytest.approx(u.first.rel, rel=1e-5), name
        assert {(c.layer, c.kind) for c in r.at_step} == {(c.layer, c.kind) for c in u.at_step}


def test_nothing_paired_is_an_error_and_shape_mismatches_are_listed():
    from types import SimpleNamespace

    from precisionlab.diagnose._compare import _pair

    def runner(ts):
        return SimpleNamespace(capture=SimpleNamespace(tensors=ts, uncaptured=[]))

    a = [_mm("layer0", 0, 0, "out", "output"), Tensor("-", "loss", "loss", 1, "-:loss")]
    b = [_mm("block0", 0, 0, "out", "output"), Tensor("-", "loss", "loss", 1, "-:loss")]
    arrays = {"layer0:dot_general[0].out": [[1.0]], "block0:dot_general[0].out": [[1.0]]}
    with pytest.raises(ValueError, match="no tensor of B matches one of A"):
        _pair(runner(a), runner(b), arrays, arrays, "A", "B", print)
    said = []
    big = {"layer0:dot_general[0].out": [[1.0, 2.0]], "-:loss": 1.0}
    small = {"layer0:dot_general[0].out": [[1.0]], "-:loss": 1.0}
    with pytest.raises(ValueError):  # the only matmul pair differs in shape: only the loss left
        _pair(runner(a), runner(a), big, small, "A", "B", said.append)
    c = [*a, _mm("layer1", 1, 0, "out", "output")]
    arr = {**small, "layer1:dot_general[1].out": [[3.0]]}
    pairs, unmatched = _pair(runner(c), runner(c), {**arr, **big}, arr, "A", "B", said.append)
    assert [t.key for t, _ in pairs] == ["-:loss", "layer1:dot_general[1].out"]  # a's order
    assert unmatched == [
        "ref layer0:dot_general[0].out (shape differs)",
        "other layer0:dot_general[0].out (shape differs)",
    ]
    assert said and said[-1].startswith("not compared (no counterpart in the other variant)")
