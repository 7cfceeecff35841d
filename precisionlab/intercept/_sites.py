"""Matched operations ("sites"): their stable names and the include/exclude selection."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Site", "numbered", "select"]


def bit_width(dtype: str) -> int:
    """Bits of a floating dtype name (``"bfloat16"`` -> 16, ``"float8_e4m3fn"`` -> 8)."""
    m = re.search(r"(\d+)", dtype.replace("float8_", "float8").split("_")[0])
    return int(m.group(1)) if m else 0


#: A scope part naming the layer of each iteration of a scan over stacked layers:
#: ``"layer{1+i}"`` (flat iteration ``i`` runs ``layer{1 + i}``), see ``train.layers``.
_TEMPLATE = re.compile(r"^(.*)\{(\d+)\+i\}$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Site:
    """One matched equation of the traced program.

    Attributes:
      index: position among the matched equations, in program order (depth first through
        sub-programs), counted over all matched primitives: stable for a given program.
      primitive: the primitive's name (``"dot_general"``).
      scope: enclosing ``jit`` function names and ``jax.named_scope`` names joined by ``/``
        (``"block/attention"``), ``""`` at the top level.
      where: the user's source line that emitted it (``"model.py:42 (fn)"``), or ``""``.
      loops: enclosing loop primitives, outermost first (``("scan",)``): a site inside a
        ``scan`` over layers runs once per iteration under one name.
      in_shapes / out_shapes / dtype: operand and result shapes, the first operand's dtype.
      path: equation indices from the root (the interpreter's key).
      selected: whether the include/exclude selection kept it (False: left as it was).
      within: every enclosing higher-order construct other than plain calls (``jit``),
        outermost first (``("scan", "checkpoint", "scan")``, ``("cond",)``); a custom-derivative
        function counts as ``"custom_jvp"`` / ``"custom_vjp"``.
      lengths: the iteration count of each enclosing loop of ``loops`` (None for a
        ``while_loop``), outermost first: the leading axes of a per-iteration value.
      in_dtypes: every operand's dtype.
      skipped: why the rule leaves this operation as it was although it could act on it
        (``"integer operands"``, ``"no rule for ragged_dot"``), or ``""``; a skipped site is
        never selected, and is listed by :meth:`~precisionlab.intercept.Intercepted.report`.
      operands: per operand, the parameter it is (``"layers/0/attn/q_proj/kernel"``: the
        input leaf's pytree path, traced through the program's dataflow) or ``""`` for an
        activation (a value that depends on data); see ``precisionlab.intercept._dataflow``.
      roles: for a matmul or convolution, each operand's role: ``"w"`` (a weight: parameters
        only) or ``"x"`` (an activation); ``()`` for other operations.
      flops: a matmul's or convolution's FLOPs per run (2 x multiply-adds; the iterations
        of enclosing loops not counted), 0 for other operations.
      out_dtype: the (first) result's dtype.
    """

    @property
    def compute_dtype(self) -> str:
        """The dtype a matmul or convolution multiplies in: its widest floating operand's
        (``"bfloat16"`` for bfloat16 operands accumulating into float32), else the first
        operand's dtype."""
        floats = [d for d in self.in_dtypes if "float" in d]
        if not floats:
            return self.dtype
        return max(floats, key=lambda d: (bit_width(d), d))

    index: int
    primitive: str
    scope: str
    where: str
    loops: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    dtype: str
    path: tuple[int, ...]
    selected: bool = True
    within: tuple[str, ...] = ()
    lengths: tuple[int | None, ...] = ()
    in_dtypes: tuple[str, ...] = ()
    skipped: str = ""
    operands: tuple[str, ...] = ()
    roles: tuple[str, ...] = ()
    flops: int = 0
    out_dtype: str = ""

    @property
    def name(self) -> str:
        """``"dot_general[3]"``: the primitive and its index."""
        return f"{self.primitive}[{self.index}]"

    @property
    def param(self) -> str:
        """The parameter the operation multiplies (its first weight operand's label), or
        ``""`` when no operand is a parameter."""
        return next((o for o in self.operands if o), "")

    @property
    def module(self) -> str:
        """The module path: :attr:`param` without its last part (``"layers/0/attn/q_proj"``
        for ``".../q_proj/kernel"``), or ``""``."""
        return self.param.rpartition("/")[0]

    @property
    def activations_only(self) -> bool:
        """A product of activations (attention's ``QK^T`` and ``PV``): a matmul or
        convolution none of whose operands is a weight."""
        return bool(self.roles) and all(r == "x" for r in self.roles)

    def targets(self) -> tuple[str, ...]:
        """The strings ``include``/``exclude`` patterns are matched against: the name, the
        scope, ``scope/name``, each parameter operand's path and the module path."""
        full = f"{self.scope}/{self.name}" if self.scope else self.name
        out = [self.name, self.scope, full, *(o for o in self.operands if o)]
        if self.module:
            out.append(self.module)
        return tuple(out)

    def layer(self, iteration: int | None = None, names: Sequence[str] = ()) -> str:
        """The model layer the site belongs to (at flat ``iteration`` of its loops, row-major
        over :attr:`lengths`, for a site inside a scan over stacked layers).

        A scope part ``"name{k+i}"`` (:func:`precisionlab.train._layers.scan_layers` with a
        ``scope``) gives ``f"name{k + iteration}"``; otherwise the first scope part among
        ``names`` (when given), else the first scope part, else the site's name; inside a
        loop without such a template ``"@{iteration}"`` is appended (``"dot_general[1]@3"``).
        """
        parts = [p for p in self.scope.split("/") if p]
        for part in parts:
            m = _TEMPLATE.match(part)
            if m:
                return part if iteration is None else f"{m[1]}{int(m[2]) + iteration}"
        named = [p for p in parts if p in names] if names else parts
        base = named[0] if named else self.name
        return base if iteration is None or not self.loops else f"{base}@{iteration}"

    def describe(self) -> str:
        """Two lines: the name, whether it is replaced, scope, loops and shapes; then,
        indented, the operands' roles and the source (two, so that a report fits 100 columns)."""
        shapes = " x ".join(str(list(s)) for s in self.in_shapes)
        out = ", ".join(str(list(s)) for s in self.out_shapes)
        status = f"skipped: {self.skipped}" if self.skipped else (
            "replaced" if self.selected else "kept")  # fmt: skip
        first = [f"{self.name:<14}", f"{status:<8}", self.scope or "-"]
        if self.loops:
            first.append(f"in {'/'.join(self.loops)}")
        first.append(f"{shapes} -> {out} {self.dtype}")
        second = []
        if self.roles:
            second.append(f"({', '.join(o or 'activation' for o in self.operands)})")
        if self.where:
            second.append(f"at {self.where}")
        lines = ["  ".join(first)]
        if second:
            lines.append("    " + "  ".join(second))
        return "\n".join(lines)


def _is_regex(item: Any) -> bool:
    return isinstance(item, re.Pattern) or (isinstance(item, str) and item.startswith("re:"))


def _regex(item: re.Pattern | str) -> re.Pattern:
    if isinstance(item, re.Pattern):
        return item
    try:
        return re.compile(item[3:])
    except re.error as e:
        raise ValueError(f"include/exclude item {item!r}: not a regular expression ({e})") from None


def _matches(site: Site, item: int | str | re.Pattern, pos: int, count: int) -> bool:
    """Whether ``item`` names the site at position ``pos`` of ``count`` matched operations."""
    if isinstance(item, bool):
        raise TypeError(f"include/exclude items are ints, strings or re.Patterns, got {item!r}")
    if isinstance(item, int):
        if not -count <= item < count:
            return False
        return pos == item % count
    if _is_regex(item):
        rx = _regex(item)
        return any(rx.fullmatch(t) for t in site.targets())
    if not isinstance(item, str):
        raise TypeError(f"include/exclude items are ints, strings or re.Patterns, got {item!r}")
    targets = site.targets()
    # exact names first: "dot_general[3]" is also a glob (a character class)
    return item in targets or any(fnmatch.fnmatchcase(t, item) for t in targets)


def _listing(sites: list[Site]) -> str:
    if not sites:
        return "none"
    return ", ".join(f"{s.name} ({s.param})" if s.param else s.name for s in sites)


def _check_items(items: Sequence[Any], what: str, sites: list[Site]) -> None:
    n = len(sites)
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and not -n <= item < n:
            raise ValueError(
                f"{what} position {item} is out of range: the program has {n} matched "
                f"operations (positions 0..{n - 1}, or -{n}..-1 from the end)"
            )
        if (isinstance(item, str) or _is_regex(item)) and not any(
            _matches(s, item, i, n) for i, s in enumerate(sites)
        ):
            shown = item.pattern if isinstance(item, re.Pattern) else item
            raise ValueError(
                f"{what} pattern {shown!r} matches no operation (names, scopes, parameter "
                f"paths, module paths; globs, or 're:' regular expressions); matched: "
                f"{_listing(sites)}"
            )


def select(
    sites: list[Site],
    include: Sequence[int | str | re.Pattern] | None,
    exclude: Sequence[int | str | re.Pattern],
    default: Callable[[Site], bool] | None = None,
) -> list[Site]:
    """Mark each site selected when included and not excluded.

    Items are positions in program order (negative counts from the end: ``-1`` is the last
    matched op), exact names (``"dot_general[3]"``), glob patterns or regular expressions
    (``re.compile(...)``, or a string ``"re:..."``; matched whole, as qwix's rules) matched
    against the name, the scope, ``scope/name``, the path of each parameter operand
    (``"layers/0/attn/q_proj/kernel"``) and the module path (``"layers/0/attn/q_proj"``).
    An item that matches nothing is a ValueError listing what exists. Without ``include``, a
    site is selected when ``default(site)`` (every site when ``default`` is None); an
    ``include`` item selects what it names, ``default`` or not. A site the rule skips
    (``Site.skipped``) is never selected.
    """
    _check_items(include or (), "include", sites)
    _check_items(exclude, "exclude", sites)
    n = len(sites)
    out = []
    for i, s in enumerate(sites):
        if include is None:
            keep = default is None or default(s)
        else:
            keep = any(_matches(s, x, i, n) for x in include)
        keep = keep and not any(_matches(s, e, i, n) for e in exclude) and not s.skipped
        out.append(dataclasses.replace(s, selected=keep))
    return out


def numbered(sites: list[Site], numbering: str) -> list[Site]:
    """The sites with their ``Site.index``: the position among all of them in program
    order (``"program"``), or among those of the same primitive (``"primitive"``: the
    matmuls keep their names, ``dot_general[0..]``, whatever else is matched)."""
    if numbering == "program":
        return [dataclasses.replace(s, index=i) for i, s in enumerate(sites)]
    seen: dict[str, int] = {}
    out = []
    for s in sites:
        out.append(dataclasses.replace(s, index=seen.get(s.primitive, 0)))
        seen[s.primitive] = seen.get(s.primitive, 0) + 1
    return out
