"""A small declarative schema for TOML tables: typed keys with defaults and allowed values.

Validation is strict (an unknown key is an error, never ignored) and every error is one
:class:`ConfigError` line naming where it happened (file and key path), the bad value and
what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["REQUIRED", "ConfigError", "Field", "coerce", "describe_type", "validate_table"]


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
    """

    type: type
    default: Any = REQUIRED
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    check: Callable[[Any], Any] | None = None
    item: type | None = None
    doc: str = ""
    nullable: bool = False

    def allowed(self) -> Sequence[Any] | None:
        return self.choices() if callable(self.choices) else self.choices


def describe_type(field: Field) -> str:
    if field.type is list:
        return f"list of {field.item.__name__ if field.item else 'values'}"
    return {dict: "table"}.get(field.type, field.type.__name__)


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
    allowed = field.allowed()
    if allowed is not None and value not in allowed:
        raise ConfigError(
            f"{where}: unknown value {value!r}; allowed: {', '.join(map(str, allowed))}"
        )
    if field.check is not None:
        try:
            value = field.check(value)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None
    return value


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
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(schema)}")
    out: dict[str, Any] = {}
    for key, field in schema.items():
        if key in table:
            out[key] = coerce(table[key], field, f"{where}.{key}")
        elif defaults:
            if field.default is REQUIRED:
                raise ConfigError(f"{where}: missing required key {key!r} ({field.doc})")
            out[key] = field.default
    return out
