"""Regenerate the numbers that README.md and the documentation pages show from the current code.

Every table (or paragraph) of ``README.md`` and ``docs/**/*.md`` whose numbers come from a run
that is too long for the default test suite sits between two markers::

    <!-- generated: NAME -->
    ...what the generator of NAME printed...
    <!-- /generated -->

and ``REGIONS`` below maps NAME to its page, the command that produces it (the same text the
page shows beside it) and a function that runs that command and formats its result::

    python docs/tables.py --list                       # every region: page, kind, cost, command
    python docs/tables.py --update [--only NAME ...]   # rerun and rewrite the regions
    python docs/tables.py --check [--only NAME ...]    # rerun and compare; exit 1 on a difference
    python docs/tables.py --check --deterministic      # what the slow test runs

Kinds: ``exact`` regions (losses, counts, bytes: deterministic on CPU) must come back
character for character; ``timing`` regions (benchmarks) come back with other numbers, so
``--check`` compares their structure only (the text with every number replaced by ``#``),
and their text begins with a line naming the machine, its load, the date and the versions
(:func:`machine_line`). ``--run-dir CONFIG=DIR`` reuses a finished run of CONFIG (a run of the
current code) instead of running it again. ``tests/docs/test_docs_tables.py`` checks that every
marker pair is well formed and registered (default suite) and reruns ``--check
--deterministic`` under ``-m slow``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's precisionlab, not an installed one

OPEN = re.compile(r"^<!-- generated: ([a-z0-9][a-z0-9-]*) -->$")
CLOSE = "<!-- /generated -->"
# anything that looks like a marker (not quoted in backticks, as prose quotes one)
_LOOSE = re.compile(r"(?<!`)<!--\s*/?\s*generated\b")


@dataclasses.dataclass(frozen=True)
class Region:
    """One generated region: where it is, how it is made, how it is compared."""

    page: str  # relative to the repository root
    command: str  # what a reader runs to get these numbers
    kind: str  # "exact" or "timing"
    cost_s: int  # rough CPU seconds on 2 idle cores (what --check costs)
    make: Callable[[Context], str]  # returns the region's text (no markers)


@dataclasses.dataclass
class Context:
    """Runs shared between regions of one invocation (one run of a config serves all), in a
    temporary directory made on first use and removed with the context."""

    run_dirs: dict[str, Path] = dataclasses.field(default_factory=dict)
    forecast: dict = dataclasses.field(default_factory=dict)  # see _forecast
    figures_copied: set[str] = dataclasses.field(default_factory=set)  # see run_dir
    _tmp: tempfile.TemporaryDirectory | None = dataclasses.field(default=None, repr=False)

    @property
    def tmp(self) -> Path:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="docs-tables-")
        return Path(self._tmp.name)


# --- markers ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Found:
    name: str
    page: str
    start: int  # 0-based index of the opening marker line
    end: int  # 0-based index of the closing marker line
    body: str


def find_regions(text: str, page: str) -> list[Found]:
    """The generated regions of one page; ValueError naming the line for a malformed marker
    (unclosed, nested, a stray close, a misspelt marker, a marker inside a line)."""
    lines = text.splitlines()
    found: list[Found] = []
    open_at: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        match = OPEN.match(line)
        if match:
            if open_at is not None:
                raise ValueError(f"{page}:{i + 1}: region opened inside {open_at[0]!r}")
            open_at = (match.group(1), i)
        elif line == CLOSE:
            if open_at is None:
                raise ValueError(f"{page}:{i + 1}: {CLOSE} without an opening marker")
            name, start = open_at
            found.append(Found(name, page, start, i, "\n".join(lines[start + 1 : i])))
            open_at = None
        elif _LOOSE.search(line):
            raise ValueError(
                f"{page}:{i + 1}: malformed marker {line.strip()!r}; allowed, alone on a line: "
                f"'<!-- generated: NAME -->' (NAME: a-z, 0-9, -) and {CLOSE!r}"
            )
    if open_at is not None:
        raise ValueError(f"{page}:{open_at[1] + 1}: region {open_at[0]!r} is never closed")
    return found


def pages() -> list[Path]:
    """README.md and every documentation page (not the build output)."""
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def all_regions() -> list[Found]:
    return [
        r for p in pages() for r in find_regions(p.read_text("utf-8"), str(p.relative_to(ROOT)))
    ]


def skeleton(text: str) -> list[str]:
    """What a timing region must keep: its lines with numbers as ``#``, runs of spaces and
    dashes collapsed, and the machine line reduced to its field names."""
    out = []
    for line in text.splitlines():
        if line.startswith("Measured "):
            line = "Measured " + " ".join(
                re.findall(r"\b(?:load average|jax|jaxlib|ml_dtypes)\b", line)
            )
        line = re.sub(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", "#", line)
        out.append(re.sub(r"-{2,}", "--", re.sub(r" +", " ", line)).strip())
    return out


# --- helpers shared by the generators ------------------------------------------------------------
def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "80"}


def cli(*args: str, env: dict[str, str] | None = None) -> str:
    """stdout of ``python -m precisionlab ARGS`` run from the repository root (a fresh
    process: JAX settings such as XLA_FLAGS apply)."""
    proc = subprocess.run(
        [sys.executable, "-m", "precisionlab", *args],
        cwd=ROOT, capture_output=True, text=True, env={**_env(), **(env or {})},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"precisionlab {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return proc.stdout


#: The figures of the site that a run's report draws: config -> (file in the run directory,
#: name in docs/img). ``run_dir`` runs these configs with their report and copies the files
#: (a ``--run-dir`` run too, when it has them), so the command that regenerates a page's
#: numbers also redraws its figures.
FIGURES: dict[str, tuple[tuple[str, str], ...]] = {
    "experiments/fp16_vs_bf16.toml": (("plots/loss.png", "fp16_vs_bf16_loss.png"),),
    "experiments/accumulation.toml": (("plots/loss.png", "accumulation_loss.png"),),
    "experiments/fp8_recipes.toml": (
        ("plots/loss.png", "fp8_recipes_loss.png"),
        ("plots/recipe_groups.png", "fp8_recipes_groups.png"),
    ),
    "experiments/fp8_recipes_outliers.toml": (
        ("plots/loss.png", "fp8_recipes_outliers_loss.png"),
        ("plots/recipe_groups.png", "fp8_recipes_outliers_groups.png"),
    ),
}


def run_dir(ctx: Context, config: str) -> Path:
    """A finished run of ``config`` (with the file's own settings): reused within one
    invocation (and from ``--run-dir``), else run now, without report or plots unless the
    config draws one of :data:`FIGURES` (copied to docs/img once the run is there)."""
    if config not in ctx.run_dirs:
        out = ctx.tmp / Path(config).stem
        # no persistent compilation cache: a clean checkout (CI, a user's first run) compiles,
        # and once (2026-11-28, the main job's range/fp32 row, jax 0.10.2 CPU) a run on a cache
        # filled earlier gave other float32 bits (not reproduced since: getting-started/main-job)
        report = () if config in FIGURES else ("--no-report",)
        cli("run", config, "--out", str(out), "--quiet", *report, "--no-cache")
        ctx.run_dirs[config] = out
    if config not in ctx.figures_copied:
        ctx.figures_copied.add(config)
        for src, dst in FIGURES.get(config, ()):
            if (ctx.run_dirs[config] / src).exists():
                shutil.copyfile(ctx.run_dirs[config] / src, ROOT / "docs" / "img" / dst)
                print(f"copied {src} to docs/img/{dst}", flush=True)
            else:
                print(
                    f"{ctx.run_dirs[config]} has no {src}: docs/img/{dst} not redrawn", flush=True
                )
    return ctx.run_dirs[config]


def summary_table(ctx: Context, config: str, drop: tuple[str, ...] = ("status", "time_s")) -> str:
    """The run's summary table (``precisionlab report``'s columns, without ``drop``, and
    without inf/nan where no variant had any) in Markdown."""
    from precisionlab.experiments import _report as report

    summary = json.loads((run_dir(ctx, config) / "summary.json").read_text())
    headers = report.headers()
    full = report.summary_rows(summary)
    # the inf/nan column only where some variant had inf/NaN gradients
    quiet = {i for i, h in enumerate(headers) if h == "inf/nan"
             and all(r[i] in ("0.0%", "-") for r in full)}  # fmt: skip
    keep = [i for i, h in enumerate(headers) if h not in drop and i not in quiet]
    rows = [[row[i] for i in keep] for row in full]
    return report.markdown_table(rows, [headers[i] for i in keep])


def machine_line() -> str:
    """The line every timing region starts with: date, CPU model and cores, load, versions."""
    import jax
    import jaxlib
    import ml_dtypes
    import numpy

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"Measured {datetime.date.today().isoformat()} on {cpu} ({os.cpu_count()} cores), "
        f"load average {load} (1, 5, 15 min) when it started; Python "
        f"{platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"ml_dtypes {ml_dtypes.__version__}, numpy {numpy.__version__}, CPU backend."
    )


def timed(text_fn: Callable[[Context], str]) -> Callable[[Context], str]:
    """A timing generator: the machine line (taken before the run), a blank line, the text."""

    def make(ctx: Context) -> str:
        line = machine_line()
        return f"{line}\n\n{text_fn(ctx).rstrip()}"

    return make


def fenced(text: str, lang: str = "text") -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


# --- the generators ------------------------------------------------------------------------------
def main_job(ctx: Context) -> str:
    return summary_table(ctx, "experiments/fp16_vs_bf16.toml")


def main_job_notes(ctx: Context) -> str:
    """The paragraph under the main job's table: its numbers from the same run."""
    summary = json.loads(
        (run_dir(ctx, "experiments/fp16_vs_bf16.toml") / "summary.json").read_text()
    )
    unit = {u["name"]: u for u in summary["variants"]}
    nos = unit["range/fp16-noscale"]
    return (
        "`final_loss` is the mean training loss of the last 10 steps, and honest about "
        "divergence: a\nrun that ended diverged reports nan/inf (range/fp16-noscale stops at "
        f"step {nos['divergence_step']}), and\n`summary.json` keeps the mean of its last finite "
        f"losses as `final_loss_finite` ({nos['final_loss_finite']:.2f} here)."
    )


def loss_scaling_notes(ctx: Context) -> str:
    """The main-job page's paragraph on experiments/loss_scaling.toml, numbers from its run."""
    summary = json.loads(
        (run_dir(ctx, "experiments/loss_scaling.toml") / "summary.json").read_text()
    )
    unit = {u["name"]: u for u in summary["variants"]}

    def ev(name: str, digits: int = 2) -> str:
        return f"{unit[name]['eval_loss']:.{digits}f}"

    def skipped(name: str) -> str:
        n, steps = unit[name]["skipped_steps"], unit[name]["steps"]
        return f"all {steps}" if n == steps else f"{n} of {steps}"

    s, g = "small-grads/", "large-grads/"
    return (
        "`precisionlab run experiments/loss_scaling.toml` sweeps static scales 2^0..2^24 "
        "against dynamic\nscaling in fp16: with small gradients (loss weight 2^-16) scale 1 "
        f"underflows (eval loss\n{ev(s + 'static-2^0')} against fp32's {ev(s + 'fp32')}); with "
        f"the plain loss 2^20 skips {skipped(g + 'static-2^20')} steps and 2^24\n"
        f"{skipped(g + 'static-2^24')} (eval loss {ev(g + 'static-2^24')}, chance ln 10 = "
        f"2.30); dynamic scaling matches fp32 in both\n(eval loss {ev(s + 'dynamic', 3)} and "
        f"{ev(g + 'dynamic', 3)} against {ev(s + 'fp32', 3)} and {ev(g + 'fp32', 3)})."
    )


def real_data(ctx: Context) -> str:
    return summary_table(ctx, "experiments/real_data.toml")


def conformance_matrix(ctx: Context) -> str:
    """The two round-to-nearest-even matrices of the default conformance run."""
    out = cli("conformance", "--out", str(ctx.tmp / "conformance"), "--force")
    sections = out.split("\n\n")
    keep = [
        s.strip("\n")
        for s in sections
        if s.lstrip().startswith("from ") and s.lstrip().split("\n")[0].endswith("nearest_even")
    ]
    return fenced("\n\n".join(keep))


def accumulator(ctx: Context) -> str:
    """``bench recipes --accumulator`` as the page's Markdown table: the printed values (3
    significant digits) as percentages, the float32 column to 2 digits."""
    out = cli("bench", "recipes", "--accumulator")
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    lines = [
        "| K | nearest even | nearest even, promote every 128 | toward zero | toward zero, "
        "promote every 128 | float32 accumulator |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for k, *vals in rows:
        cells = [f"{float(v) * 100:.4f}%" for v in vals[:4]] + [f"{float(vals[4]):.1e}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def zero_stages(ctx: Context) -> str:
    """Per-device bytes of tiny_train's fp32 variant under ZeRO stages 0-3 on 8 host devices."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    lines = [
        "| stage | params est. / XLA | optimizer state est. / XLA | gradients est. | "
        "arguments est. / XLA | outputs est. / XLA | temporaries est. / XLA |",
        "|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for stage in range(4):
        out = cli(
            "memory", "--zero-stage", str(stage), "--dp", "8", "--measure",
            "experiments/tiny_train.toml", "--json", env=env,
        )  # fmt: skip
        unit = next(u for u in json.loads(out) if u["unit"] == "fp32")
        row = {r["name"]: r for r in unit["rows"]}

        def pair(name: str, row: dict = row) -> str:
            return f"{row[name]['estimated']:,} / {row[name]['measured']:,}"

        cells = [
            pair("params"), pair("optimizer state"), f"{row['gradients']['estimated']:,}",
            pair("arguments"), pair("outputs"), pair("temporaries"),
        ]  # fmt: skip
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def deepseek_errors(ctx: Context) -> str:
    """DeepSeek-V3's FP8 accumulation measurement on the exact Hopper model: 128 x 4096 x 128
    E4M3 operands (seed 0, drawn in the table's order), one chain against promotion every
    128, relative error against the float64 product of the same E4M3 values."""
    import ml_dtypes
    import numpy as np

    from precisionlab import hardware as hw

    def e(x: float) -> str:
        return re.sub(r"e([-+])0*(\d)", r"e\1\2", f"{x:.1e}")  # 7.0e-2, as the page writes

    rng = np.random.default_rng(0)
    shapes = ((128, 4096), (4096, 128))
    schedules = ({**hw.preset("h100-cublaslt-fast"), "split_k": None}, hw.preset("h100-cublaslt"))

    def cells(a: np.ndarray, b: np.ndarray, normwise: bool) -> list[str]:
        a, b = a.astype(ml_dtypes.float8_e4m3fn), b.astype(ml_dtypes.float8_e4m3fn)
        exact = a.astype(np.float64) @ b.astype(np.float64)
        out = []
        for kwargs in schedules:
            y = np.asarray(hw.gemm(a, b, **kwargs), np.float64)
            if normwise:
                out.append(e(np.max(np.abs(y - exact)) / np.max(np.abs(exact))))
            else:
                rel = np.abs(y - exact) / np.abs(exact)
                out.append(f"{e(rel.max())} ({e(np.median(rel))})")
        return out

    rows = [
        ("uniform(0, 1)", cells(rng.uniform(0, 1, shapes[0]), rng.uniform(0, 1, shapes[1]), False)),
        ("abs(standard normal)", cells(np.abs(rng.standard_normal(shapes[0])),
                                       np.abs(rng.standard_normal(shapes[1])), False)),
        ("standard normal (normwise: max abs error / max abs product)",
         cells(rng.standard_normal(shapes[0]), rng.standard_normal(shapes[1]), True)),
    ]  # fmt: skip
    lines = [
        "| operands | one chain: max (median) | promotion every 128: max (median) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {c[0]} | {c[1]} |" for name, c in rows]
    return "\n".join(lines)


def memory_measured(ctx: Context) -> str:
    """XLA's peak temporaries of experiments/memory.toml's scanned stack against the estimate,
    per checkpoint interval K and micro-batch count (the least checkpointed one in bold)."""
    out = ctx.run_dirs.get("experiments/memory.toml")
    if out is None:
        out = ctx.tmp / "memory"
        cli("run", "experiments/memory.toml", "--out", str(out), "--quiet", "--no-report",
            "--set", "memory.plots=false")  # fmt: skip
    summary = json.loads(next(out.rglob("memory.json")).read_text())
    best = summary["measured_best_k"]
    lines = [
        "| K | micro-batches | XLA temporaries (MiB) | estimate (MiB) | XLA/est "
        "| FLOPs (per scan iteration) |",
        "|--:|--:|--:|--:|--:|--:|",
    ]
    for r in summary["measured"]:
        xla = f"{r['measured_temp'] / 2**20:.2f}"
        if r["k"] is not None and r["k"] == best:
            xla = f"**{xla}**"
        mantissa, exponent = f"{r['flops']:.2e}".split("e")
        cells = [
            "–" if r["k"] is None else str(r["k"]), str(r["microbatches"]), xla,
            f"{r['estimated_temp'] / 2**20:.2f}", f"{r['measured_temp'] / r['estimated_temp']:.2f}",
            f"{mantissa}e{int(exponent)}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main_job_timings(warm: bool) -> Callable[[Context], str]:
    """``run --timings`` of the main job: with an empty compilation cache (cold) or, after
    that, with the cache it filled (warm); the printed table, report row included."""

    def make(ctx: Context) -> str:
        cache = ctx.tmp / "jax-cache"
        key = "timings-cold"
        if key not in ctx.run_dirs:  # the cold run fills the cache the warm one reads
            ctx.run_dirs[key] = _timings_run(ctx, cache, "cold")
        # kept (not popped): the warm region, after it, must not run the cold one again
        text = _timings_run(ctx, cache, "warm") if warm else ctx.run_dirs[key]
        return fenced(text)

    return make


def _timings_run(ctx: Context, cache: Path, label: str) -> str:
    out = cli("run", "experiments/fp16_vs_bf16.toml", "--timings", "--quiet",
              "--cache-dir", str(cache), "--out", str(ctx.tmp / f"timings-{label}"))  # fmt: skip
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("timings (")) + 1
    return "\n".join(lines[start:])


def _mismatch(ctx: Context) -> dict:
    path = run_dir(ctx, "experiments/rl_mismatch.toml") / "mismatch" / "mismatch.json"
    return json.loads(path.read_text())


def rl_mismatch(ctx: Context) -> str:
    """The mismatch experiment's gap and ratio tables and its attribution by layer."""
    from precisionlab.experiments import _mismatch_report as mismatch_report

    summary = _mismatch(ctx)
    return (
        mismatch_report.gap_tables(summary, summary["qi_target"])
        + "\n\n"
        + mismatch_report.attribution_table(summary)
    )


def rl_reinforce(ctx: Context) -> str:
    """The mismatch experiment's REINFORCE table (same run as rl-mismatch)."""
    from precisionlab.experiments import _mismatch_report as mismatch_report

    return mismatch_report.rl_table(_mismatch(ctx))


def accumulation_run(ctx: Context) -> str:
    """The accumulation experiment's printed table (its time column is wall seconds)."""
    from precisionlab.experiments import _report as report

    summary = json.loads(
        (run_dir(ctx, "experiments/accumulation.toml") / "summary.json").read_text()
    )
    table = report.fitted_table(report.summary_rows(summary), report.headers())
    return "<!-- readme: skip a 25-minute run on 2 shared cores -->\n" + fenced(
        "$ precisionlab run experiments/accumulation.toml\n...\n" + table, "console"
    )


def checkpointing_run(ctx: Context) -> str:
    """The checkpointing experiment's ``summary.txt``; its two figures are copied to
    docs/img/checkpointing_{transformer,mlp}.png, which the memory guide shows."""
    import shutil

    config = "experiments/checkpointing.toml"
    out = ctx.run_dirs.get(config)
    if out is None:  # with its plots (run_dir runs without the report)
        out = ctx.tmp / "checkpointing"
        cli("run", config, "--out", str(out), "--quiet", "--no-report", "--no-cache")
        ctx.run_dirs[config] = out
    result = out / "checkpointing"
    for png in sorted(result.glob("checkpointing_*.png")):
        shutil.copyfile(png, ROOT / "docs" / "img" / png.name)
    return fenced((result / "summary.txt").read_text("utf-8"), "")


def recipe_figures(config: str, setting: str) -> Callable[[Context], str]:
    """The training-with-recipes guide's two figures of ``config`` (its run's loss and
    recipe-group plots, copied to docs/img by :func:`run_dir`), as the page shows them."""

    def make(ctx: Context) -> str:
        run_dir(ctx, config)
        loss, groups = (dst for _, dst in FIGURES[config])
        return (
            f"![training loss of every variant, {setting}](../img/{loss})\n\n"
            f"![saturation and underflow per group over steps, {setting}](../img/{groups})"
        )

    return make


#: The published gates the fp8 recipes table marks (|gap to bf16| and |relative gap|).
FP8_GATES = (0.01, 0.0025)


def fp8_recipes_table(ctx: Context) -> str:
    """The training-with-recipes guide's results table: every variant of the clean and the
    outlier-channel runs, its final loss and gap to the ``bf16`` variant of its setting, the
    gates, and the recipe metrics (saturated and underflowed fractions per group, the output
    gradients' SQNR: ``summary.json``'s ``recipe_metrics``)."""
    absolute, relative = FP8_GATES
    head = (
        "| setting | variant | final loss | gap to bf16 | relative gap | gap < 0.01 "
        "| rel. < 0.25% | diverged at | saturated x / w / g | underflow x / w / g | SQNR g (dB) |\n"
        "|---|---|---:|---:|---:|:-:|:-:|---:|---:|---:|---:|"
    )
    lines = [head]
    for config in ("experiments/fp8_recipes.toml", "experiments/fp8_recipes_outliers.toml"):
        summary = json.loads((run_dir(ctx, config) / "summary.json").read_text())
        variants = summary["variants"]
        control = {v["setting"]: v["final_loss"] for v in variants if v["name"].endswith("/bf16")}
        for v in variants:
            setting, name = v["name"].split("/", 1)
            loss, base = v["final_loss"], control[setting]
            if loss is None or base is None:  # a run with no finite loss: nothing to compare
                raise ValueError(f"{config}: {v['name']} or its bf16 control has no final loss")
            gap, rel = loss - base, (loss - base) / base
            gates = ["", ""] if name == "bf16" else [
                "pass" if abs(gap) < absolute else "fail",
                "pass" if abs(rel) < relative else "fail",
            ]  # fmt: skip
            metrics = v.get("recipe_metrics")
            if metrics:
                groups = [metrics[g] for g in ("x", "w", "g")]
                sat = " / ".join(f"{100 * m['saturated']:.2f}%" for m in groups)
                under = " / ".join(f"{100 * m['underflow']:.2f}%" for m in groups)
                sqnr = f"{metrics['g']['sqnr_db']:.1f}"
            else:
                sat = under = sqnr = "-"
            step = v.get("divergence_step")
            cells = [setting, name, f"{loss:.4f}", f"{gap:+.4f}", f"{100 * rel:+.2f}%", *gates,
                     "-" if step is None else str(step), sat, under, sqnr]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_table(*args: str) -> Callable[[Context], str]:
    """The Markdown table a ``bench ... --markdown`` prints (its header lines dropped: the
    machine line says the same)."""

    def make(ctx: Context) -> str:
        return "\n".join(ln for ln in cli("bench", *args).splitlines() if ln.startswith("|"))

    return make


def bench_console(*args: str) -> Callable[[Context], str]:
    def make(ctx: Context) -> str:
        text = f"$ precisionlab bench {' '.join(args)}\n" + cli("bench", *args)
        return "<!-- readme: skip timing on a shared machine -->\n" + fenced(text, "console")

    return make


def bench_text(*args: str) -> Callable[[Context], str]:
    def make(ctx: Context) -> str:
        return fenced(cli("bench", *args), "")

    return make


def fp4_tournament(ctx: Context) -> str:
    """The FP4 tournament's status, ranking, gradient statistics and claims (tournament.json of
    a run of experiments/fp4_tournament.toml, or of ``--run-dir``); the run's three plots are
    copied to docs/img/fp4_tournament_{loss,gaps,gemm_stats}.png, which the page shows."""
    import shutil

    from precisionlab.experiments import _tournament_report as tournament_report

    config = "experiments/fp4_tournament.toml"
    out = run_dir(ctx, config) / "tournament"
    summary = json.loads((out / "tournament.json").read_text())
    for src, dst in (("loss_curves", "loss"), ("gaps", "gaps"), ("gemm_stats", "gemm_stats")):
        if (out / f"{src}.png").exists():
            shutil.copyfile(out / f"{src}.png", ROOT / "docs" / "img" / f"fp4_tournament_{dst}.png")
    return "\n\n".join(
        [
            tournament_report.status_markdown(summary),
            tournament_report.ranking_markdown(summary),
            tournament_report.stats_markdown(summary),
            tournament_report.claims_markdown(summary),
        ]
    )


#: The recipes of the 4-bit step cost table (item 5 of the FP4 tournament issue).
FP4_BENCH_RECIPES = (
    "bf16,nvfp4,mxfp4,nvidia_fp4,tseng_fp4,quartet,quartet2,four_over_six,tetrajet,"
    "tetrajet_v2,fp4_all_the_way"
)


_CODEC_FORMATS = (
    "bf16,fp16,e4m3fn,e5m2,e4m3fnuz,e5m2fnuz,e4m3b11fnuz,e3m4,float8_e4m3,e8m0,e2m3,e3m2,e2m1,int8"
)


#: Every generated region, by the name its markers carry.
#: The divergence suite's evaluation as published (forecast.json of the run the forecast
#: regions were generated from, its run directory replaced by the experiment file).
FORECAST_RESULT = ROOT / "docs" / "data" / "divergence_suite_forecast.json"


def _forecast(ctx: Context) -> dict:
    """The forecast evaluation of the divergence suite (``diagnose --forecast`` on its run,
    bisect included), computed once per invocation; ``--update`` also writes it to
    :data:`FORECAST_RESULT` (the results committed with the page)."""
    if "forecast" not in ctx.run_dirs:
        config = "experiments/divergence_suite.toml"
        run = run_dir(ctx, config)
        cli("diagnose", "--forecast", str(run), "--quiet")
        ctx.run_dirs["forecast"] = run
        result = json.loads((run / "forecast.json").read_text())
        result["run_dir"] = f"a run of {config}"
        ctx.forecast = result
    return ctx.forecast


def forecast_evaluation(ctx: Context) -> str:
    from precisionlab.diagnose._forecast_run import scores_table

    result = _forecast(ctx)
    layers = result.get("bisect_layers", {})
    found = "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(layers.items())) or "none"
    return scores_table(result) + f"\n\nCulprit layers found by `diagnose --bisect`: {found}."


def forecast_suite(ctx: Context) -> str:
    """Per setting: the variants, what happened to them (failure, step) and the alarms."""
    from precisionlab.experiments._report import markdown_table

    result = _forecast(ctx)
    groups: dict[tuple[str, str], list[dict]] = {}
    for u in result["units"]:
        groups.setdefault((u["setting"], u["variant"]), []).append(u)
    rows = []
    for (setting, variant), units in groups.items():

        def outcome(u: dict) -> str:
            if not u["failure"]:
                return "trained"
            tag = "" if u["precision_failure"] else " (also fp32)"
            return f"{u['failure']} at {u['failure_step']}{tag}"

        def alarm(u: dict) -> str:
            a = u["alarm"]
            return "-" if a is None else f"{a['step']}: {a['mechanism']}, {a['layer']}"

        rows.append([
            setting, variant, units[0]["split"], ", ".join(str(u["seed"]) for u in units),
            "; ".join(outcome(u) for u in units), "; ".join(alarm(u) for u in units),
        ])  # fmt: skip
    hdr = ["setting", "variant", "split", "seeds", "outcome per seed", "first alarm per seed"]
    return markdown_table(rows, hdr)


def forecast_rules(ctx: Context) -> str:
    """The frozen model's rules: what the forecaster fires on (the shipped thresholds)."""
    from precisionlab.experiments._report import markdown_table
    from precisionlab.train._forecast import load_model

    model = load_model()
    rows = []
    for r in model["rules"]:
        t = r["threshold"]
        rows.append([
            r["mechanism"], f"`{r['signal']}`", r["feature"],
            "off (no gain on the fitting runs)" if t is None else f"{r['op']} {t:.4g}",
            r["requires"] or "-", "-" if r["lead"] is None else f"{r['lead']:.0f}",
        ])  # fmt: skip
    hdr = ["mechanism", "signal", "feature", "fires when", "runs it applies to", "median lead"]
    head = (
        f"Debounce: {model['debounce']} consecutive records; trends over the last "
        f"{model['window']} records."
    )
    return head + "\n\n" + markdown_table(rows, hdr)


REGIONS: dict[str, Region] = {
    "main-job": Region(
        "docs/getting-started/main-job.md",
        "precisionlab run experiments/fp16_vs_bf16.toml",
        "exact",
        200,
        main_job,
    ),
    "main-job-notes": Region(
        "docs/getting-started/main-job.md",
        "precisionlab run experiments/fp16_vs_bf16.toml",
        "exact",
        0,
        main_job_notes,
    ),
    "loss-scaling-notes": Region(
        "docs/getting-started/main-job.md",
        "precisionlab run experiments/loss_scaling.toml",
        "exact",
        120,
        loss_scaling_notes,
    ),
    "conformance-matrix": Region(
        "docs/explanations/conformance.md",
        "precisionlab conformance --out /tmp/precisionlab-conformance",
        "exact",
        25,
        conformance_matrix,
    ),
    "accumulator-error": Region(
        "docs/guides/recipes.md",
        "precisionlab bench recipes --accumulator",
        "exact",
        15,
        accumulator,
    ),
    "memory-zero-stages": Region(
        "docs/guides/memory.md",
        "XLA_FLAGS=--xla_force_host_platform_device_count=8 precisionlab memory "
        "--zero-stage S --dp 8 --measure experiments/tiny_train.toml --json (S = 0..3)",
        "exact",
        130,
        zero_stages,
    ),
    "memory-measured": Region(
        "docs/guides/memory.md",
        "precisionlab run experiments/memory.toml",
        "exact",
        120,
        memory_measured,
    ),
    "memory-checkpointing": Region(
        "docs/guides/memory.md",
        "precisionlab run experiments/checkpointing.toml",
        "timing",
        600,
        timed(checkpointing_run),
    ),
    "fp8-figures": Region(
        "docs/guides/training-with-recipes.md",
        "precisionlab run experiments/fp8_recipes.toml",
        "exact",
        700,
        recipe_figures("experiments/fp8_recipes.toml", "clean setting"),
    ),
    "fp8-recipes-table": Region(
        "docs/guides/training-with-recipes.md",
        "precisionlab run experiments/fp8_recipes.toml; "
        "precisionlab run experiments/fp8_recipes_outliers.toml",
        "exact",
        1020,
        fp8_recipes_table,
    ),
    "fp8-outliers-figures": Region(
        "docs/guides/training-with-recipes.md",
        "precisionlab run experiments/fp8_recipes_outliers.toml",
        "exact",
        320,
        recipe_figures("experiments/fp8_recipes_outliers.toml", "outlier channels"),
    ),
    "rl-mismatch": Region(
        "docs/guides/consistency.md",
        "precisionlab run experiments/rl_mismatch.toml",
        "exact",
        240,
        rl_mismatch,
    ),
    "rl-reinforce": Region(
        "docs/guides/consistency.md",
        "precisionlab run experiments/rl_mismatch.toml",
        "exact",
        0,
        rl_reinforce,
    ),
    "real-data": Region(
        "docs/guides/real-data.md",
        "precisionlab run experiments/real_data.toml",
        "exact",
        1200,
        real_data,
    ),
    "hardware-deepseek": Region(
        "docs/explanations/hardware-validation.md",
        "python docs/tables.py --update --only hardware-deepseek (hardware.gemm, seed 0)",
        "exact",
        30,
        deepseek_errors,
    ),
    "hardware-accumulation": Region(
        "docs/guides/hardware.md",
        "precisionlab run experiments/accumulation.toml",
        "timing",
        1500,
        accumulation_run,
    ),
    "performance-cold": Region(
        "docs/benchmarks/performance.md",
        "precisionlab run experiments/fp16_vs_bf16.toml --timings --cache-dir EMPTY_DIR",
        "timing",
        250,
        timed(main_job_timings(warm=False)),
    ),
    "performance-warm": Region(
        "docs/benchmarks/performance.md",
        "precisionlab run experiments/fp16_vs_bf16.toml --timings --cache-dir DIR (filled)",
        "timing",
        100,
        timed(main_job_timings(warm=True)),
    ),
    "fp4-tournament": Region(
        "docs/guides/fp4-tournament.md",
        "precisionlab run experiments/fp4_tournament.toml",
        "exact",
        14400,
        fp4_tournament,
    ),
    "bench-fp4-recipes": Region(
        "docs/benchmarks/recipes.md",
        f"precisionlab bench recipes --recipes {FP4_BENCH_RECIPES} --repeats 2",
        "timing",
        1800,
        timed(bench_console("recipes", "--recipes", FP4_BENCH_RECIPES, "--repeats", "2")),
    ),
    "bench-codecs-whole-array": Region(
        "docs/benchmarks/codecs.md",
        "precisionlab bench codecs --whole-array --malloc-tuning --repeats 7 --markdown "
        f"--formats {_CODEC_FORMATS}",
        "timing",
        400,
        timed(
            bench_table(
                "codecs",
                "--whole-array",
                "--malloc-tuning",
                "--repeats",
                "7",
                "--markdown",
                "--formats",
                _CODEC_FORMATS,
            )
        ),
    ),
    "bench-codecs-chunked": Region(
        "docs/benchmarks/codecs.md",
        "precisionlab bench codecs --repeats 7 --markdown",
        "timing",
        300,
        timed(bench_table("codecs", "--repeats", "7", "--markdown")),
    ),
    "bench-quant": Region(
        "docs/benchmarks/quant.md",
        "precisionlab bench quant --repeats 15 --malloc-tuning",
        "timing",
        60,
        timed(bench_text("quant", "--repeats", "15", "--malloc-tuning")),
    ),
    "forecast-evaluation": Region(
        "docs/guides/forecast.md",
        "precisionlab run experiments/divergence_suite.toml --out runs/divergence_suite && "
        "precisionlab diagnose --forecast runs/divergence_suite",
        "exact",
        3600,
        forecast_evaluation,
    ),
    "forecast-suite": Region(
        "docs/guides/forecast.md",
        "precisionlab diagnose --forecast runs/divergence_suite (forecast.json)",
        "exact",
        3600,
        forecast_suite,
    ),
    "forecast-rules": Region(
        "docs/guides/forecast.md",
        "precisionlab diagnose --forecast runs/divergence_suite --fit (forecast_model.json)",
        "exact",
        0,
        forecast_rules,
    ),
    "bench-predictors": Region(
        "docs/benchmarks/forecast.md",
        "precisionlab bench predictors",
        "timing",
        120,
        timed(bench_console("predictors")),
    ),
    "bench-hardware": Region(
        "docs/benchmarks/hardware.md",
        "precisionlab bench hardware",
        "timing",
        60,
        timed(bench_console("hardware")),
    ),
}


# --- the command ---------------------------------------------------------------------------------
def _select(only: list[str] | None, deterministic: bool) -> list[str]:
    names = list(REGIONS)
    if only:
        unknown = [n for n in only if n not in REGIONS]
        if unknown:
            raise ValueError(f"unknown region {', '.join(unknown)}; allowed: {', '.join(names)}")
        names = [n for n in names if n in only]
    if deterministic:
        names = [n for n in names if REGIONS[n].kind == "exact"]
    return names


def check(names: list[str], ctx: Context) -> list[str]:
    """Rerun each region and compare with the page; the differences, as messages."""
    found = {r.name: r for r in all_regions()}
    problems = []
    for name in names:
        region = REGIONS[name]
        if name not in found:
            problems.append(f"{name}: no markers in {region.page}")
            continue
        have, new = found[name].body.strip("\n"), region.make(ctx).strip("\n")
        same = have == new if region.kind == "exact" else skeleton(have) == skeleton(new)
        if not same:
            problems.append(
                f"{name} ({region.page}) differs from `{region.command}`:\n"
                f"--- page\n{have}\n+++ now\n{new}"
            )
    return problems


def update(names: list[str], ctx: Context) -> None:
    for name in names:
        region = REGIONS[name]
        text = region.make(ctx).strip("\n")
        path = ROOT / region.page
        lines = path.read_text("utf-8").splitlines()
        spot = [r for r in find_regions("\n".join(lines), region.page) if r.name == name]
        if not spot:
            raise SystemExit(f"{name}: no markers in {region.page}")
        lines[spot[0].start + 1 : spot[0].end] = text.splitlines()
        path.write_text("\n".join(lines) + "\n", "utf-8")
        print(f"updated {name} in {region.page}", flush=True)
    if ctx.forecast:
        FORECAST_RESULT.parent.mkdir(parents=True, exist_ok=True)
        FORECAST_RESULT.write_text(json.dumps(ctx.forecast, indent=1) + "\n", "utf-8")
        print(f"wrote {FORECAST_RESULT.relative_to(ROOT)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--list", action="store_true", help="list the regions")
    mode.add_argument("--check", action="store_true", help="rerun and compare")
    mode.add_argument("--update", action="store_true", help="rerun and rewrite the pages")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these regions only")
    parser.add_argument("--deterministic", action="store_true", help="exact regions only")
    parser.add_argument("--max-cost", type=int, metavar="S",
                        help="skip regions costing more than S CPU seconds")  # fmt: skip
    parser.add_argument("--run-dir", action="append", default=[], metavar="CONFIG=DIR",
                        help="reuse this finished run of CONFIG (of the current code)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except ValueError as error:  # bad input: one line, exit status 2
        print(f"docs/tables.py: {error}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    names = _select(args.only, args.deterministic)
    if args.max_cost is not None:
        names = [n for n in names if REGIONS[n].cost_s <= args.max_cost]
    if args.list:
        for name in names:
            r = REGIONS[name]
            print(f"{name:<26} {r.kind:<6} ~{r.cost_s:>4} s  {r.page}\n{'':<26} $ {r.command}")
        return 0
    ctx = Context()
    for item in args.run_dir:
        config, sep, directory = item.partition("=")
        if not sep or not (Path(directory) / "summary.json").exists():
            raise ValueError(f"--run-dir {item!r}: expected CONFIG=DIR with DIR a finished run")
        ctx.run_dirs[config] = Path(directory).resolve()
    if args.update:
        update(names, ctx)
        return 0
    problems = check(names, ctx)
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{len(names) - len(problems)} of {len(names)} regions as generated")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
