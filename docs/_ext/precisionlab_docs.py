"""Sphinx extension: the reference pages generated from the code, so they cannot drift.

At ``builder-inited`` it writes (under ``docs/reference/``, git-ignored):

- ``api.rst`` and ``api/<namespace>.rst``: one page per namespace of
  ``reference/public_api.txt`` (the reviewed public API), each name documented from its
  docstring once, where it is first listed; a public name without a docstring (or, for a
  constant, without a ``#:`` comment) is a warning, which ``-W`` makes an error;
- ``cli.rst``: every ``precisionlab`` subcommand's ``--help``, from the argparse parsers;
- ``experiment-file.rst``: every key of every experiment-file table, from the schema tables
  (:mod:`precisionlab._schema` fields: type, default, allowed values, range, description).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import os
import pkgutil
import re
import types
from pathlib import Path

from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)

DOCS = Path(__file__).resolve().parent.parent
API_LIST = DOCS / "reference" / "public_api.txt"


# --- the public API list ------------------------------------------------------------------------
def read_api_list(path: Path = API_LIST) -> dict[str, list[str]]:
    """``{namespace: [names]}`` from public_api.txt (``[internal]`` included as a section)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections[current] = []
        elif current is None:
            raise ValueError(f"{path}: {line!r} before the first [namespace]")
        else:
            sections[current].append(line)
    return sections


def _write(path: Path, text: str) -> None:
    """Write only when the text changed, so Sphinx rebuilds only what changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def _title(text: str, char: str = "=") -> list[str]:
    return [text, char * len(text), ""]


def _attr_doc(namespace: str, name: str) -> str | None:
    """The ``#:`` comment of a constant, looked up in the namespace and its submodules."""
    module = importlib.import_module(namespace)
    candidates = [namespace]
    if hasattr(module, "__path__"):
        candidates += [
            m.name
            for m in pkgutil.walk_packages(module.__path__, namespace + ".")
            if not m.name.endswith("__main__")  # importing it runs the command line
        ]
    for candidate in candidates:
        try:
            docs = ModuleAnalyzer.for_module(candidate).find_attr_docs()
        except Exception:
            continue
        lines = docs.get(("", name))
        if lines:
            return "\n".join(lines).strip()
    return None


#: short name -> [(namespace, full name)] of every object the API pages document
TARGETS: dict[str, list[tuple[str, str]]] = {}


def _paragraphs(doc: str) -> list[str]:
    """A ``#:`` comment as reST paragraphs: its lines joined (they are wrapped prose)."""
    out, current = [], []
    for line in [*doc.splitlines(), ""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            out.append(" ".join(current))
            current = []
    return out


def _api_pages(app: Sphinx) -> None:
    sections = read_api_list()
    sections.pop("internal", None)
    TARGETS.clear()
    out = DOCS / "reference" / "api"
    documented: dict[int, str] = {}  # id(object) -> the full name it is documented under
    # the top-level namespace re-exports names of the others: document them there first
    order = [ns for ns in sections if ns != "precisionlab"] + ["precisionlab"]
    pages = {}
    for namespace in order:
        module = importlib.import_module(namespace)
        lines = [*_title(f"``{namespace}``"), f".. automodule:: {namespace}", "   :no-members:", ""]
        for name in sections[namespace]:
            if not hasattr(module, name):
                logger.warning(f"public_api.txt: {namespace} has no name {name!r}")
                continue
            obj = getattr(module, name)
            full = f"{namespace}.{name}"
            routine = inspect.isroutine(obj) or inspect.isclass(obj)
            if routine and id(obj) in documented:
                lines += [
                    f".. py:data:: {name}",
                    "   :no-index:",
                    "",
                    f"   The same object as :py:obj:`{documented[id(obj)]}`.",
                    "",
                ]
                continue
            if inspect.isclass(obj):
                if not (obj.__doc__ or "").strip():
                    logger.warning(f"undocumented public class {full}: give it a docstring")
                lines += [f".. autoclass:: {full}", ""]
                documented[id(obj)] = full
                TARGETS.setdefault(name, []).append((namespace, full))
            elif inspect.isroutine(obj) and not isinstance(obj, types.UnionType):
                if not (obj.__doc__ or "").strip():
                    logger.warning(f"undocumented public function {full}: give it a docstring")
                lines += [f".. autofunction:: {full}", ""]
                documented[id(obj)] = full
                TARGETS.setdefault(name, []).append((namespace, full))
            elif inspect.ismodule(obj):
                doc = (inspect.getdoc(obj) or "").strip().splitlines()
                if not doc:
                    logger.warning(f"undocumented public module {full}: give it a docstring")
                lines += [
                    f".. py:data:: {name}",
                    "   :no-index:",
                    "",
                    f"   The module :py:mod:`{obj.__name__}`" + (f": {doc[0]}" if doc else "."),
                    "",
                ]
            else:
                doc = _attr_doc(namespace, name)
                if not doc:
                    logger.warning(f"undocumented public constant {full}: add a '#:' comment")
                    doc = ""
                lines += [f".. py:data:: {name}", ""]
                for paragraph in _paragraphs(doc):
                    lines += ["   " + paragraph, ""]
                TARGETS.setdefault(name, []).append((namespace, full))
        pages[namespace] = "\n".join(lines) + "\n"
    for namespace, text in pages.items():
        _write(out / f"{namespace}.rst", text)
    index = [
        *_title("Python API"),
        "The public API: what a user imports, one page per namespace, each generated from the "
        "docstrings. It is the list in ``docs/reference/public_api.txt``; every other module or "
        "name is private (a module whose name starts with ``_``, or a name no namespace below "
        "re-exports) and may change without notice. ``tests/project/test_public_api.py`` keeps the "
        "list and the code's ``__all__`` equal (see :doc:`../contributing`).",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
        *[f"   api/{namespace}" for namespace in sections],
        "",
    ]
    _write(DOCS / "reference" / "api.rst", "\n".join(index))
    for stale in out.glob("*.rst"):
        if stale.stem not in pages:
            stale.unlink()


# --- the command line -------------------------------------------------------------------------
def _help(parser: argparse.ArgumentParser) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        parser.print_help()
    return buffer.getvalue()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


#: Columns argparse wraps the help text to: the width the subcommands' hand-wrapped
#: descriptions are written for; docs/_static/precisionlab.css fits it in the content column.
CLI_WIDTH = 100


def _text_block(text: str) -> list[str]:
    """``text`` as a literal block shown as plain text (a bare ``::`` block would be
    highlighted as Python), of class ``cli-help`` (sized by docs/_static/precisionlab.css)."""
    body = ["   " + ln if ln else "" for ln in text.splitlines()]
    return [".. code-block:: text", "   :class: cli-help", "", *body, ""]


def _cli_page() -> str:
    from precisionlab.cli import _build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(CLI_WIDTH)  # argparse wraps to the terminal's width
    try:
        parser, _ = _build_parser()
        lines = [
            *_title("Command-line reference"),
            "Generated from the ``argparse`` parsers of ``precisionlab.cli`` "
            "(``precisionlab COMMAND --help`` prints the same).",
            "",
        ]
        lines += _text_block(_help(parser))

        def walk(p: argparse.ArgumentParser, prog: str, level: str) -> None:
            for name, sub in _subparsers(p).items():
                lines.extend(_title(f"``{prog} {name}``", level))
                lines.extend(_text_block(_help(sub)))
                walk(sub, f"{prog} {name}", "~")

        walk(parser, "precisionlab", "-")
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(lines) + "\n"


# --- the experiment files ---------------------------------------------------------------------
def _cell(text: str) -> str:
    return _escape(" ".join(str(text).split())) or "\\-"


def _schema_table(schema, undocumented: list[str], where: str) -> list[str]:
    from precisionlab._schema import REQUIRED, _range_text, describe_type

    lines = [
        ".. list-table::",
        "   :header-rows: 1",
        "   :widths: 18 10 14 28 30",
        "",
        "   * - key",
        "     - type",
        "     - default",
        "     - allowed",
        "     - meaning",
    ]
    for key, field in schema.items():
        if field.default is REQUIRED:
            default = "required"
        elif field.default is None:
            default = "off"
        else:
            default = f"``{field.default!r}``"
        allowed = field.allowed()
        allowed_text = ", ".join(f"``{a}``" for a in allowed) if allowed is not None else ""
        bounds = _range_text(field) if field.type in (int, float) else ""
        doc = field.doc
        if not doc:
            undocumented.append(f"{where}.{key}")
        typ = "a name or table" if field.type is object else describe_type(field)
        lines += [
            f"   * - ``{key}``",
            f"     - {_cell(typ)}",
            f"     - {_cell(default)}",
            f"     - {_cell(' '.join(x for x in (allowed_text, bounds) if x))}",
            f"     - {_cell(doc)}",
        ]
    return [*lines, ""]


def _experiment_page() -> str:
    from precisionlab import survey
    from precisionlab.experiments import _config as config
    from precisionlab.experiments import _mismatch_kind as mismatch_kind
    from precisionlab.experiments import _tournament as tournament
    from precisionlab.memory import _checkpointing as checkpointing
    from precisionlab.memory import _experiment as memory
    from precisionlab.train._config import TRAIN_FIELDS
    from precisionlab.train._optim import OPTIMIZER_FIELDS
    from precisionlab.train._predictors import PREDICTOR_FIELDS
    from precisionlab.train._telemetry import TELEMETRY_FIELDS

    undocumented: list[str] = []
    lines = [
        *_title("Experiment-file reference"),
        "Every key of every table of an experiment file, generated from the schema tables "
        "that validate them (``precisionlab._schema`` fields), so this page and the "
        "checks cannot disagree. How the tables combine (settings, variants, grids, "
        "seeds) is told in :doc:`../guides/experiments`. A key that is not listed is an "
        "error, never ignored.",
        "",
    ]
    tables = [
        ('Top level of a ``kind = "train"`` file', "top", config._train_top_schema()),
        ("``[train]``", "train", TRAIN_FIELDS),
        ("``[train.telemetry]``", "train.telemetry", TELEMETRY_FIELDS),
        ("``[train.predictors]``", "train.predictors", PREDICTOR_FIELDS),
        ("``[report]``", "report", config.REPORT_SCHEMA),
        ("``[diagnose]``", "diagnose", config.DIAGNOSE_SCHEMA),
        ('``[survey]`` (``kind = "survey"``)', "survey", survey.FIELDS),
        ('``[memory]`` (``kind = "memory"``)', "memory", memory.FIELDS),
        ('``[checkpointing]`` (``kind = "checkpointing"``)', "checkpointing", checkpointing.FIELDS),
        ('``[mismatch]`` (``kind = "mismatch"``)', "mismatch", mismatch_kind.FIELDS),
        ("``[mismatch.rl]``", "mismatch.rl", mismatch_kind.RL_FIELDS),
        ('``[tournament]`` (``kind = "tournament"``)', "tournament", tournament.FIELDS),
        ("``[[tournament.entry]]``", "tournament.entry", tournament.ENTRY_FIELDS),
        ("``osci_reset`` of an entry", "tournament.entry.osci_reset", tournament.OSCI_FIELDS),
    ]
    for title, where, schema in tables:
        lines += _title(title, "-") + _schema_table(schema, undocumented, where)
    lines += _title("``optimizer_kwargs``, by optimizer", "-")
    lines += [
        "Each key is the keyword of the same name of the optax constructor of the optimizer "
        "(``optax.NAME``), passed through; dtype and mask options are not exposed.",
        "",
    ]
    for name, schema in OPTIMIZER_FIELDS.items():
        lines += _title(f'``optimizer = "{name}"``', "~")
        described = {
            key: dataclasses.replace(field, doc=field.doc or f"``optax.{name}(..., {key}=)``")
            for key, field in schema.items()
        }
        lines += _schema_table(described, undocumented, f"optimizer_kwargs[{name}]")
    return "\n".join(lines) + "\n", undocumented


def generate(app: Sphinx) -> None:
    _api_pages(app)
    _write(DOCS / "reference" / "cli.rst", _cli_page())
    text, undocumented = _experiment_page()
    for key in undocumented:
        logger.warning(f"experiment-file key {key} has no doc: give its Field a doc (with_docs)")
    _write(DOCS / "reference" / "experiment-file.rst", text)


def _resolve(app, env, node, contnode):
    """A docstring names an object by its defining module (``precisionlab.bits._rounding.X``)
    or unqualified (``X``, meaning the module's own); the API pages document it under its
    public namespace. Resolve to that page when exactly one public name fits."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, _, short = target.rpartition(".")
    candidates = TARGETS.get(short, [])
    if not candidates:
        return _exists(node, target, contnode)
    here = module or node.get("py:module") or ""
    fitting = [c for c in candidates if here == c[0] or here.startswith(c[0] + ".")]
    if not fitting and not module:
        fitting = candidates if len({c[1] for c in candidates}) == 1 else []
    if not fitting:
        return _exists(node, target, contnode)
    namespace, full = max(fitting, key=lambda c: len(c[0]))  # the nearest namespace
    from sphinx.util.nodes import make_refnode

    return make_refnode(
        app.builder, node["refdoc"], f"reference/api/{namespace}", full, contnode, full
    )


def _lookup(dotted: str):
    """The object named ``precisionlab.a.b.name`` (a module or an attribute path), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _exists(node, target: str, contnode):
    """A correct reference to a precisionlab object outside the public API reference (a
    private module, an internal class) is shown as plain code, unlinked; a reference to
    nothing still warns."""
    if target.startswith("precisionlab"):
        return contnode if _lookup(target) is not None else None
    context = node.get("py:module") or ""
    if not context.startswith("precisionlab"):
        return None
    module = importlib.import_module(context)
    places = [context]
    if hasattr(module, "__path__"):
        places += [
            m.name
            for m in pkgutil.walk_packages(module.__path__, context + ".")
            if not m.name.endswith("__main__")
        ]
    for place in places:
        if _lookup(f"{place}.{target}") is not None:
            return contnode
    head, _, rest = target.partition(".")
    for _, full in TARGETS.get(head, []):  # Site.describe: Site is public elsewhere
        if rest and _lookup(f"{full}.{rest}") is not None:
            return contnode
    return None


_SUBST = re.compile(r"(?<![\\`\w|])\|([^|`\s][^|`]*?)\|(?![`\w|])")
_POWER = re.compile(r"(?<=[\w)(])\*\*(?=[\w(-])")
_LITERAL = re.compile(r"(``.*?``|`[^`]*`)")
_JOINED_PARAMS = re.compile(r"^(\s+)(\w+(?: / \w+)+):")


def _escape(line: str) -> str:
    """Outside inline literals: ``|x|`` is not a substitution, ``2**16`` is not bold."""
    parts = _LITERAL.split(line)
    for i in range(0, len(parts), 2):
        parts[i] = _POWER.sub(r"\\*\\*", _SUBST.sub(r"\\|\1\\|", parts[i]))
    return "".join(parts)


def _plain_docstrings(app, what, name, obj, options, lines) -> None:
    """Docstrings are written as plain text with reST literals; keep their math literal, and
    read ``a / b: ...`` argument entries as ``a, b: ...``."""
    for i, line in enumerate(lines):
        line = _JOINED_PARAMS.sub(
            lambda m: m.group(1) + m.group(2).replace(" / ", ", ") + ":", line
        )
        lines[i] = _escape(line)


def _property_summary(app, what, name, obj, options, lines) -> None:
    """Napoleon reads a property's first line ``Text: more`` as ``type: description``; these
    docstrings mean a sentence, so the colon becomes a dash before napoleon runs."""
    if what in ("property", "attribute") and lines and ": " in lines[0]:
        if not lines[0].lstrip().startswith(":"):
            lines[0] = lines[0].replace(": ", " - ", 1)


def setup(app: Sphinx) -> dict:
    app.connect("builder-inited", generate)
    app.connect("autodoc-process-docstring", _property_summary, priority=400)
    app.connect("autodoc-process-docstring", _plain_docstrings, priority=300)
    app.connect("missing-reference", _resolve)
    return {"version": "1", "parallel_read_safe": True}
