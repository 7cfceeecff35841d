"""One declarative schema for every table of plain values: typed keys, defaults, allowed values
and numeric ranges.

Used by the train config (:mod:`precisionlab.train._config`), the experiment files, the survey and
the memory experiment; it imports nothing of precisionlab, so any layer may use it. Validation is
strict (an unknown key is an error, never ignored) and every error is one :class:`ConfigError`
line naming where it happened (file and key path), the bad value and what is allowed.
"""

from __future__ import annotations

import builtins
import dataclasses
import difflib
import math
import numbers
import os
import stat
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "INT32_MAX",
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "REQUIRED",
    "ConfigError",
    "Field",
    "check_data",
    "check_depth",
    "check_fits",
    "check_float",
    "check_int",
    "coerce",
    "describe_type",
    "did_you_mean",
    "host_memory",
    "loads_toml",
    "read_toml",
    "validate_enabled_table",
    "validate_table",
    "with_docs",
]

#: Largest finite float32 (a value above it becomes inf when the trainer casts it).
FLOAT32_MAX = 3.4028234663852886e38
#: Smallest positive float32 (subnormal): a positive value below it becomes 0 in float32.
FLOAT32_TINY = 1.401298464324817e-45
#: Largest int32 (the trainer's step counter is an int32).
INT32_MAX = 2**31 - 1


#: Deepest nesting of tables and lists in a configuration (an experiment uses 3 or 4 levels).
MAX_DEPTH = 32

#: Largest configuration file read: an experiment is a few KB of TOML; past this it is not one
#: (and reading /dev/zero must end).
MAX_FILE_BYTES = 4 << 20


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: Marker default of a key that must be given.
REQUIRED: Any = _Required()


class ConfigError(ValueError):
    """An experiment file (or a ``--set`` override) that does not fit the schema."""


@dataclasses.dataclass(frozen=True)
class Field:
    """One key of a table.

    Attributes:
      type: the accepted Python type after TOML parsing: ``str``, ``int``, ``float``
        (ints are accepted and converted), ``bool``, ``list`` (with ``item`` the item type)
        or ``dict`` (a free-form table, only for keys a kind validates itself).
      default: value when the key is absent; :data:`REQUIRED` makes it mandatory.
      choices: allowed values (a sequence, or a callable returning one, evaluated lazily so
        that registries of other modules load only when needed).
      check: a normaliser called with the typed value; it raises ``ValueError`` with a message
        naming the allowed values, or returns the value to store.
      item: item type of a ``list`` key.
      doc: one line for error messages and documentation.
      nullable: ``None`` is accepted (TOML cannot write it; it is the default meaning "off").
      low, high: inclusive bounds of an ``int`` or ``float`` value (None: unbounded); a float
        field is always finite (no nan or inf).
      above: exclusive lower bound (``value > above``), e.g. 0 for a positive float.
      why: the reason for a bound, shown in the message (e.g. "the float32 max").
      fields: a ``dict`` key's own table (key -> Field), or, for a ``list`` of ``dict``
        items, each item's table: nested tables are checked by the same rules.
      values: a ``dict`` key whose keys are free (names, ids) but whose values all have this
        field.
      nonfinite: a ``float`` that may be inf or nan, also written as the strings ``"nan"``,
        ``"inf"``, ``"-inf"`` (strict JSON's non-finite numbers, in files read back).
    """

    type: type
    default: Any = REQUIRED
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    check: Callable[[Any], Any] | None = None
    item: builtins.type | None = None  # builtins: ``type`` is the field above in here
    doc: str = ""
    nullable: bool = False
    low: float | None = None
    high: float | None = None
    above: float | None = None
    why: str = ""
    fields: Mapping[str, Field] | None = None
    values: Field | None = None
    nonfinite: bool = False

    def allowed(self) -> Sequence[Any] | None:
        return self.choices() if callable(self.choices) else self.choices


def check_int(name: str, value: Any, low: int, high: int | None = None, why: str = "") -> int:
    """``value`` as an int, ValueError naming ``name`` unless it is an int (not a bool) in
    [``low``, ``high``] (no upper bound for None; ``why``: the reason for it, in the message):
    an option of a built-in model or dataset."""
    # numbers.Integral: numpy's integers too
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and int(value) > high:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int <= {high}{reason}, got {value!r}")
    return int(value)


def check_float(name: str, value: Any, low: float, high: float | None = None) -> float:
    """``value`` as a float, ValueError naming ``name`` unless it is a finite number in
    [``low``, ``high``] (no upper bound for None; nan and inf are refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)  # nan passed both comparisons; inf scaled data to inf
        or value < low
        or (high is not None and value > high)
    ):
        rng = f"finite and >= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be a number {rng}, got {value!r}")
    return float(value)


def host_memory() -> int | None:
    """Bytes of physical memory of this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits(what: str, nbytes: int, unit: str = "") -> None:
    """ValueError unless ``nbytes`` fit in this machine's memory (:func:`host_memory`; no
    check where it is unknown): sizes no run could hold are bad input, refused when they are
    given rather than found by an allocation failing later. ``what`` names the thing, ``unit``
    says how ``nbytes`` were counted (e.g. "in float32")."""
    limit = host_memory()
    if limit is not None and nbytes > limit:
        raise ValueError(
            f"{what} needs {nbytes / 2**30:,.4g} GiB{' ' + unit if unit else ''}, more than the "
            f"{limit / 2**30:,.4g} GiB of memory this machine has; make it smaller"
        )


def did_you_mean(given: str, known: Sequence[str]) -> str:
    """``"did you mean 'lr'? "`` when ``given`` is close to a name of ``known`` (a misspelt
    key or value), else ``""``."""
    close = difflib.get_close_matches(given[:60], list(known), n=2, cutoff=0.6)
    if not close:
        return ""
    return f"did you mean {' or '.join(repr(c) for c in close)}? "


def describe_type(field: Field) -> str:
    if field.type is list:
        return f"list of {field.item.__name__ if field.item else 'values'}"
    return "table" if field.type is dict else field.type.__name__


def _is_type(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def coerce(value: Any, field: Field, where: str) -> Any:
    """``value`` checked against ``field`` and normalised; raises :class:`ConfigError`."""
    if value is None and field.nullable:
        return None
    if not _is_type(value, field.type):
        raise ConfigError(
            f"{where}: expected {describe_type(field)}, got {type(value).__name__} {value!r}"
        )
    if field.type is float:
        value = float(value)
    if field.type is list and field.item is not None:
        items = []
        for i, item in enumerate(value):
            sub = dataclasses.replace(field, type=field.item, item=None)
            items.append(coerce(item, sub, f"{where}[{i}]"))
        return items
    if field.type in (int, float):
        _check_range(value, field, where)
    allowed = field.allowed()
    if allowed is not None and value not in allowed:
        hint = did_you_mean(value, [str(a) for a in allowed]) if isinstance(value, str) else ""
        raise ConfigError(
            f"{where}: unknown value {value!r}; {hint}allowed: {', '.join(map(str, allowed))}"
        )
    if field.check is not None:
        try:
            value = field.check(value)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None
    return value


def _num(x: float) -> str:
    return repr(x) if isinstance(x, int) or (x == int(x) and abs(x) < 1e16) else f"{x:.9g}"


def _range_text(field: Field) -> str:
    parts = []
    if field.above is not None:
        parts.append(f"> {_num(field.above)}")
    if field.low is not None:
        parts.append(f">= {_num(field.low)}")
    if field.high is not None:
        parts.append(f"<= {_num(field.high)}" + (f" ({field.why})" if field.why else ""))
    return " and ".join(parts)


def _check_range(value: float, field: Field, where: str) -> None:
    kind = "an int" if field.type is int else "a finite number"
    if field.nonfinite and field.type is float:
        if not math.isfinite(value):
            return
        kind = "a number"
    ok = field.type is int or math.isfinite(value)
    ok = ok and (field.above is None or value > field.above)
    ok = ok and (field.low is None or value >= field.low)
    ok = ok and (field.high is None or value <= field.high)
    if not ok:
        bounds = _range_text(field)
        raise ConfigError(f"{where}: must be {kind}{' ' + bounds if bounds else ''}, got {value!r}")


def with_docs(schema: Mapping[str, Field], docs: Mapping[str, str]) -> dict[str, Field]:
    """``schema`` with each key's ``doc`` set from ``docs`` (key -> one line), the meaning
    that messages and the experiment-file reference show; a key of ``docs`` that is not in
    ``schema`` is a ValueError (a renamed field must not keep a stale description)."""
    unknown = [key for key in docs if key not in schema]
    if unknown:
        raise ValueError(f"with_docs: keys not in the schema: {', '.join(unknown)}")
    return {
        key: dataclasses.replace(field, doc=docs[key]) if key in docs else field
        for key, field in schema.items()
    }


def validate_enabled_table(
    table: Any, schema: Mapping[str, Field], where: str
) -> dict[str, Any] | None:
    """An optional feature's table (its ``schema`` has an ``enabled`` key) validated, or None
    when it is off: ``table`` None (absent) or ``enabled = false``."""
    if table is None:
        return None
    values = validate_table(table, schema, where)
    return values if values["enabled"] else None


def validate_table(
    table: Any,
    schema: Mapping[str, Field],
    where: str,
    *,
    defaults: bool = True,
) -> dict[str, Any]:
    """``table`` validated against ``schema``.

    Args:
      table: the parsed TOML table.
      schema: key -> :class:`Field`.
      where: the location for messages, e.g. ``"exp.toml: [train]"``.
      defaults: fill absent keys with their defaults (and require :data:`REQUIRED` ones);
        False validates a partial table of overrides and returns only the given keys.
    """
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__} {table!r}")
    unknown = [key for key in table if key not in schema]
    if unknown:
        hint = did_you_mean(str(unknown[0]), list(schema))
        raise ConfigError(
            f"{where}: unknown key {unknown[0]!r}; {hint}allowed keys: {', '.join(schema)}"
        )
    out: dict[str, Any] = {}
    for key, field in schema.items():
        if key in table:
            out[key] = coerce(table[key], field, f"{where}.{key}")
        elif defaults:
            if field.default is REQUIRED:
                raise ConfigError(f"{where}: missing required key {key!r} ({field.doc})")
            out[key] = field.default
    return out


def read_toml(path: str | os.PathLike[str], what: str = "experiment file") -> dict[str, Any]:
    """The document of the TOML file ``path``; ConfigError naming the file unless it is a
    regular file of at most :data:`MAX_FILE_BYTES` bytes of UTF-8 TOML (a directory, a device,
    a FIFO (opened without waiting for a writer), a binary or a huge file is one error line).
    FileNotFoundError and other OSErrors (no permission) pass through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise ConfigError(f"{path}: is a directory, not an {what}")
        if not stat.S_ISREG(mode):
            raise ConfigError(f"{path}: not a regular file (a device, FIFO or socket)")
        data = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB; an {what} is a small TOML file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); an {what} is TOML") from None
    return loads_toml(text, str(path))


def loads_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads(text)``, with every failure one :class:`ConfigError` naming ``where``:
    bad TOML, a huge integer, or nesting deeper than :data:`MAX_DEPTH` (tomllib recurses, and
    so would every later walk of the document)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{where}: not valid TOML: {err}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # an int past Python's 4300-digit limit for str -> int
        raise ConfigError(f"{where}: {str(err).split('; use sys.')[0]}") from None
    check_depth(doc, where)
    return doc


def check_depth(value: Any, where: str, limit: int | None = None) -> None:
    """ConfigError when tables and lists in ``value`` nest deeper than ``limit`` levels
    (:data:`MAX_DEPTH` by default); checked without recursion."""
    limit = MAX_DEPTH if limit is None else limit
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise ConfigError(f"{where}: nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


#: The strings strict JSON files use for non-finite floats (``Field(nonfinite=True)``).
NONFINITE = ("nan", "inf", "-inf")

_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
          dict: "an object", list: "a list"}  # fmt: skip


def _data_type_ok(value: Any, field: Field) -> bool:
    if field.type is float and field.nonfinite and isinstance(value, str):
        return value in NONFINITE
    return _is_type(value, field.type)


def check_data(data: Any, schema: Mapping[str, Field], where: str) -> Any:
    """``data`` (a table read back from a file precisionlab wrote) checked against ``schema``,
    nested tables included (:attr:`Field.fields`, :attr:`Field.values`, list items); returns
    it unchanged. Unlike :func:`validate_table` nothing is coerced or filled in, and keys the
    schema does not list are accepted (a newer precisionlab may add some): a key whose
    default is :data:`REQUIRED` must be present, a listed key must have its type, range,
    choices and ``check``. Errors are one :class:`ConfigError` naming the path as
    ``where: key: key[i]: ...`` (``summary.json: variants[0]: final_loss: expected a number,
    got list [1]``); iterative, so nesting depth costs no recursion."""
    stack: list[tuple[Any, Field, str]] = [(data, Field(dict, fields=schema), where)]
    while stack:
        value, field, at = stack.pop()
        if value is None:
            if not field.nullable:
                raise ConfigError(f"{at}: expected {_WORDS[field.type]}, got null")
            continue
        if not _data_type_ok(value, field):
            shown = str(value)[:40]
            raise ConfigError(f"{at}: expected {_WORDS[field.type]}" + (
                " or null" if field.nullable else ""
            ) + f", got {type(value).__name__} {shown!r}")  # fmt: skip
        if field.type in (int, float) and not isinstance(value, str):
            _check_range(value, field, at)
        allowed = field.allowed()
        if allowed is not None and value not in allowed:
            raise ConfigError(f"{at}: {value!r} is not one of {', '.join(map(str, allowed))}")
        if field.check is not None:
            try:
                field.check(value)
            except (ValueError, TypeError) as err:
                raise ConfigError(f"{at}: {str(err).splitlines()[0]}") from None
        if field.type is dict:
            for key, sub in (field.fields or {}).items():
                if key in value:
                    stack.append((value[key], sub, f"{at}: {key}"))
                elif sub.default is REQUIRED:
                    raise ConfigError(f"{at}: missing field {key!r}")
            if field.values is not None:
                stack.extend((v, field.values, f"{at}: {k}") for k, v in value.items())
        elif field.type is list and field.item is not None:
            sub = dataclasses.replace(
                field, type=field.item, item=None, default=REQUIRED, nullable=False,
                check=None, choices=None,
            )  # fmt: skip
            stack.extend((v, sub, f"{at}[{i}]") for i, v in enumerate(value))
    return data
