"""recipe_groups.png: written for runs with recipe metrics, skipped for runs without."""

from __future__ import annotations

from precisionlab.experiments._recipe_plots import plot_recipe_groups


def _unit(variant, setting, with_recipe):
    rows = [{"step": s, "loss": 1.0} for s in range(3)]
    if with_recipe:
        for r in rows:
            r.update(
                {
                    f"recipe_{g}_{k}": 0.01 * r["step"]
                    for g in "xwg"
                    for k in ("saturated", "underflow")
                }
            )
    return {"summary": {"variant": variant, "setting": setting}, "metrics": rows}


def test_written_for_recipe_variants_only(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    path = tmp_path / "r.png"
    assert not plot_recipe_groups([_unit("bf16", "clean", False)], path) and not path.exists()
    units = [
        _unit("bf16", "clean", False),
        _unit("mxfp8", "clean", True),
        _unit("mxfp8", "outliers", True),
    ]
    assert plot_recipe_groups(units, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # page-wide: 7.5 in at 110 dpi, so the site shows it at its size (it was 1560 px wide)
    from matplotlib.image import imread

    height, width = imread(path).shape[:2]
    assert width == 825 and height < 2 * 2 * 2.6 * 110 + 200
