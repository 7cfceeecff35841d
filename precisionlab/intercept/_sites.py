"""Matched operations ("sites"): their stable names and the include/exclude selection."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Sequence

__all__ = ["Site", "numbered", "select"]

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
    """

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

    @property
    def name(self) -> str:
        """``"dot_general[3]"``: the primitive and its index."""
        return f"{self.primitive}[{self.index}]"

    def layer(self, iteration: int | None = None, names: Sequence[str] = ()) -> str:
        """The model layer the site belongs to (at flat ``iteration`` of its loops, row-major
        over :attr:`lengths`, for a site inside a scan over stacked layers).

        A scope part ``"name{k+i}"`` (:func:`precisionlab.train.layers.scan_layers` with a
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
        """One line: name, scope, shapes, loops, source, and whether it is replaced."""
        shapes = " x ".join(str(list(s)) for s in self.in_shapes)
        out = ", ".join(str(list(s)) for s in self.out_shapes)
        parts = [f"{self.name:<16}", f"{self.scope or '-':<24}", f"{shapes} -> {out} {self.dtype}"]
        if self.loops:
            parts.append(f"in {'/'.join(self.loops)}")
        if self.where:
            parts.append(f"at {self.where}")
        if self.skipped:
            parts.append(f"skipped: {self.skipped}")
        else:
            parts.append("replaced" if self.selected else "kept")
        return "  ".join(parts)


def _matches(site: Site, item: int | str, pos: int, count: int) -> bool:
    """Whether ``item`` names the site at position ``pos`` of ``count`` matched operations."""
    if isinstance(item, bool):
        raise TypeError(f"include/exclude items are ints or strings, got {item!r}")
    if isinstance(item, int):
        if not -count <= item < count:
            return False
        return pos == item % count
    if not isinstance(item, str):
        raise TypeError(f"include/exclude items are ints or strings, got {item!r}")
    full = f"{site.scope}/{site.name}" if site.scope else site.name
    targets = (site.name, site.scope, full)
    # exact names first: "dot_general[3]" is also a glob (a character class)
    return item in targets or any(fnmatch.fnmatchcase(t, item) for t in targets)


def _check_items(items: Sequence[int | str], what: str, sites: list[Site]) -> None:
    n = len(sites)
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and not -n <= item < n:
            raise ValueError(
                f"{what} position {item} is out of range: the program has {n} matched "
                f"operations (positions 0..{n - 1}, or -{n}..-1 from the end)"
            )
        if isinstance(item, str) and not any(_matches(s, item, i, n) for i, s in enumerate(sites)):
            names = ", ".join(s.name for s in sites) or "none"
            raise ValueError(f"{what} pattern {item!r} matches no operation; matched: {names}")


def select(
    sites: list[Site],
    include: Sequence[int | str] | None,
    exclude: Sequence[int | str],
) -> list[Site]:
    """Mark each site selected when included (all when ``include`` is None) and not excluded.

    Items are positions in program order (negative counts from the end: ``-1`` is the last
    matched op), exact names (``"dot_general[3]"``) or glob patterns matched against the name,
    the scope and ``scope/name`` (``"head/*"``). An item that matches nothing is a ValueError.
    A site the rule skips (:attr:`Site.skipped`) is never selected.
    """
    _check_items(include or (), "include", sites)
    _check_items(exclude, "exclude", sites)
    n = len(sites)
    out = []
    for i, s in enumerate(sites):
        keep = include is None or any(_matches(s, x, i, n) for x in include)
        keep = keep and not any(_matches(s, e, i, n) for e in exclude) and not s.skipped
        out.append(dataclasses.replace(s, selected=keep))
    return out


def numbered(sites: list[Site], numbering: str) -> list[Site]:
    """The sites with their :attr:`Site.index`: the position among all of them in program
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
