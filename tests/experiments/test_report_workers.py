"""The report's telemetry figures drawn in worker processes (PRECISIONLAB_REPORT_WORKERS):
the same report lines and figures as drawing them in-process, and a worker's error raised
in the caller."""

from __future__ import annotations

import os

import pytest

from precisionlab import _io
from precisionlab.experiments import _store as store
from precisionlab.experiments import _telemetry_views as tv


def _rows(scale: float) -> list[dict]:
    """Telemetry rows of two matmul tensors over three steps, scaled so fp16 underflows."""
    out = []
    for step in (1, 11, 21):
        for layer, amax in (("layer0", 2.0), ("layer1", 1e-6 * scale)):
            amin = amax * 1e-3
            under = 0.25 if amin < 6e-8 else 0.0
            out.append({
                "step": step, "kind": "matmul", "layer": layer, "site": "dot_general[0]",
                "tensor": "out", "n": 64, "n_nan": 0, "n_inf": 0, "n_zero": 8,
                "amax": amax, "amin_nonzero": amin, "dynamic_range": 10.0, "frac_zero": 0.125,
                "frac_nonfinite": 0.0,
                "targets": {"fp16": {"overflow": 0.0, "underflow": under},
                            "bf16": {"overflow": 0.0, "underflow": 0.0}},
            })  # fmt: skip
    return out


def _run_dir(tmp_path, name):
    run = tmp_path / name
    units = []
    for i, scale in enumerate((1.0, 1e-3)):
        uid = f"0{i}-u{i}"
        _io.makedirs(run / "variants" / uid)
        _io.write_jsonl(run / "variants" / uid / "telemetry.jsonl", _rows(scale))
        units.append({"id": uid, "name": f"s/u{i}",
                      "telemetry": tv.summarize_telemetry(run / "variants" / uid)})  # fmt: skip
    return run, units


def _report(monkeypatch, run, units, workers):
    monkeypatch.setenv("PRECISIONLAB_REPORT_WORKERS", workers)
    with store.confined(run):
        return tv.telemetry_report(run, units, run / "plots")


@pytest.mark.slow  # two worker interpreters importing JAX: ~15 s of CPU
def test_workers_draw_the_same_report_as_one_process(monkeypatch, tmp_path):
    serial_dir, units = _run_dir(tmp_path, "serial")
    serial = _report(monkeypatch, serial_dir, units, "1")
    par_dir, units = _run_dir(tmp_path, "par")
    parallel = _report(monkeypatch, par_dir, units, "2")
    assert parallel == serial
    assert sum(line.startswith("![") for line in serial) == 4  # heatmap and range per unit
    names = sorted(os.listdir(serial_dir / "plots"))
    assert names == sorted(os.listdir(par_dir / "plots"))
    assert names == [f"telemetry_{k}_0{i}-u{i}.png" for k in ("heatmap", "range") for i in (0, 1)]
    for n in names:  # a PNG with content, drawn by each path
        assert (par_dir / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (par_dir / "plots" / n).stat().st_size > 5000


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_bad_worker_count_is_an_error_naming_the_variable(monkeypatch, tmp_path, raw):
    run, units = _run_dir(tmp_path, "bad")
    with pytest.raises(ValueError, match="PRECISIONLAB_REPORT_WORKERS must be a positive"):
        _report(monkeypatch, run, units, raw)


@pytest.mark.slow
def test_an_error_in_a_worker_is_raised_in_the_caller(monkeypatch, tmp_path):
    run, units = _run_dir(tmp_path, "err")
    _io.makedirs(run / "plots")
    os.symlink(tmp_path / "elsewhere.png", run / "plots" / "telemetry_range_01-u1.png")
    with pytest.raises(_io.UnsafePathError, match=r"telemetry_range_01-u1\.png"):
        _report(monkeypatch, run, units, "2")
    assert not (tmp_path / "elsewhere.png").exists()


def test_heatmap_labels_every_layer_and_step_once_per_row_and_column(monkeypatch, tmp_path):
    """Layer names on every row's left panel, steps under the bottom row, a title on every
    panel, and no tick artists elsewhere (they were most of the drawing time)."""
    figs = []
    monkeypatch.setattr(store, "save_figure", lambda fig, path, **kw: figs.append(fig))
    rows = _rows(1e-3)
    assert tv._heatmap(rows, ["fp16", "bf16"], tmp_path / "h.png", "s/u")
    (fig,) = figs
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 6  # as computed, then fp16 and bf16: 3 rows of 2
    layers = ["layer0:dot_general[0].out", "layer1:dot_general[0].out"]
    for i, ax in enumerate(panels):
        row, col = divmod(i, 2)
        ylabels = [t.get_text() for t in ax.get_yticklabels()]
        xlabels = [t.get_text() for t in ax.get_xticklabels()]
        assert ylabels == (layers if col == 0 else [])
        assert xlabels == (["1", "11", "21"] if row == 2 else [])
        assert ax.get_xlabel() == ("step" if row == 2 else "")
        assert ax.get_title().startswith(("%", "what-if:\n%"))
    assert fig.get_suptitle() == "s/u"


def _many_rows(n_layers: int) -> list[dict]:
    """Telemetry rows of ``n_layers`` matmul outputs with long names over 6 steps."""
    return [
        {"step": step, "kind": "matmul", "layer": f"model/blocks/{i}/attention/query", "n": 64,
         "site": "dot_general[0]", "tensor": "out", "n_nan": 0, "n_inf": 0, "n_zero": 8,
         "amax": 2.0 ** -(i % 20), "amin_nonzero": 2.0 ** -(i % 20 + 10), "dynamic_range": 10.0,
         "frac_zero": 0.125, "frac_nonfinite": 0.0,
         "targets": {"fp16": {"overflow": 0.0, "underflow": 0.01 * (i % 4)}}}
        for step in range(0, 60, 10) for i in range(n_layers)
    ]  # fmt: skip


def test_heatmaps_are_page_width_with_readable_labels(tmp_path):
    """Rendered telemetry figures fit a page (825 px wide: 7.5 in at 110 dpi, the site's content
    width) at a bounded height, in parts of at most 40 layers, every label at least 9 points
    (12 px at the 110 dpi they are drawn at); 41 layers make two balanced parts of each figure.
    Report telemetry figures used to be 1080 px wide and 6134 px tall, with 5-point labels."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    drawn: list[Figure] = []
    save = store.save_figure
    store_save = lambda fig, path, **kw: (drawn.append(fig), save(fig, path, **kw))  # noqa: E731
    mp = pytest.MonkeyPatch()
    mp.setattr(store, "save_figure", store_save)
    try:
        rows = _many_rows(41)
        assert tv._heatmap(rows, ["fp16"], tmp_path / "h.png", "s/u") == 2
        assert tv._ranges(rows, ["fp16"], tmp_path / "r.png", "s/u") == 2
    finally:
        mp.undo()
    files = ["h.png", "h_2.png", "r.png", "r_2.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)
    for name in files:
        height, width = imread(tmp_path / name).shape[:2]
        assert width == 825 and 250 <= height <= 13 * 110, (name, width, height)
    for fig in drawn:
        texts = [t for ax in fig.axes for t in (*ax.get_yticklabels(), *ax.get_xticklabels())
                 if t.get_text()]  # fmt: skip
        texts += [ax.title for ax in fig.axes if ax.get_title()]
        assert texts and min(t.get_fontsize() for t in texts) >= 9
        layer_labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
        layer_labels = [s for s in layer_labels if "model/" in s]
        assert 20 <= len(set(layer_labels)) <= 21  # 41 layers in two parts of 20 and 21
        # long names are shortened in the middle to fit the left margin (42% of the width)
        assert all(len(s) * 0.62 * 9 / 72 + 0.35 <= 0.42 * 7.5 for s in layer_labels)
