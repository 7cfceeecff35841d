"""``timings.json`` of a run (``precisionlab run --timings``): where each unit's time went.

Per unit: the loop's :class:`~precisionlab.train._timing.LoopTimings` (compilations and their
seconds, persistent-cache hits, the first call of the step program, the steady seconds per step,
host syncs, probes, evaluation, hooks, batch generation) and the unit's wall and CPU seconds
(setup included: data, model, the first trace); then the report's seconds. CPU seconds count
every thread of the process, so on a machine shared with other work they say more than wall
seconds do.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from precisionlab import _clock
from precisionlab._text import table
from precisionlab.experiments import _store as store

__all__ = ["FILE", "record_phases", "record_report", "record_unit", "timings_table"]

FILE = "timings.json"


def _read(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / FILE
    return store.read_json(path) if path.exists() else {"units": {}}


def record_unit(run_dir: Path, unit_id: str, name: str, data: dict[str, Any]) -> None:
    """Add (or, on resume, add to) unit ``unit_id``'s timings."""
    doc = _read(run_dir)
    previous = doc["units"].get(unit_id)
    entry = {"name": name, **data}
    if previous is not None:  # a resumed unit: keep the earlier attempts' timings too
        entry["earlier"] = [*previous.pop("earlier", []), previous]
    doc["units"][unit_id] = entry
    store.write_json(Path(run_dir) / FILE, doc)


def record_report(run_dir: Path, wall_s: float, cpu_s: float) -> None:
    doc = _read(run_dir)
    doc["report"] = {"wall_s": wall_s, "cpu_s": cpu_s}
    store.write_json(Path(run_dir) / FILE, doc)


def record_phases(run_dir: Path) -> None:
    """Write the process's phases (``precisionlab._clock``: startup, imports, plan,
    environment, units, compile waits, summaries, report), its total wall and CPU seconds
    since it started, and what the phases leave unaccounted, as ``process``."""
    snap = _clock.snapshot()
    if snap is None:
        return
    doc = _read(run_dir)
    doc["process"] = snap
    store.write_json(Path(run_dir) / FILE, doc)


def phases_table(run_dir: Path) -> str | None:
    """The process's phases as a text table (None when ``timings.json`` has none)."""
    proc = _read(run_dir).get("process")
    if not proc:
        return None
    total = proc["total"]
    rows = [
        [name, _f(p["wall_s"]), _f(p["cpu_s"]), _f(100 * p["wall_s"] / total["wall_s"], 1, 1)]
        for name, p in proc["phases"].items()
    ]
    rows.append(["unaccounted", _f(proc["unaccounted"]["wall_s"]),
                 _f(proc["unaccounted"]["cpu_s"]),
                 _f(100 * proc["unaccounted"]["wall_s"] / total["wall_s"], 1, 1)])  # fmt: skip
    rows.append(["whole process", _f(total["wall_s"]), _f(total["cpu_s"]), "100.0"])
    return table(rows, ["phase", "wall s", "cpu s", "% of wall"], "lrrr")


def _f(x: Any, scale: float = 1.0, digits: int = 2) -> str:
    if not isinstance(x, int | float) or not math.isfinite(x):
        return "-"
    return f"{x * scale:.{digits}f}"


def timings_table(run_dir: Path) -> str:
    """The timings of ``run_dir`` as two text tables, one row per unit, then the totals: the
    compiling columns, then the running ones (two, so that each fits 100 columns)."""
    doc = _read(run_dir)
    compiling = ["unit", "compiles", "compile s", "cache hits", "first call s"]
    running = ["unit", "step ms", "syncs", "eval s", "probe s", "hooks s", "wall s", "cpu s"]
    first, second = [], []
    totals = dict.fromkeys(("compile_s", "wall_s", "cpu_s", "first_call_s"), 0.0)
    for entry in doc["units"].values():
        loop = entry.get("loop", {})
        first.append([
            entry["name"], str(loop.get("compiles", "-")), _f(loop.get("compile_s")),
            str(loop.get("compile_cache_hits", "-")), _f(loop.get("first_call_s")),
        ])  # fmt: skip
        second.append([
            entry["name"], _f(loop.get("steady_step_s"), 1e3, 3), str(loop.get("host_syncs", "-")),
            _f(loop.get("eval_s")), _f(loop.get("probe_s")), _f(loop.get("hooks_s")),
            _f(entry.get("wall_s")), _f(entry.get("cpu_s")),
        ])  # fmt: skip
        for key in ("compile_s", "first_call_s"):
            totals[key] += loop.get(key, 0.0) or 0.0
        for key in ("wall_s", "cpu_s"):
            totals[key] += entry.get(key, 0.0) or 0.0
    first.append(["all units", "", _f(totals["compile_s"]), "", _f(totals["first_call_s"])])
    second.append(["all units", "", "", "", "", "", _f(totals["wall_s"]), _f(totals["cpu_s"])])
    report = doc.get("report")
    if report:
        second.append(["report", *[""] * 5, _f(report["wall_s"]), _f(report["cpu_s"])])
    text = f"{table(first, compiling)}\n\n{table(second, running)}"
    phases = phases_table(run_dir)
    return text if phases is None else f"{text}\n\nthe whole process, by phase:\n{phases}"
