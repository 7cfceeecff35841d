"""The import graph of the package: layered, acyclic, without importlib registries.

Read from the source (every ``import`` statement, also those inside functions), so a lazy import
cannot hide an edge. Layers, lowest first; a module may import its own layer and those below:

    _schema, _io, _text, _clock, _alloc (neutral helpers) -> intercept (the one JAX boundary)
    -> formats -> bits -> quant -> metrics -> survey -> mixed -> recipes, emulate
    -> compute_audit -> (precisionlab facade)
    -> telemetry -> train -> memory -> bench -> consistency -> experiments, verify -> diagnose
    -> conformance -> cli -> __main__
"""

import ast
import pathlib
import sys
import textwrap

import precisionlab

ROOT = pathlib.Path(precisionlab.__file__).parent

LAYERS = [
    ("_schema", "_io", "_text", "_clock", "_alloc"),
    ("intercept",),  # the one module reading JAX's internals; imports nothing else of ours
    ("formats",),
    ("bits",),
    ("quant",),
    ("metrics", "hardware"),
    ("survey",),
    ("mixed",),
    ("recipes", "emulate"),
    ("compute_audit",),
    ("",),  # precisionlab/__init__.py: re-exports formats, bits, quant and compute_audit.audit
    ("telemetry",),
    ("train",),
    ("memory",),
    ("bench",),
    ("consistency",),  # runs models under numerics stacks; the mismatch experiment uses it
    ("experiments", "verify"),  # verify records steps of the runner's runs (RecordHook)
    ("diagnose",),  # runs experiment variants and compares them
    ("conformance",),  # writes its report into a run directory of the store
    ("cli",),
    ("__main__",),
]
RANK = {group: rank for rank, groups in enumerate(LAYERS) for group in groups}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_package(name: str, modules: dict[str, pathlib.Path]) -> bool:
    return modules[name].name == "__init__.py"


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The precisionlab modules ``name`` imports (a ``from P import X`` of a submodule X counts
    as importing P.X; of a name, as importing P)."""
    found = set()
    package = name if _is_package(name, modules) else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "precisionlab")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.split(".")[0] != "precisionlab":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in modules else target)
    return {m for m in found if m != name}


def _group(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    missing = sorted({_group(m) for m in _modules()} - set(RANK))
    assert not missing, f"add these to LAYERS: {missing}"


def test_no_upward_imports():
    upward = [
        f"{src} -> {dst}"
        for src, targets in _graph().items()
        for dst in targets
        if RANK[_group(dst)] > RANK[_group(src)]
    ]
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_checker_sees_cycles_and_upward_edges():
    # The checker itself must be able to fail.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert RANK["bench"] < RANK["cli"] and RANK["train"] < RANK["experiments"]
    modules = _modules()
    assert "precisionlab.train._config" in _imports(
        "precisionlab.train._loop", modules["precisionlab.train._loop"], modules
    )


def _registry_imports(source: str) -> list[str]:
    """Calls of ``import_module``/``__import__`` whose argument names a precisionlab module (a
    registry of our own modules hidden from the import graph). Importing an optional third-party
    peer by name (ml_dtypes, gfloat, torch) is not a registry."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = ast.unparse(node.args[0])
            if name in ("import_module", "__import__") and (
                "precisionlab" in arg or arg.startswith(("'.", '".', "f'.", 'f".'))
            ):
                found.append(arg)
    return found


def test_no_importlib_registries():
    users = [n for n, p in _modules().items() if _registry_imports(p.read_text(encoding="utf-8"))]
    assert users == []


def test_the_registry_check_can_fail():
    assert _registry_imports('importlib.import_module(f"precisionlab.cli.{m}")')
    assert _registry_imports("__import__('precisionlab.train')")
    assert not _registry_imports("importlib.import_module(name)")  # an optional peer library


# --- the layout page, generated from the tree ---------------------------------------------
PAGE = ROOT.parent / "docs" / "explanations" / "layout.md"
BEGIN = "<!-- layout: generated by `python tests/project/test_layering.py --update` -->"
END = "<!-- /layout -->"
OTHER = {  # the folders beside the package, in the order shown
    "experiments": "the shipped experiment files",
    "notebooks": "the notebooks of the site (committed with their outputs)",
    "tools": "scripts run by hand",
    "docs": "this site (guides, explanations, benchmarks, references generated from the code)",
    "tests": "by subject: one folder per package, models/, docs/, project/",
}


def _summary(path: pathlib.Path) -> str:
    """The first sentence of a module's or package's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".")


def _entry(name: str, text: str, indent: int = 2) -> list[str]:
    lines = textwrap.wrap(text, 78) or [""]
    first = f"{' ' * indent}{name:<{22 - indent}}{lines[0]}".rstrip()
    return [first] + [" " * 22 + line for line in lines[1:]]


def layout_text() -> str:
    """The page's generated part: the package's entries with their docstrings' first sentence
    and their modules, the folders beside it, and the layers of LAYERS."""
    out = ["```", "precisionlab/"]
    for path in sorted(ROOT.iterdir()):
        if path.name.startswith("__") or path.suffix not in (".py", ""):
            continue
        if path.is_dir():
            if not (path / "__init__.py").exists():
                continue
            subs = sorted(
                p.stem if p.suffix else f"{p.name}/"
                for p in path.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
            )
            out += _entry(f"{path.name}/", _summary(path / "__init__.py") + ": " + ", ".join(subs))
        else:
            out += _entry(path.name, _summary(path))
    for folder, what in OTHER.items():
        here = ROOT.parent / folder
        names = (
            sorted(
                p.name
                for p in here.iterdir()
                if p.suffix in (".toml", ".ipynb", ".py")
                and p.name != "conftest.py"
                and not p.name.startswith("_")
            )
            if folder in ("experiments", "notebooks", "tools")
            else []
        )
        out += _entry(f"{folder}/", what + (": " + ", ".join(names) if names else ""), 0)
    out.append("```")
    layers = " -> ".join(
        "(" + ", ".join(f"`{g or 'precisionlab'}`" for g in groups) + ")"
        if len(groups) > 1
        else f"`{groups[0] or 'precisionlab'}`"
        for groups in LAYERS
    )
    out.append("")
    out += textwrap.wrap(
        f"Imports go one way, lowest first; a module may import its own layer and those below: "
        f"{layers}. `tests/project/test_layering.py` reads every import of the package (lazy ones "
        "included) and fails on an upward import, a cycle or an `importlib` registry.",
        100,
        break_on_hyphens=False,
    )
    return "\n".join(out) + "\n"


def _page_with(text: str) -> str:
    page = PAGE.read_text(encoding="utf-8")
    head, _, rest = page.partition(BEGIN + "\n")
    _, _, tail = rest.partition(END)
    assert rest and tail is not None, f"{PAGE} has no {BEGIN} ... {END} region"
    return head + BEGIN + "\n" + text + END + tail


def test_the_layout_page_is_current():
    page = PAGE.read_text(encoding="utf-8")
    assert page == _page_with(layout_text()), (
        f"{PAGE.relative_to(ROOT.parent)} is stale: python tests/project/test_layering.py --update"
    )


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/project/test_layering.py --update")
    PAGE.write_text(_page_with(layout_text()), encoding="utf-8")
    print(f"wrote {PAGE}")
