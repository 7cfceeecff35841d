"""tools/rename_modules.py: a rerun after the move leaves a quoted name that now means what
the package binds (``"precisionlab.hardware.gemm"``, the function) alone; the run that moves
the module rewrites it (then it can only mean the module, which is there)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "rename_modules", ROOT / "tools/rename_modules.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TEXT = 'key = "precisionlab.hardware.gemm"\nfrom precisionlab.hardware.gemm import x\n'


def _rewrite(moved: set[str]) -> str:
    tool = _tool()
    rename = tool.Rename("precisionlab.hardware.gemm", "precisionlab.hardware._gemm")
    assert rename.old in tool.Rewriter([rename], {}).shadowed  # the package binds ``gemm``
    rewriter = tool.Rewriter([rename], {rename.old: False}, moved)
    return rewriter.rewrite(TEXT, is_python=False)


def test_a_rerun_leaves_a_quoted_bound_name_alone():
    out = _rewrite(moved=set())
    assert '"precisionlab.hardware.gemm"' in out  # the function, as the package binds it
    assert "from precisionlab.hardware._gemm import x" in out  # only the module can be meant


def test_the_moving_run_rewrites_the_quoted_module_name():
    out = _rewrite(moved={"precisionlab.hardware.gemm"})
    assert '"precisionlab.hardware._gemm"' in out
    assert "from precisionlab.hardware._gemm import x" in out
