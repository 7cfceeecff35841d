"""One privacy rule for the whole package (equinox's), read from the source.

- The public modules are exactly the namespaces of ``docs/reference/public_api.txt`` (a
  ``[section]`` each) and the ``[internal]`` packages (the command line, the benchmarks); every
  other module under ``precisionlab`` is private: its name, or its package's, starts with ``_``.
- A name imported from another module is never underscored (``from m import _x``, ``m._x``):
  a helper shared between modules gets a public name inside its private module.

Tests may import anything; this checks the package only.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "precisionlab"
API_LIST = ROOT / "docs" / "reference" / "public_api.txt"
RENAMES = "tools/privacy_renames.txt"


def listed_modules(path: Path = API_LIST) -> set[str]:
    """The namespaces (``[section]`` names) and ``[internal]`` packages of public_api.txt."""
    out: set[str] = set()
    section = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            if section != "internal":
                out.add(section)
        elif line and section == "internal":
            out.add(line)
    return out


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def public_module_problems(modules: dict[str, Path], listed: set[str]) -> list[str]:
    """Modules with a public name (no ``_`` part) that are no listed namespace, with the fix."""
    problems = []
    for name, path in sorted(modules.items()):
        parts = name.split(".")
        if name in listed or parts[-1] == "__main__":
            continue
        if any(p.startswith("_") for p in parts[1:]):
            continue
        parent, _, leaf = name.rpartition(".")
        kind = "package" if path.name == "__init__.py" else "module"
        problems.append(
            f"{path.relative_to(ROOT) if path.is_absolute() else path}: the {kind} {name} has a "
            f"public name but is no namespace of docs/reference/public_api.txt. Make it "
            f"private: add the line '{name} -> {parent}._{leaf}' to {RENAMES} and run "
            f"`python tools/rename_modules.py` (it moves the file and rewrites every "
            f"reference); or, if users import it, give it an __all__ and a [{name}] section "
            "in public_api.txt"
        )
    return problems


def private_name_imports(
    source: str, module: str, is_package: bool, is_module: Callable[[str], bool], where: str
) -> list[str]:
    """``from m import _x`` and ``m._x`` (``m`` an imported precisionlab module) in one file,
    ``_x`` not a submodule; dunders (``__version__``) are not private."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    package = module if is_package else module.rpartition(".")[0]
    modules: dict[str, str] = {}  # local name -> the precisionlab module it is bound to
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "precisionlab" and alias.asname:
                    modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "precisionlab":
                continue
            for alias in node.names:
                if is_module(f"{target}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{target}.{alias.name}"
                elif private(alias.name):
                    found.append(
                        f"{where}:{node.lineno}: imports the private name {alias.name} from "
                        f"{target}. Give it a public name there (rename {alias.name} to "
                        f"{alias.name.lstrip('_')} in {target} and its users): a name shared "
                        "between modules is public inside its private module"
                    )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and private(node.attr)
        ):
            target = modules[node.value.id]
            found.append(
                f"{where}:{node.lineno}: uses the private name {node.value.id}.{node.attr} of "
                f"{target}. Give it a public name there (rename {node.attr} to "
                f"{node.attr.lstrip('_')} in {target} and its users)"
            )
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_outside_the_listed_namespaces_is_private():
    problems = public_module_problems(package_modules(), listed_modules())
    assert not problems, "\n".join(problems)


def test_every_listed_namespace_is_a_module():
    modules = package_modules()
    missing = sorted(listed_modules() - set(modules))
    assert not missing, f"docs/reference/public_api.txt lists modules that do not exist: {missing}"


def test_no_module_imports_another_modules_private_names():
    modules = package_modules()
    found = []
    for name, path in modules.items():
        found += private_name_imports(
            path.read_text(encoding="utf-8"),
            name,
            path.name == "__init__.py",
            modules.__contains__,
            str(path.relative_to(ROOT)),
        )
    assert not found, "\n".join(found)


# --- the checks can fail ------------------------------------------------------------------------
KNOWN = {"precisionlab.a", "precisionlab.a._b", "precisionlab.a._c", "precisionlab.a.d"}


@pytest.mark.parametrize(
    "source",
    [
        "from precisionlab.a._b import _helper",
        "from ._b import _helper",
        "from precisionlab.a import _b\nx = _b._helper",
        "import precisionlab.a._b as b\nb._helper()",
    ],
)
def test_the_import_check_sees_private_names(source):
    found = private_name_imports(source, "precisionlab.a._c", False, KNOWN.__contains__, "c.py")
    assert len(found) == 1 and "_helper" in found[0] and "rename _helper to helper" in found[0]


@pytest.mark.parametrize(
    "source",
    [
        "from precisionlab.a._b import helper",
        "from precisionlab.a import _b\nx = _b.helper",
        "from precisionlab.a import _b as b",  # a private module is imported by the package
        "from precisionlab import __version__",
        "from precisionlab.a._b import helper as _helper",  # a local alias stays local
        "import numpy as np\nnp._private",  # other libraries are theirs to judge
    ],
)
def test_the_import_check_passes_public_names(source):
    assert private_name_imports(source, "precisionlab.a._c", False, KNOWN.__contains__, "c") == []


def test_the_module_check_names_the_file_and_the_fix():
    modules = {
        "precisionlab.a": Path("precisionlab/a/__init__.py"),
        "precisionlab.a.d": Path("precisionlab/a/d.py"),
        "precisionlab.a._b": Path("precisionlab/a/_b.py"),
        "precisionlab.e": Path("precisionlab/e/__init__.py"),
        "precisionlab.e.f": Path("precisionlab/e/f.py"),
        "precisionlab.__main__": Path("precisionlab/__main__.py"),
    }
    problems = public_module_problems(modules, {"precisionlab.a", "precisionlab.e.f"})
    assert len(problems) == 2, problems
    assert problems[0].startswith("precisionlab/a/d.py: the module precisionlab.a.d")
    assert "'precisionlab.a.d -> precisionlab.a._d'" in problems[0]
    assert problems[1].startswith("precisionlab/e/__init__.py: the package precisionlab.e")
