"""Rename modules of precisionlab and rewrite every reference to them in the repository.

    python tools/rename_modules.py [MAPPING]          # default: tools/privacy_renames.txt
    python tools/rename_modules.py --dry-run          # say what would change, change nothing
    python tools/rename_modules.py --propose          # mapping lines for modules breaking the rule

MAPPING holds one ``old.dotted.module -> new.dotted.module`` pair a line (``#`` starts a
comment); a pair may name a package (its directory moves whole). The script

1. ``git mv``-s each old file or package to its new place (a pair whose new place already
   exists and whose old one does not is done: skipped; both existing is an error to resolve);
2. rewrites, in every file git tracks (sources, tests, tools, docs, README, notebooks,
   pyproject.toml, .ci/run; the mapping and this script excepted):
   - ``from package import old`` -> ``from package import _new as old`` (Python, read with
     ``ast``, so multi-line imports and aliases are exact; single-line imports elsewhere),
   - dotted names ``precisionlab.a.old`` (whole words: ``precisionlab.a.old_x`` is another
     module) in imports, strings (``mock.patch`` targets, ``python -m``, mypy's module
     lists) and prose,
   - file paths ``precisionlab/a/old.py`` and ``a/old.py`` (and ``a/old/`` for a package),
   - Sphinx's relative references in the package's docstrings (``:mod:`.old``` in package a);
3. sorts and formats the Python files it changed (``ruff``), when ruff is installed.

It is idempotent: run again after merging branches that still use the old names (or add new
imports of them), it moves nothing already moved and rewrites only what is new. A name that a
package's ``__init__`` binds to something else (``precisionlab.diagnose.bisect`` is the function
``bisect``, re-exported) is rewritten only where it can only mean the module: followed by
``.attribute`` (or ``.*``), after ``import `` or ``-m ``, before `` import``, or as a whole quoted
string (``"precisionlab.memory.fit"`` in mypy's module lists, ``sys.modules``) in the run that
moves the module only: once the module has moved, ``"precisionlab.hardware.gemm"`` names what
the package binds (the function ``gemm``), and a rerun leaves it alone.

``--propose`` lists, as mapping lines, the modules that break the privacy rule of
docs/contributing.md: every module that is not a namespace of docs/reference/public_api.txt
(nor an [internal] package) has a name starting with ``_``; a subpackage that is not a namespace
is renamed whole. Append its output to the mapping and run the script.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MAPPING = ROOT / "tools" / "privacy_renames.txt"
API_LIST = ROOT / "docs" / "reference" / "public_api.txt"
PACKAGE = "precisionlab"


@dataclass(frozen=True)
class Rename:
    """One module (or package) move: dotted names, old and new."""

    old: str
    new: str

    @property
    def parent(self) -> str:
        return self.old.rpartition(".")[0]

    @property
    def old_leaf(self) -> str:
        return self.old.rpartition(".")[2]

    @property
    def new_leaf(self) -> str:
        return self.new.rpartition(".")[2]


def read_mapping(path: Path) -> list[Rename]:
    renames = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        old, sep, new = (part.strip() for part in line.partition("->"))
        if not sep or not old or not new:
            raise SystemExit(f"{path}:{number}: expected 'old.module -> new.module', got {raw!r}")
        for name in (old, new):
            if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", name):
                raise SystemExit(f"{path}:{number}: {name!r} is not a dotted module name")
        if old.rpartition(".")[0] != new.rpartition(".")[0]:
            raise SystemExit(f"{path}:{number}: {old} -> {new} changes the parent package")
        renames.append(Rename(old, new))
    olds = [r.old for r in renames]
    dupes = sorted({o for o in olds if olds.count(o) > 1})
    if dupes:
        raise SystemExit(f"{path}: modules renamed twice: {dupes}")
    return renames


def module_path(dotted: str) -> Path:
    """The file (``x.py``) or package directory (``x/``) of a dotted module, existing or not."""
    base = ROOT.joinpath(*dotted.split("."))
    return base if base.is_dir() else base.with_suffix(".py")


def rel_path(dotted: str, is_package: bool) -> str:
    """``precisionlab.train._loop`` -> ``train/_loop.py`` (``train/_models`` for a package)."""
    parts = dotted.split(".")[1:]
    return "/".join(parts) + ("" if is_package else ".py")


def move_files(renames: list[Rename], dry_run: bool) -> tuple[dict[str, bool], set[str]]:
    """git mv each old module to its new place; returns which renames are packages, and the
    old names moved by this run."""
    packages = {}
    moved = set()
    for r in renames:
        old_dir = ROOT.joinpath(*r.old.split("."))
        new_dir = ROOT.joinpath(*r.new.split("."))
        old_file, new_file = old_dir.with_suffix(".py"), new_dir.with_suffix(".py")
        if old_dir.is_dir() or new_dir.is_dir():
            packages[r.old] = True
            old, new = old_dir, new_dir
        else:
            packages[r.old] = False
            old, new = old_file, new_file
        if old.exists() and new.exists():
            raise SystemExit(f"both {old.relative_to(ROOT)} and {new.relative_to(ROOT)} exist: "
                             "merge them by hand, then run again")  # fmt: skip
        if not old.exists():
            if not new.exists():
                print(f"warning: neither {r.old} nor {r.new} exists", file=sys.stderr)
            continue
        print(f"move {old.relative_to(ROOT)} -> {new.relative_to(ROOT)}")
        moved.add(r.old)
        if not dry_run:
            subprocess.run(["git", "mv", str(old), str(new)], cwd=ROOT, check=True)
    return packages, moved


def bound_in_init(package: str) -> set[str]:
    """Names a package's ``__init__`` binds to something other than its own submodule."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    if not init.exists():
        return set()
    names: set[str] = set()
    tree = ast.parse(init.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module == package:
                continue  # ``from package import sub``: the submodule itself
            names.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.asname)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                value = node.value
                if isinstance(value, ast.List | ast.Tuple):
                    names.update(e.value for e in value.elts if isinstance(e, ast.Constant))
    return names


class Rewriter:
    """The text rewrites of one mapping."""

    def __init__(
        self, renames: list[Rename], packages: dict[str, bool], moved: set[str] | None = None
    ) -> None:
        self.renames = renames
        self.by_parent: dict[str, dict[str, Rename]] = {}
        for r in renames:
            self.by_parent.setdefault(r.parent, {})[r.old_leaf] = r
        shadowed = {r.old for r in renames if r.old_leaf in bound_in_init(r.parent)}
        self.shadowed = shadowed
        ordered = sorted(renames, key=lambda r: -len(r.old))
        self.new_of = {r.old: r.new for r in renames}
        plain = [re.escape(r.old) for r in ordered if r.old not in shadowed]
        shadow = [re.escape(r.old) for r in ordered if r.old in shadowed]
        # a whole quoted string means the module only while the module is there to be moved
        quoted = [re.escape(r.old) for r in ordered if r.old in shadowed & (moved or set())]
        patterns = []
        if plain:
            patterns.append(rf"(?<![\w.])(?P<plain>{'|'.join(plain)})(?!\w)")
        if shadow:
            alts = "|".join(shadow)
            patterns.append(
                rf"(?<![\w.])(?P<shadow>{alts})(?=\.[A-Za-z_*])"
                rf"|(?:(?<=import )|(?<=-m ))(?P<shadow2>{alts})(?![\w.])"
                rf"|(?<![\w.])(?P<shadow3>{alts})(?=\s+import\b)"
            )
            if quoted:
                patterns[-1] += rf"|(?<=[\"'])(?P<shadow4>{'|'.join(quoted)})(?=[\"'])"
        self.dotted = re.compile("|".join(patterns)) if patterns else None
        self.path_new: dict[str, str] = {}
        path_alts = []
        for r in ordered:
            is_pkg = packages.get(r.old, False)
            old, new = rel_path(r.old, is_pkg), rel_path(r.new, is_pkg)
            self.path_new[old] = new
            tail = r"(?![\w.])" if is_pkg else r"(?!\w)"
            path_alts.append(re.escape(old) + tail)
        start = rf"(?:(?<={PACKAGE}/)|(?<![\w./-]))"
        self.paths = (
            re.compile(start + "(?P<path>" + "|".join(path_alts) + ")") if path_alts else None
        )

    def _dotted_sub(self, m: re.Match[str]) -> str:
        old = next(v for v in m.groupdict().values() if v)
        return self.new_of[old]

    def _path_sub(self, m: re.Match[str]) -> str:
        return self.path_new[m.group("path")]

    def alias(self, package: str, name: str, asname: str | None) -> str | None:
        """The new text of ``name [as asname]`` imported from ``package``, or None to keep."""
        r = self.by_parent.get(package, {}).get(name)
        if r is None or r.old in self.shadowed:
            return None
        return f"{r.new_leaf} as {asname or name}"

    def python_imports(self, text: str) -> str:
        """``from package import old`` -> ``from package import _new as old``, and
        ``package.old`` -> ``package._new`` where ``package`` is a name bound to the package
        (``from precisionlab import verify``; ``verify.hook.parse_steps``), exactly."""
        try:
            tree = ast.parse(text)
        except SyntaxError:
            return self.line_imports(text)
        edits = []
        packages: dict[str, str] = {}  # local name -> the renamed modules' package it binds
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname and a.name in self.by_parent:
                        packages[a.asname] = a.name
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            for a in node.names:
                if f"{node.module}.{a.name}" in self.by_parent:
                    packages[a.asname or a.name] = f"{node.module}.{a.name}"
                new = self.alias(node.module, a.name, a.asname)
                if new is not None:
                    edits.append((a.lineno, a.col_offset, a.end_lineno, a.end_col_offset, new))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                package = packages.get(node.value.id)
                r = self.by_parent.get(package or "", {}).get(node.attr)
                if r is not None and r.old not in self.shadowed and node.end_col_offset:
                    end = node.end_col_offset
                    start = end - len(node.attr.encode("utf-8"))
                    edits.append((node.end_lineno, start, node.end_lineno, end, r.new_leaf))
        if not edits:
            return text
        lines = text.splitlines(keepends=True)
        for line, col, end_line, end_col, new in sorted(edits, reverse=True):
            assert line == end_line, "an import alias spans lines"
            raw = lines[line - 1].encode("utf-8")
            lines[line - 1] = (raw[:col] + new.encode("utf-8") + raw[end_col:]).decode("utf-8")
        return "".join(lines)

    _LINE_IMPORT = re.compile(r"(?P<head>\bfrom\s+(?P<pkg>[\w.]+)\s+import\s+)(?P<names>[^\n(\\]+)")

    def line_imports(self, text: str) -> str:
        """The same, for single-line imports in docs, notebooks and strings (text, not Python)."""

        def names_sub(m: re.Match[str]) -> str:
            package = m.group("pkg")
            if package not in self.by_parent:
                return m.group(0)
            names = m.group("names")
            out = []
            for item in re.split(r"(,\s*)", names):
                parsed = re.fullmatch(r"(\s*)(\w+)(?:\s+as\s+(\w+))?(.*)", item, re.S)
                if parsed and not item.startswith(","):
                    lead, name, asname, rest = parsed.groups()
                    new = self.alias(package, name, asname)
                    if new is not None:
                        item = f"{lead}{new}{rest}"
                out.append(item)
            return m.group("head") + "".join(out)

        return self._LINE_IMPORT.sub(names_sub, text)

    def relative_refs(self, text: str, package: str) -> str:
        """Sphinx's relative references in a docstring of ``package``: ``:mod:`.old```."""
        renamed = self.by_parent.get(package, {})

        def sub(m: re.Match[str]) -> str:
            r = renamed.get(m.group(2))
            return m.group(0) if r is None else f"{m.group(1)}{r.new_leaf}{m.group(3)}"

        return re.sub(r"(:\w+:`~?\.)(\w+)([.`])", sub, text)

    def rewrite(self, text: str, is_python: bool, package: str = "") -> str:
        if is_python:  # then the imports inside strings (``python -c`` scripts, examples)
            text = self.python_imports(text)
        text = self.line_imports(text)
        if package:
            text = self.relative_refs(text, package)
        if self.dotted is not None:
            text = self.dotted.sub(self._dotted_sub, text)
        if self.paths is not None:
            text = self.paths.sub(self._path_sub, text)
        return text


def tracked_files(skip: set[Path]) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True)
    files = [ROOT / name for name in out.stdout.decode("utf-8").split("\0") if name]
    return [f for f in files if f.is_file() and f.resolve() not in skip]


def rewrite_tree(rewriter: Rewriter, skip: set[Path], dry_run: bool) -> list[Path]:
    changed = []
    for path in tracked_files(skip):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "\0" in text:
            continue
        rel = path.relative_to(ROOT)
        package = ".".join(rel.parts[:-1]) if rel.parts[0] == PACKAGE else ""
        new = rewriter.rewrite(text, is_python=path.suffix == ".py", package=package)
        if new != text:
            changed.append(path)
            print(f"rewrite {path.relative_to(ROOT)}")
            if not dry_run:
                path.write_text(new, encoding="utf-8")
    return changed


def tidy(changed: list[Path]) -> None:
    """Import order and formatting of the changed Python files (names moved in the sort)."""
    python = [str(p) for p in changed if p.suffix == ".py" and "notebooks" not in p.parts]
    if not python or shutil.which("ruff") is None:
        return
    subprocess.run(["ruff", "check", "--select", "I", "--fix", "-q", *python], cwd=ROOT)
    subprocess.run(["ruff", "format", "-q", *python], cwd=ROOT, check=True)


def namespaces() -> tuple[set[str], set[str]]:
    """The public namespaces and the [internal] packages of docs/reference/public_api.txt."""
    public: set[str] = set()
    internal: set[str] = set()
    section = None
    for raw in API_LIST.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            if section != "internal":
                public.add(section)
        elif line and section == "internal":
            internal.add(line)
    return public, internal


def is_private(dotted: str) -> bool:
    return any(part.startswith("_") for part in dotted.split(".")[1:])


def propose() -> list[str]:
    """Mapping lines for every module breaking the rule (public name, not a namespace)."""
    public, internal = namespaces()
    allowed = public | internal
    lines = []
    renamed_packages: list[str] = []
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        dotted = ".".join(parts)
        if dotted in allowed or is_private(dotted) or parts[-1] == "__main__":
            continue
        if any(dotted.startswith(p + ".") for p in renamed_packages):
            continue
        parent, _, leaf = dotted.rpartition(".")
        lines.append(f"{dotted} -> {parent}._{leaf}")
        if path.name == "__init__.py":
            renamed_packages.append(dotted)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mapping", nargs="?", type=Path, default=DEFAULT_MAPPING)
    parser.add_argument("--dry-run", action="store_true", help="change nothing, say what")
    parser.add_argument("--propose", action="store_true", help="print mapping lines, then exit")
    parser.add_argument("--no-tidy", action="store_true", help="do not run ruff on the result")
    args = parser.parse_args(argv)
    if args.propose:
        print("\n".join(propose()))
        return 0
    renames = read_mapping(args.mapping)
    packages, moved = move_files(renames, args.dry_run)
    rewriter = Rewriter(renames, packages, moved)
    changed = rewrite_tree(
        rewriter, {args.mapping.resolve(), Path(__file__).resolve()}, args.dry_run
    )
    if not args.dry_run and not args.no_tidy:
        tidy(changed)
    left = propose()
    if left:
        print(f"{len(left)} modules still break the privacy rule (add them to the mapping):")
        print("\n".join(f"  {line}" for line in left))
    return 0


if __name__ == "__main__":
    sys.exit(main())
