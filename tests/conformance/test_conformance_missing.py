"""The conformance matrix names a peer library that is not installed."""

from __future__ import annotations

from precisionlab.cli import main


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
