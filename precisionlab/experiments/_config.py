"""Experiment files: TOML read with :mod:`tomllib`, validated strictly before any work starts.

An experiment file names its ``kind``. For ``kind = "train"`` it holds:

- ``[train]``: the base training setup (model, data, optimizer, steps, policy, loss scale, ...);
  keys and defaults come from :mod:`precisionlab.experiments._train_kind`.
- ``[settings.NAME]`` (optional): named overrides of ``[train]``, e.g. a model setting where
  activations grow; every variant runs in every setting unless it lists ``settings`` (an empty
  list disables it).
  Tables such as ``model_kwargs`` merge key by key into the base (variant over setting over
  ``[train]``).
- ``[[variant]]`` tables (``name`` plus overrides of ``[train]``) and/or a ``[grid]`` whose
  keys are ``[train]`` keys mapped to lists (their product is expanded into variants;
  ``seed`` in the grid means "run every variant with each of these seeds").
- ``seeds = [...]`` (optional): every variant runs once per seed, summarised as mean and std;
  a setting's own ``seeds`` replaces them for its units.

Other kinds (``survey``, ``memory``) hold one table named like the kind, validated by the kind.

``--set key.path=value`` overrides apply to the document before validation; the value is read
as a TOML literal when the key is not a string key, so ``train.steps=50`` is an int and
``seeds=[0,1]`` a list. ``variant.NAME.key`` addresses a ``[[variant]]`` by name (or index).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from precisionlab._schema import (
    ConfigError,
    Field,
    check_depth,
    coerce,
    did_you_mean,
    read_toml,
    validate_table,
)
from precisionlab.experiments import _kinds as kinds
from precisionlab.experiments import _train_kind as train_kind
from precisionlab.experiments._store import safe_name

__all__ = [
    "ConfigError",
    "Experiment",
    "Unit",
    "apply_overrides",
    "experiment_from_document",
    "load_experiment",
    "parse_override",
]

_TOP_COMMON = {
    "kind": Field(str, doc="experiment kind"),
    "name": Field(str, "", doc="run name (default: the file's stem)"),
    "description": Field(str, "", doc="one paragraph shown in the report"),
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+=^-]*$")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One training run of a ``train`` experiment: a variant in a setting with a seed.

    Attributes:
      id: directory name under ``variants/`` (unique, filesystem-safe), e.g. ``"03-fp16-static"``.
      name: display name, e.g. ``"range/fp16-static"`` (``" s1"`` appended with several seeds).
      group: name without the seed: units of one group differ only by seed.
      setting: the setting's name, or ``""`` without ``[settings]``.
      variant: the variant's name.
      seed: the seed.
      params: the resolved ``[train]`` table of this unit (base, setting, variant, seed).
      config: the same as a validated :class:`~precisionlab.train.TrainConfig` (what the runner
        trains; not part of the JSON record).
    """

    id: str
    name: str
    group: str
    setting: str
    variant: str
    seed: int
    params: dict[str, Any]
    config: Any = dataclasses.field(default=None, compare=False, repr=False)

    def record(self) -> dict[str, Any]:
        """The JSON-able record of the unit (everything but ``config``)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"
        }


@dataclasses.dataclass(frozen=True)
class Experiment:
    """A validated experiment.

    Attributes:
      source: path of the file it came from (for messages).
      kind: the experiment kind.
      name: run name.
      description: free text.
      document: the TOML document after ``--set`` overrides (JSON-able; revalidated on resume).
      resolved: the validated configuration with defaults filled in (JSON-able).
      units: the runs of a ``train`` experiment, in order; empty for other kinds.
    """

    source: str
    kind: str
    name: str
    description: str
    document: dict[str, Any]
    resolved: dict[str, Any]
    units: tuple[Unit, ...] = ()


# --- overrides -----------------------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], str]:
    """``"train.steps=50"`` -> ``(["train", "steps"], "50")``."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    path, _, value = text.partition("=")
    keys = [k.strip() for k in path.strip().split(".")]
    if not all(keys):
        raise ConfigError(f"--set {text!r}: empty key in the key path {path!r}")
    return keys, value.strip()


def _literal(value: str, text: str) -> Any:
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value
    except RecursionError:
        raise ConfigError(f"--set {text[:60]!r}: nested too deeply") from None
    except ValueError as err:  # an int past Python's 4300-digit limit for str -> int
        raise ConfigError(f"--set {text!r}: {err}".split("; use sys.")[0]) from None
    check_depth(parsed, f"--set {text[:60]!r}")
    return parsed


def _field_for(doc: Mapping[str, Any], keys: Sequence[str]) -> Field | None:
    """The schema field a ``--set`` path lands on, when the runner knows it (train kind)."""
    if doc.get("kind") != "train":
        return _TOP_COMMON.get(keys[0]) if len(keys) == 1 else None
    schema = train_kind.schema()
    last = keys[-1]
    head = keys[0]
    if len(keys) == 1:
        return _train_top_schema().get(head)
    if head in ("train", "variant", "settings") and last in schema:
        return schema[last]
    if head == "variant" and last in _VARIANT_EXTRA:
        return _VARIANT_EXTRA[last]
    if head == "grid" and last in schema:
        return Field(list, item=schema[last].type)
    return None


def apply_overrides(doc: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``doc`` with each ``key.path=value`` applied (typed by the schema)."""
    doc = copy.deepcopy(doc)
    for text in overrides:
        keys, raw = parse_override(text)
        field = _field_for(doc, keys)
        if field is not None and field.type is str:
            value: Any = raw
        elif field is not None and field.type is list and field.item is str and "[" not in raw:
            value = [item.strip() for item in raw.split(",") if item.strip()]
        else:
            value = _literal(raw, text)
        node: Any = doc
        walked: list[str] = []
        for key in keys[:-1]:
            walked.append(key)
            if isinstance(node, list):
                node = _pick_variant(node, key, text)
                continue
            if key not in node:
                node[key] = {}
            node = node[key]
            if not isinstance(node, dict | list):
                raise ConfigError(f"--set {text!r}: {'.'.join(walked)} is not a table")
        if isinstance(node, list):
            raise ConfigError(f"--set {text!r}: name a variant, e.g. variant.NAME.key=value")
        node[keys[-1]] = value
    return doc


def _pick_variant(items: list, key: str, text: str) -> dict:
    for item in items:
        if isinstance(item, dict) and item.get("name") == key:
            return item
    if key.isascii() and key.isdigit() and len(key) < 10 and int(key) < len(items):
        return items[int(key)]
    names = [str(item.get("name")) for item in items if isinstance(item, dict)]
    raise ConfigError(f"--set {text!r}: no variant {key!r}; variants: {', '.join(names)}")


# --- loading ------------------------------------------------------------------------


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> Experiment:
    """Read, override and validate an experiment file.

    Raises:
      ConfigError: (a ``ValueError``) naming the file, the key path and the allowed values.
      FileNotFoundError: if the file does not exist.
    """
    path = Path(path)
    try:
        doc = read_toml(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such experiment file") from None
    doc = apply_overrides(doc, overrides)
    return experiment_from_document(doc, str(path), default_name=path.stem)


def experiment_from_document(
    doc: Mapping[str, Any], source: str, *, default_name: str = "experiment"
) -> Experiment:
    """Validate a parsed document (after overrides); ``source`` names it in messages."""
    kind = doc.get("kind")
    if kind is None:
        raise ConfigError(f"{source}: missing required key 'kind'; allowed: {kinds.names_text()}")
    if not isinstance(kind, str) or kind not in kinds.KINDS:
        hint = did_you_mean(kind, list(kinds.KINDS)) if isinstance(kind, str) else ""
        raise ConfigError(
            f"{source}: kind: unknown value {kind!r}; {hint}allowed: {kinds.names_text()}"
        )
    if kind == "train":
        return _train_experiment(doc, source, default_name)
    try:
        module = kinds.load(kind)
    except ValueError as err:
        raise ConfigError(f"{source}: {err}") from None
    schema = dict(_TOP_COMMON)
    schema[kind] = Field(dict, {}, doc=f"the [{kind}] table")
    top = validate_table(doc, schema, source)
    section = module.validate(dict(top[kind]), f"{source}: {kind}")
    resolved = {
        "kind": kind,
        "name": safe_name(top["name"] or default_name),  # one path component
        "description": top["description"],
        kind: section,
    }
    return Experiment(
        source, kind, resolved["name"], top["description"], copy.deepcopy(dict(doc)), resolved
    )


#: ``seeds`` in a ``[settings.NAME]`` table: that setting's units run with these seeds instead
#: of the top-level ``seeds`` (fitting and evaluation on different seeds in one file).
_SETTING_SEEDS = Field(list, [], item=int, doc="the setting's own seeds (default: seeds)")

_VARIANT_EXTRA = {
    "name": Field(str, doc="the variant's name"),
    "settings": Field(list, [], item=str, doc="settings it runs in (default: all; [] = none)"),
    "description": Field(str, "", doc="free text"),
}


def _train_top_schema() -> dict[str, Field]:
    schema = dict(_TOP_COMMON)
    schema.update(
        {
            "seeds": Field(list, [], item=int, doc="run every variant with each seed"),
            "train": Field(dict, {}, doc="the base [train] table"),
            "settings": Field(dict, {}, doc="named overrides of [train]"),
            "variant": Field(list, [], item=dict, doc="[[variant]] tables"),
            "grid": Field(dict, {}, doc="[train] keys mapped to lists of values"),
            "report": Field(dict, {}, doc="report options"),
            "diagnose": Field(dict, {}, doc="precisionlab diagnose defaults"),
        }
    )
    return schema


REPORT_SCHEMA = {
    "log_loss": Field(str, "auto", choices=("auto", "yes", "no"), doc="log-scale loss axis"),
    "plots": Field(bool, True, doc="write PNG plots"),
}


#: ``[diagnose]``: defaults of ``precisionlab diagnose`` (its flags override them).
DIAGNOSE_SCHEMA = {
    "threshold": Field(float, 0.1, above=0.0, doc="compare: relative difference that breaks"),
    "tolerance": Field(float, 0.05, low=0.0, doc="bisect: pass when loss <= PASS's + this"),
    "tail": Field(int, 10, low=1, high=2**31 - 1, why="an int32", doc="bisect: steps averaged"),
    "underflow": Field(float, 0.05, low=0.0, high=1.0, why="a fraction", doc="autoswitch"),
    "mse": Field(float, 1e-4, low=0.0, doc="autoswitch: quantization MSE that switches"),
    "forecast_reference": Field(
        str, "fp32", doc="forecast: the variant each unit's losses are judged against"
    ),
    "forecast_fit": Field(
        list, [], item=str, doc="forecast: setting names (globs) the forecaster is fitted on"
    ),
    "forecast_margin": Field(
        float, 0.1, low=0.0, doc="forecast: relative loss gap to the reference that stalls"
    ),
    "forecast_quick": Field(
        list, [], item=str, doc="forecast: --set overrides of the --quick subset"
    ),
}


def _check_name(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise ConfigError(
            f"{where}: bad name {name!r}: use letters, digits and _ . + = ^ - (no spaces or /)"
        )
    return name


def _train_experiment(doc: Mapping[str, Any], source: str, default_name: str) -> Experiment:
    schema = train_kind.schema()
    top = validate_table(doc, _train_top_schema(), source)
    base = train_kind.validate(top["train"], f"{source}: train")
    report = validate_table(top["report"], REPORT_SCHEMA, f"{source}: report")
    diagnose = validate_table(top["diagnose"], DIAGNOSE_SCHEMA, f"{source}: diagnose")

    override_schema = dict(schema)
    override_schema["description"] = _VARIANT_EXTRA["description"]
    override_schema["seeds"] = _SETTING_SEEDS
    settings: dict[str, dict[str, Any]] = {}
    setting_descriptions: dict[str, str] = {}
    setting_seeds: dict[str, list[int]] = {}
    for sname, table in top["settings"].items():
        where = f"{source}: settings.{sname}"
        _check_name(sname, where)
        settings[sname] = validate_table(table, override_schema, where, defaults=False)
        setting_descriptions[sname] = settings[sname].pop("description", "")
        if "seeds" in settings[sname]:
            setting_seeds[sname] = list(settings[sname].pop("seeds"))

    variants: list[dict[str, Any]] = []
    variant_schema = {**schema, **_VARIANT_EXTRA}
    for i, table in enumerate(top["variant"]):
        where = f"{source}: variant[{i}]"
        if isinstance(table, Mapping) and isinstance(table.get("name"), str):
            where = f"{source}: variant[{i}] ({table['name']})"
        entry = validate_table(table, variant_schema, where, defaults=False)
        if "name" not in entry:
            raise ConfigError(f"{where}: missing required key 'name'")
        _check_name(entry["name"], f"{where}.name")
        for sname in entry.get("settings", []):
            if sname not in settings:
                raise ConfigError(
                    f"{where}.settings: unknown setting {sname!r}; "
                    f"{did_you_mean(str(sname), list(settings))}"
                    f"allowed: {', '.join(settings) or '(no [settings] defined)'}"
                )
        variants.append(entry)

    seeds = list(top["seeds"])
    grid = dict(top["grid"])
    if "seed" in grid:
        grid_seeds = coerce(grid.pop("seed"), Field(list, item=int), f"{source}: grid.seed")
        seeds = seeds + [s for s in grid_seeds if s not in seeds]
    if grid:
        grid_schema = {k: Field(list, item=f.type) for k, f in schema.items()}
        grid = validate_table(grid, grid_schema, f"{source}: grid", defaults=False)
        keys = list(grid)
        for key in keys:
            if not grid[key]:
                raise ConfigError(f"{source}: grid.{key}: empty list")
            for j, value in enumerate(grid[key]):
                coerce(value, schema[key], f"{source}: grid.{key}[{j}]")
        for combo in itertools.product(*(grid[k] for k in keys)):
            varying = [_short(v) for k, v in zip(keys, combo, strict=True) if len(grid[k]) > 1] or [
                _short(v) for v in combo
            ]
            entry = dict(zip(keys, combo, strict=True))
            entry["name"] = "_".join(varying)
            variants.append(entry)
    if not variants:
        variants.append({"name": "base"})
    names = [v["name"] for v in variants]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConfigError(f"{source}: variant name {dup!r} is used twice")

    units: list[Unit] = []
    setting_names = list(settings) or [""]
    for sname in setting_names:
        unit_seeds = setting_seeds.get(sname) or seeds
        for entry in variants:
            if "settings" in entry and sname not in entry["settings"]:
                continue  # an empty list disables the variant (e.g. --set variant.X.settings=)
            for seed in unit_seeds or [base["seed"]]:
                params = dict(base)
                if sname:
                    _merge(params, settings[sname])
                _merge(
                    params,
                    {
                        k: v
                        for k, v in entry.items()
                        if k not in ("name", "settings", "description")
                    },
                )
                params["seed"] = seed
                where = f"{source}: " + (f"settings.{sname} + " if sname else "")
                where += f"variant {entry['name']!r}"
                config = train_kind.config(params, where)
                params = config.to_dict()
                group = f"{sname}/{entry['name']}" if sname else entry["name"]
                several = len(unit_seeds) > 1 or len(seeds) > 1 or bool(setting_seeds)
                name = f"{group} s{seed}" if several else group
                uid = (
                    f"{len(units):02d}-{re.sub(r'[^A-Za-z0-9_.+=-]', '_', group.replace('/', '-'))}"
                )
                uid += f"-s{seed}" if several else ""
                units.append(Unit(uid, name, group, sname, entry["name"], seed, params, config))

    resolved = {
        "kind": "train",
        "name": safe_name(top["name"] or default_name),  # one path component
        "description": top["description"],
        "seeds": seeds,
        "train": base,
        "settings": settings,
        "setting_descriptions": setting_descriptions,
        "variants": variants,
        "report": report,
        "diagnose": diagnose,
        "units": [u.record() for u in units],
    }
    if setting_seeds:  # only when used: the resolved records of other files stay as they were
        resolved["setting_seeds"] = setting_seeds
    return Experiment(
        source,
        "train",
        resolved["name"],
        top["description"],
        copy.deepcopy(dict(doc)),
        resolved,
        tuple(units),
    )


def _merge(params: dict[str, Any], overrides: Mapping[str, Any]) -> None:
    """Apply ``overrides`` to ``params``; tables (``model_kwargs``, ...) merge key by key."""
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(params.get(key), Mapping):
            params[key] = {**params[key], **value}
        else:
            params[key] = value


def _short(value: Any) -> str:
    text = str(value).replace(" ", "").replace("/", "_").replace(":", "").replace(",", "+")
    return re.sub(r"[^A-Za-z0-9_.+=-]", "", text) or "x"
