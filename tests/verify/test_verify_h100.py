"""The H100 captures of tests/data/h100_gemm.npz (see tests/data/README.md), repackaged as
dumps and recomputed through ``precisionlab.verify.check``: the same path a recorded step's
GEMMs take, with the hardware model each capture is known to follow."""

from __future__ import annotations

import pathlib

import ml_dtypes
import numpy as np
import pytest

from precisionlab import verify

DATA = np.load(pathlib.Path(__file__).parents[1] / "data" / "h100_gemm.npz")
E4 = ml_dtypes.float8_e4m3fn
#: Where the captures were made (tests/data/README.md, h100_gemm.npz).
H100 = {
    "device_kind": "NVIDIA H100 80GB HBM3", "backend": "gpu", "driver": "580.159",
    "cuda": "13.0", "jax": "0.11.2", "jaxlib": "0.11.2", "torch": "2.11.0+cu130",
    "source": "tests/data/h100_gemm.npz (captured 2026-11-26)",
}  # fmt: skip
SCALES = ((1.0, 1.0), (0.375, 3.0), (2.0**-7, 2.0**5), (1.1, 0.9))


def _fp8(k):
    return DATA[f"fp8_a_{k}"].view(E4), DATA[f"fp8_b_{k}"].view(E4)


def torch_cases(ks):
    """torch._scaled_mm (cuBLASLt), scales 1, fast accumulation off and on."""
    out = []
    for k in ks:
        a, b = _fp8(k)
        for fast, hw in ((0, "h100-cublaslt"), (1, "h100-cublaslt-fast")):
            out.append({"id": f"torch_fast{fast}_{k}", "a": a, "b": b, "hardware": hw,
                        "out": DATA[f"fp8_torch_fast{fast}_{k}"]})  # fmt: skip
    return out


def scaled_cases(out_name):
    """P7 (32 x 256 x 32): torch._scaled_mm with scale_a, scale_b and 16-bit outputs."""
    dt = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[out_name]
    a, b = DATA["a_P7"].view(E4), DATA["b_P7"].view(E4)
    out = []
    for sa, sb in SCALES:
        for fast, hw in ((0, "h100-cublaslt"), (1, "h100-cublaslt-fast")):
            y = DATA[f"P7_{out_name}_{sa}_{sb}_fast{fast}"].astype(dt)  # widened: exact back
            out.append({"id": f"P7_{out_name}_{sa}_{sb}_fast{fast}", "a": a, "b": b,
                        "out": y, "hardware": hw, "scale_a": sa, "scale_b": sb})  # fmt: skip
    return out


def xla_cases():
    """XLA's FP8 and 16-bit GEMMs with the schedules tests/hardware/test_hardware.py established."""
    out = []
    for key, k, every in (("fp8_xla_DEFAULT_256", 256, 32), ("fp8_xla_HIGHEST_256", 256, 32)):
        a, b = _fp8(k)
        out.append({"id": key, "a": a, "b": b, "out": DATA[key], "hardware": "h100-cublaslt",
                    "overrides": {"restart_every": every}})  # fmt: skip
    a, b = _fp8(1024)
    out.append({"id": "fp8_xla_HIGHEST_1024", "a": a, "b": b, "hardware": "h100-xla",
                "out": DATA["fp8_xla_HIGHEST_1024"],
                "overrides": {"split_k": 64, "split_order": (3, 2, 1, 0)}})  # fmt: skip
    for name, dt in (("f16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        a, b = DATA[f"g16_{name}_a"].view(dt), DATA[f"g16_{name}_b"].view(dt)
        ov = {"split_k": 128, "split_order": (4, 3, 2, 1, 0)}
        out.append({"id": f"g16_{name}_f32out", "a": a, "b": b, "hardware": "h100-xla",
                    "out": DATA[f"g16_{name}_xla_f32out"], "overrides": ov})  # fmt: skip
        out.append({"id": f"g16_{name}", "a": a, "b": b, "hardware": "h100-xla",
                    "out": DATA[f"g16_{name}_xla"].view(dt), "overrides": ov})  # fmt: skip
    return out


def _verify(tmp_path, cases, name="h100"):
    path = verify.gemm_dump(tmp_path / name, cases, environment=H100)
    rep = verify.check(path)
    outs = [t for t in rep.tensors if t.role == "output"]
    assert len(outs) == len(cases)
    return rep


def test_h100_captures_verify_through_the_dump_path(tmp_path):
    rep = _verify(tmp_path, torch_cases([256]) + scaled_cases("f32"))
    assert rep.ok and rep.share() == 1.0, rep.text()
    assert rep.environment["device_kind"] == "NVIDIA H100 80GB HBM3"


def test_h100_capture_under_the_wrong_preset_is_an_accumulator_difference(tmp_path):
    """cuBLASLt's fast-accumulation output claimed as its default (promotion every 128): the
    check says which preset the output does follow."""
    case = torch_cases([256])[1]
    rep = _verify(tmp_path, [{**case, "hardware": "h100-cublaslt"}])
    assert rep.label == "accumulator", rep.text()
    assert "h100-cublaslt-fast" in rep.first.detail


@pytest.mark.slow
def test_h100_captures_every_schedule(tmp_path):
    cases = torch_cases([1024, 4096, 16384]) + scaled_cases("bf16") + scaled_cases("f16")
    rep = _verify(tmp_path, cases + xla_cases())
    assert rep.ok and rep.share() == 1.0, rep.text()
