"""The project's tooling configuration: one source for the version, and mypy's to-do lists
naming modules that exist (a renamed or deleted module must leave them)."""

import ast
import pathlib
import tomllib

import precisionlab

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_version_is_written_once():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "precisionlab.__version__"
    }
    # setuptools reads the attribute statically: a plain string literal in __init__.py
    tree = ast.parse((ROOT / "precisionlab" / "__init__.py").read_text(encoding="utf-8"))
    values = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
    ]
    assert values == [precisionlab.__version__]


def test_mypy_exempts_no_module_of_the_package():
    """Every module of the package is checked as [tool.mypy] says (the to-do lists of issue 38
    are empty): an override may relax third-party modules only."""
    ours = [
        m
        for o in PYPROJECT["tool"]["mypy"]["overrides"]
        for m in o["module"]
        if m.startswith("precisionlab")
    ]
    assert not ours, f"modules of the package exempted from mypy's checks: {ours}"


def test_ci_runs_the_pinned_linters_and_type_checker():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert {"ruff check .", "ruff format --check .", "mypy"} <= set(ci)
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("mypy==") for d in dev) and any(d.startswith("ruff==") for d in dev)
