"""The public API is reviewed: ``docs/reference/public_api.txt`` lists it, and the code agrees.

The list has one ``[namespace]`` section per public namespace holding exactly that namespace's
``__all__``, and an ``[internal]`` section naming the modules directly under ``precisionlab``
that are not a Python API (the command line, the benchmarks). Adding a name to an ``__all__``,
or a new module or package under ``precisionlab``, fails here until the list says so: one edit
of that one file, which also makes the name appear in the generated API reference. Which
modules are private, and which names may cross modules: tests/test_privacy_rule.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import precisionlab

ROOT = Path(__file__).resolve().parents[2]
API_LIST = ROOT / "docs" / "reference" / "public_api.txt"
PACKAGE = ROOT / "precisionlab"


def read_api_list(path: Path = API_LIST) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = None
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            assert current not in sections, f"{path.name}:{number}: [{current}] appears twice"
            sections[current] = []
        else:
            assert current is not None, f"{path.name}:{number}: {line!r} before any [section]"
            sections[current].append(line)
    return sections


SECTIONS = read_api_list()
INTERNAL = SECTIONS.pop("internal", [])
WHERE = "docs/reference/public_api.txt"


def test_every_namespace_all_matches_the_reviewed_list():
    problems = []
    for namespace, listed in SECTIONS.items():
        module = importlib.import_module(namespace)
        exported = getattr(module, "__all__", None)
        if exported is None:
            problems.append(f"{namespace} has no __all__ (a public namespace declares one)")
            continue
        added = sorted(set(exported) - set(listed))
        removed = sorted(set(listed) - set(exported))
        if added:
            problems.append(
                f"{namespace}.__all__ has names not reviewed as public API: {added}; if they "
                f"are meant for users, add them under [{namespace}] in {WHERE} (and give each "
                "a docstring); otherwise make them private (a leading _) or drop them from "
                "__all__"
            )
        if removed:
            problems.append(
                f"[{namespace}] in {WHERE} lists names {namespace}.__all__ no longer has: "
                f"{removed}; removing public API breaks users: restore them, or delete the lines"
            )
        missing = [n for n in exported if not hasattr(module, n)]
        if missing:
            problems.append(f"{namespace}.__all__ names what it does not define: {missing}")
        dupes = sorted({n for n in listed if listed.count(n) > 1})
        if dupes:
            problems.append(f"[{namespace}] in {WHERE} lists {dupes} more than once")
    assert not problems, "\n".join(problems)


def test_every_module_under_the_package_is_reviewed():
    """A new module or package directly under precisionlab is public (listed) or internal."""
    top = {
        f"precisionlab.{m.name}"
        for m in pkgutil.iter_modules(precisionlab.__path__)
        if not m.name.startswith("_")
    }
    reviewed = {ns for ns in SECTIONS if ns.count(".") <= 1} | set(INTERNAL)
    new = sorted(top - reviewed)
    gone = sorted(reviewed - top - {"precisionlab"})
    assert not new, (
        f"modules under precisionlab not in {WHERE}: {new}; add a [name] section listing its "
        "__all__ if users import it, or add it under [internal]"
    )
    assert not gone, f"{WHERE} names modules that do not exist: {gone}"


def test_every_experiment_file_key_has_its_one_description():
    """The experiment-file reference is generated from the schema tables: each key's meaning
    is its Field's ``doc`` (set with ``_schema.with_docs``), written nowhere else."""
    from precisionlab import survey
    from precisionlab.experiments import _config as config
    from precisionlab.memory import _checkpointing as checkpointing
    from precisionlab.memory import _experiment as memory
    from precisionlab.train._config import TRAIN_FIELDS
    from precisionlab.train._telemetry import TELEMETRY_FIELDS

    tables = {
        "top": config._train_top_schema(),
        "train": TRAIN_FIELDS,
        "train.telemetry": TELEMETRY_FIELDS,
        "report": config.REPORT_SCHEMA,
        "diagnose": config.DIAGNOSE_SCHEMA,
        "survey": survey.FIELDS,
        "memory": memory.FIELDS,
        "checkpointing": checkpointing.FIELDS,
    }
    missing = [f"[{t}] {key}" for t, schema in tables.items() for key, f in schema.items()
               if not f.doc.strip()]  # fmt: skip
    assert not missing, f"experiment-file keys without a doc (give their Field one): {missing}"
