"""The trainer stays a step plus hooks (issue 38): ``train_loop`` at most 60 lines and 8
parameters, ``build_step`` at most 80 lines. What grows goes into a hook or a helper."""

import ast
import inspect

import pytest

from precisionlab.train import _loop, _step

LIMITS = [(_loop, "train_loop", 60, 8), (_step, "build_step", 80, None)]


def size(module, name: str) -> tuple[int, int]:
    """(lines from ``def`` to the last line, parameters) of a top-level function."""
    tree = ast.parse(inspect.getsource(module))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    a = fn.args
    params = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return fn.end_lineno - fn.lineno + 1, params


@pytest.mark.parametrize(("module", "name", "max_lines", "max_params"), LIMITS)
def test_the_trainer_keeps_its_size(module, name, max_lines, max_params):
    lines, params = size(module, name)
    assert lines <= max_lines, (
        f"{name} has {lines} lines (at most {max_lines}): move code to a hook"
    )
    if max_params is not None:
        assert params <= max_params, f"{name} takes {params} parameters (at most {max_params})"


def test_the_measure_counts_what_it_should():
    assert size(inspect.getmodule(size), "size") == (7, 2)
