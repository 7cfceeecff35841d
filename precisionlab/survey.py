"""The downcast-error survey: every format on every input, side by side.

Library: :func:`make_input` draws named distributions (``normal``, ``laplace``,
``uniform``, ``student_t:DF``, ``loguniform:LO:HI``), :func:`load_inputs` reads .npy/.npz
tensors, :func:`survey_rows` quantizes each input to each format and measures the damage
(:func:`precisionlab.metrics.error_report`), :func:`plot_survey` draws error histograms and
a SQNR-per-format chart.

Experiment kind ``"survey"`` (the runner dispatches on a TOML's top-level ``kind``):
:func:`validate` checks the ``[survey]`` table, :func:`run` writes ``rows.jsonl`` (one line
per row as it is produced), ``summary.txt`` and plots into the output folder.
"""

from __future__ import annotations

import math
import os
import pathlib
import zipfile
from collections.abc import Callable, Iterator
from typing import IO, Any

import jax
import jax.numpy as jnp
import numpy as np
from numpy.lib import format as npy

from precisionlab import _io
from precisionlab._schema import Field, validate_table, with_docs
from precisionlab.bits import ROUNDING_MODES, parse_rounding
from precisionlab.formats import FloatFormat, get_format
from precisionlab.metrics import error_report, format_table
from precisionlab.quant import dequantize, element_scales, get_mx_format, quantize
from precisionlab.quant._spec import parse_format, parse_scale

__all__ = [
    "DEFAULTS",
    "DISTRIBUTIONS",
    "KIND",
    "SUMMARY_COLUMNS",
    "load_inputs",
    "make_input",
    "parse_granularity",
    "plot_survey",
    "run",
    "summary_table",
    "survey_rows",
    "validate",
]

#: The experiment kind this module runs.
KIND = "survey"
#: The named input distributions (DF, LO and HI are numbers).
DISTRIBUTIONS = ("normal", "laplace", "uniform", "student_t:DF", "loguniform:LO:HI")
DEFAULT_FORMATS = ["int8", "int4", "e4m3fn", "e5m2", "bf16", "fp16", "mxfp8_e4m3", "mxfp4"]
DEFAULT_DISTS = ["normal", "laplace", "student_t:3", "loguniform:-20:10"]
#: The ``[survey]`` table's defaults.
DEFAULTS: dict = {
    "formats": DEFAULT_FORMATS,
    "dists": DEFAULT_DISTS,
    "granularity": "tensor",
    "scale": "auto",
    "rounding": "nearest_even",
    "size": 65536,
    "seed": 0,
    "input": None,
}
#: The ``[survey]`` keys (types and ranges; names are checked by :func:`validate`).
FIELDS: dict[str, Field] = {
    "formats": Field(list, DEFAULT_FORMATS, item=str),
    "dists": Field(list, DEFAULT_DISTS, item=str),
    "granularity": Field(str, "tensor"),
    "scale": Field(str, "auto"),
    "rounding": Field(str, "nearest_even"),
    "size": Field(int, 65536, low=1),
    "seed": Field(int, 0, low=0),
    "input": Field(str, None, nullable=True),
}
FIELDS = with_docs(
    FIELDS,
    {
        "formats": "formats to survey (any format name or MX format)",
        "dists": "input distributions (``DISTRIBUTIONS``)",
        "granularity": "tensor, channel:AXIS or block:B",
        "scale": "auto, amax, mse, percentile:P or none",
        "rounding": "rounding mode",
        "size": "elements per synthetic input",
        "seed": "random seed",
        "input": "a .npy or .npz tensor file to survey instead of the distributions",
    },
)
#: The columns of a survey row (and of its table).
SUMMARY_COLUMNS = [
    "format",
    "granularity",
    "bits_per_element",
    "sqnr_db",
    "rmse",
    "max_rel_error",
    "mean_ulp_error",
    "frac_overflow",
    "frac_saturated",
    "frac_underflow",
]
# short headers keep a survey table within 100 columns (the site's code blocks)
_HEADERS = {"bits_per_element": "bits", "format": "format", "granularity": "scaling"}
# log10 of the relative error, for the histograms.
_HIST_EDGES = np.linspace(-8.0, 1.0, 37)
_ROW_COLUMNS = 256  # synthetic inputs are (size // 256, 256) when size allows


#: loguniform's bounds (log10): past them every sample is 0 or inf in float32.
_LOG10_LOW, _LOG10_HIGH = -45, 39


# --- inputs --------------------------------------------------------------------------------
def _parse_dist(spec: str) -> tuple[str, tuple[float, ...]]:
    if not isinstance(spec, str):
        raise TypeError(f"a distribution is a string such as 'normal', got {spec!r}")
    name, *params = spec.strip().lower().split(":")
    try:
        values = tuple(float(p) for p in params)
    except ValueError:
        values = ()
        params = ["bad"]
    want = {"normal": 0, "laplace": 0, "uniform": 0, "student_t": 1, "loguniform": 2}
    if name not in want or len(values) != want[name] or len(params) != want[name]:
        raise ValueError(f"unknown distribution {spec!r}; allowed: {', '.join(DISTRIBUTIONS)}")
    if name == "student_t" and not values[0] > 0:
        raise ValueError(f"distribution {spec!r}: degrees of freedom must be > 0")
    if name == "loguniform" and not all(_LOG10_LOW <= v <= _LOG10_HIGH for v in values):
        raise ValueError(
            f"distribution {spec!r}: LO and HI must be within {_LOG10_LOW}..{_LOG10_HIGH} "
            "(log10 of float32's smallest subnormal and largest finite magnitudes)"
        )
    if name == "loguniform" and not values[0] < values[1]:
        raise ValueError(f"distribution {spec!r}: need LO < HI (log10 of the magnitudes)")
    return name, values


def _shape_for(size: int) -> tuple[int, ...]:
    if size % _ROW_COLUMNS == 0 and size >= 4 * _ROW_COLUMNS:
        return (size // _ROW_COLUMNS, _ROW_COLUMNS)
    return (size,)


def make_input(spec: str, size: int, seed: int = 0) -> np.ndarray:
    """float32 sample of a named distribution, shape ``(size // 256, 256)`` when ``size`` is
    a multiple of 256 (at least 1024), else ``(size,)``.

    ``loguniform:LO:HI`` has magnitudes ``10**U(LO, HI)`` and random signs.
    """
    name, params = _parse_dist(spec)
    rng = np.random.default_rng(seed)
    shape = _shape_for(size)
    if name == "normal":
        x = rng.standard_normal(shape)
    elif name == "laplace":
        x = rng.laplace(size=shape)
    elif name == "uniform":
        x = rng.uniform(-1.0, 1.0, shape)
    elif name == "student_t":
        x = rng.standard_t(params[0], shape)
    else:
        mag = 10.0 ** rng.uniform(params[0], params[1], shape)
        x = np.where(rng.random(shape) < 0.5, -mag, mag)
    return x.astype(np.float32)


# Inputs are bounded before anything is allocated: a synthetic --size or a .npy header can
# declare any shape, and each surveyed format holds a few float32 copies of the input.
MAX_ELEMENTS = 2**24


def _check_elements(n: int, what: str) -> None:
    if n > MAX_ELEMENTS:
        raise ValueError(
            f"{what} has {n:,} elements; the survey takes at most {MAX_ELEMENTS:,} (2^24) per input"
        )


def _npy_header(fh: IO[bytes], name: str) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype from a .npy header, read without loading the data."""
    try:
        version = npy.read_magic(fh)
    except ValueError:
        raise ValueError(f"input {name!r} is not a NumPy .npy file (no .npy header)") from None
    try:
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(fh)
        else:
            shape, _, dtype = npy.read_array_header_2_0(fh)
    except (ValueError, SyntaxError, TypeError):
        raise ValueError(f"input {name!r} has a malformed .npy header") from None
    return shape, dtype


def _check_array(name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
    if dtype.hasobject:
        raise ValueError(f"input {name!r} holds Python objects (pickled data); save floats")
    if dtype.kind == "V":
        raise ValueError(
            f"input {name!r} has dtype {dtype.str} (raw bytes: numpy saves ml_dtypes types such "
            "as bfloat16 this way and cannot tell them apart); save it as float32 first"
        )
    if not np.issubdtype(dtype, np.floating):
        raise ValueError(f"input {name!r} has dtype {dtype}; the survey needs floats")
    _check_elements(math.prod(shape), f"input {name!r} (shape {shape})")
    if math.prod(shape) == 0:
        raise ValueError(f"input {name!r} is empty (shape {shape})")


def load_inputs(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Float arrays of a .npy file (named by its stem) or every array of a .npz
    (``stem:key``), as float32. Headers are checked (dtype, at most :data:`MAX_ELEMENTS`
    elements) before any data is read; pickles are never loaded."""
    path = pathlib.Path(path)
    if path.suffix not in (".npy", ".npz"):
        raise ValueError(f"input {str(path)!r}: expected a .npy or .npz file")
    if not path.is_file():
        raise ValueError(f"input {str(path)!r}: no such file")
    if path.stat().st_size == 0:
        raise ValueError(f"input {str(path)!r} is an empty file")
    if path.suffix == ".npy":
        with open(path, "rb") as fh:
            shape, dtype = _npy_header(fh, path.stem)
        _check_array(path.stem, shape, dtype)
        return _load(path, path.stem)
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise ValueError(f"input {str(path)!r} is not a NumPy .npz file (not a zip)") from None
    with archive:
        members = [m for m in archive.namelist() if m.endswith(".npy")]
        if not members:
            raise ValueError(f"input {str(path)!r} holds no arrays")
        total = 0
        for member in members:
            with archive.open(member) as fh:
                shape, dtype = _npy_header(fh, f"{path.stem}:{member[:-4]}")
            _check_array(f"{path.stem}:{member[:-4]}", shape, dtype)
            total += math.prod(shape)
        if total > 4 * MAX_ELEMENTS:
            raise ValueError(
                f"input {str(path)!r} holds {total:,} elements; at most {4 * MAX_ELEMENTS:,} "
                "(2^26) in all"
            )
    return _load(path, path.stem, members)


def _load(path: pathlib.Path, name: str, members: list[str] | None = None) -> dict[str, np.ndarray]:
    """np.load after the headers were checked, named as :func:`load_inputs` names them; a
    truncated or corrupt body is a ValueError."""
    try:
        if path.suffix == ".npy":
            return {name: np.load(path, allow_pickle=False).astype(np.float32)}
        # only the .npy members whose headers were checked: another member (a 1 GiB text
        # file) is never read
        keys = [m[:-4] for m in members or []]
        with np.load(path, allow_pickle=False) as loaded:
            return {f"{name}:{k}": np.asarray(loaded[k]).astype(np.float32) for k in keys}
    except (EOFError, OSError, ValueError, zipfile.BadZipFile) as err:
        raise ValueError(f"input {str(path)!r} is truncated or corrupt ({err})") from None


# --- one survey ----------------------------------------------------------------------------
def parse_granularity(text: str) -> tuple[int | None, int | None]:
    """``"tensor"`` -> (None, None); ``"channel:AXIS"`` -> (AXIS, None); ``"block:B"`` ->
    (None, B)."""
    allowed = "allowed: tensor, channel:AXIS, block:B"
    if not isinstance(text, str):
        raise TypeError(f"granularity must be a string ({allowed}), got {text!r}")
    key = text.strip().lower()
    if key == "tensor":
        return None, None
    kind, _, arg = key.partition(":")
    try:
        value = int(arg)
    except ValueError:
        value = None
    if kind == "channel" and value is not None:
        return value, None
    if kind == "block" and value is not None and value >= 1:
        return None, value
    raise ValueError(f"unknown granularity {text!r}; {allowed}")


def _check_format(name: str) -> None:
    parse_format(name)


def _quant_args(fmt_name: str, granularity: str, scale: str) -> dict:
    axis, block = parse_granularity(granularity)
    mx = get_mx_format(fmt_name)
    if mx is not None:
        return {}  # MX: blocks of 32 along the last axis, scale by the spec's rule
    fmt = get_format(fmt_name)
    if isinstance(fmt, FloatFormat) and fmt.bits >= 16:
        return {"scale": "none"}  # a plain downcast: scaling a wide format only adds error
    return {"axis": axis, "block_size": block, "scale": None if scale == "auto" else scale}


def survey_rows(
    formats: list[str],
    inputs: dict[str, np.ndarray],
    *,
    granularity: str = "tensor",
    scale: str = "auto",
    rounding: str = "nearest_even",
    seed: int = 0,
    hists: dict | None = None,
) -> Iterator[dict]:
    """Yield one row per (input, format): metadata plus every error metric.

    ``hists``, if given, receives ``(input, format) -> counts`` of log10 relative error
    over ``_HIST_EDGES`` for :func:`plot_survey`.
    """
    key = jax.random.key(seed) if rounding == "stochastic" else None
    for input_name, arr in inputs.items():
        x = jnp.asarray(arr)
        for fmt_name in formats:
            kwargs = _quant_args(fmt_name, granularity, scale)
            try:
                q = quantize(x, fmt_name, rounding=rounding, key=key, **kwargs)
            except ValueError as err:
                raise ValueError(f"input {input_name!r}, format {fmt_name!r}: {err}") from None
            x_hat = dequantize(q)
            report = error_report(x, x_hat, q.fmt, scale=element_scales(q))
            row = {"input": input_name, "format": fmt_name, **q.describe()}
            row["format"] = fmt_name
            row.update(report.to_dict())
            row.pop("fmt", None)
            if hists is not None:
                hists[(input_name, fmt_name)] = _rel_hist(np.asarray(x), np.asarray(x_hat))
            yield row


def _rel_hist(x: np.ndarray, x_hat: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(x_hat.astype(np.float64) - x) / np.abs(x.astype(np.float64))
    rel = rel[np.isfinite(rel) & (rel > 0)]
    logs = np.clip(np.log10(rel), _HIST_EDGES[0], _HIST_EDGES[-1])
    return np.histogram(logs, bins=_HIST_EDGES)[0]


def summary_table(rows: list[dict]) -> str:
    """One table per input: rows are formats, columns the main metrics."""
    blocks = []
    for name in dict.fromkeys(r["input"] for r in rows):
        sub = [r for r in rows if r["input"] == name]
        shape = "x".join(str(d) for d in sub[0]["shape"])
        bad = sub[0].get("n_nonfinite") or 0
        # say so: the errors cover the finite elements only (none: every error is "-")
        note = f"; {bad:,} not finite, left out of the errors" if bad else ""
        blocks.append(
            f"input {name} ({shape}{note})\n" + format_table(sub, SUMMARY_COLUMNS, headers=_HEADERS)
        )
    return "\n\n".join(blocks)


def plot_survey(rows: list[dict], hists: dict, path: str | os.PathLike) -> None:
    """PNG: SQNR per format (bars grouped by input) over log10 relative-error histograms."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    inputs = list(dict.fromkeys(r["input"] for r in rows))
    formats = list(dict.fromkeys(r["format"] for r in rows))
    fig = Figure(figsize=(11, 3.6 * (1 + len(inputs))), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1 + len(inputs), 1, squeeze=False)[:, 0]
    width = 0.8 / max(len(inputs), 1)
    for i, name in enumerate(inputs):
        sq = {r["format"]: r["sqnr_db"] for r in rows if r["input"] == name}
        vals = [sq.get(f, math.nan) for f in formats]
        vals = [v if math.isfinite(v) else math.nan for v in vals]
        xs = np.arange(len(formats)) + (i - (len(inputs) - 1) / 2) * width
        axes[0].bar(xs, vals, width=width, label=name)
    axes[0].set_xticks(np.arange(len(formats)), formats, rotation=20)
    axes[0].set_ylabel("SQNR (dB)")
    axes[0].set_title("SQNR per format (higher is better)")
    axes[0].legend(fontsize="small")
    centers = (_HIST_EDGES[:-1] + _HIST_EDGES[1:]) / 2
    for ax, name in zip(axes[1:], inputs, strict=True):
        for fmt_name in formats:
            counts = hists.get((name, fmt_name))
            if counts is not None and counts.sum() > 0:
                ax.step(centers, counts / counts.sum(), where="mid", label=fmt_name)
        ax.set_xlabel("log10 relative error (nonzero errors; edges clipped)")
        ax.set_ylabel("fraction")
        ax.set_title(f"error histogram: {name}")
        ax.legend(fontsize="small", ncols=2)
    _io.save_figure(fig, path, dpi=90)


# --- experiment kind -----------------------------------------------------------------------
def validate(section: dict, where: str = "survey") -> dict:
    """Check a ``[survey]`` table and fill in defaults (see :data:`DEFAULTS`).

    Raises:
      ValueError: naming ``where.key`` for an unknown key, a wrong type or an unknown name.
    """
    given = validate_table(section, FIELDS, where, defaults=False)
    out: dict[str, Any] = {k: (list(v) if isinstance(v, list) else v) for k, v in DEFAULTS.items()}
    if "input" in given and "dists" not in given:
        out["dists"] = []
    out.update(given)
    if not out["formats"]:
        raise ValueError(f"{where}.formats is empty; name at least one format")
    for name in out["formats"]:
        try:
            _check_format(name)
        except ValueError as err:
            raise ValueError(f"{where}.formats: {err}") from None
    for d in out["dists"]:
        try:
            _parse_dist(d)
        except ValueError as err:
            raise ValueError(f"{where}.dists: {err}") from None
    try:
        parse_granularity(out["granularity"])
    except ValueError as err:
        raise ValueError(f"{where}.granularity: {err}") from None
    try:
        parse_scale(out["scale"], get_format("int8"))
    except ValueError as err:
        raise ValueError(f"{where}.scale: {err}") from None
    try:
        out["rounding"] = parse_rounding(out["rounding"]).value
    except ValueError:
        raise ValueError(
            f"{where}.rounding: unknown mode {out['rounding']!r}; allowed: "
            + ", ".join(ROUNDING_MODES)
        ) from None
    for k, low, high in (("size", 1, MAX_ELEMENTS), ("seed", 0, 2**63 - 1)):
        v = out[k]
        if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
            shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
            raise ValueError(f"{where}.{k} must be an int in [{low}, {high:,}], got {shown}")
    if out["input"] is not None:
        if not isinstance(out["input"], str) or not out["input"].endswith((".npy", ".npz")):
            raise ValueError(f"{where}.input must be a path to a .npy or .npz file")
    if not out["dists"] and out["input"] is None:
        raise ValueError(f"{where}: no inputs; give dists or input")
    return out


def gather_inputs(cfg: dict) -> dict[str, np.ndarray]:
    """The survey's inputs: each distribution (seeded per position), then the file's arrays."""
    inputs = {d: make_input(d, cfg["size"], cfg["seed"] + i) for i, d in enumerate(cfg["dists"])}
    if cfg["input"] is not None:
        inputs.update(load_inputs(cfg["input"]))
    return inputs


def execute(
    cfg: dict, *, on_row: Callable[[dict], None] | None = None, hists: dict | None = None
) -> list[dict]:
    """Run a validated survey config; call ``on_row`` with each row as it is produced."""
    rows = []
    for row in survey_rows(
        cfg["formats"], gather_inputs(cfg), granularity=cfg["granularity"],
        scale=cfg["scale"], rounding=cfg["rounding"], seed=cfg["seed"], hists=hists,
    ):  # fmt: skip
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


_atomic_write = _io.write_text


def run(section: dict, out_dir: pathlib.Path, *, quiet: bool = False) -> dict:
    """Run the survey of a ``[survey]`` table into ``out_dir``.

    Writes ``rows.jsonl`` (each row written and flushed as it is produced), ``summary.txt``
    and the plot ``errors.png`` (SQNR bars and error histograms). Returns a JSON-able summary.
    """
    cfg = validate(section, "survey")
    out_dir = _io.makedirs(out_dir)
    hists: dict = {}
    rows_path = out_dir / "rows.jsonl"
    with _io.JsonlWriter(rows_path, "w") as f:  # a rerun recomputes every row (seeded)

        def write(row: dict) -> None:
            f.write(row)  # strict JSON: a non-finite value is the string "nan"/"inf"
            if not quiet:
                print(
                    f"{row['input']:>20}  {row['format']:<12} SQNR {row['sqnr_db']:8.2f} dB",
                    flush=True,
                )

        rows = execute(cfg, on_row=write, hists=hists)
    table = summary_table(rows)
    _atomic_write(out_dir / "summary.txt", table + "\n")
    plot_survey(rows, hists, out_dir / "errors.png")
    if not quiet:
        print(table)
    best = {}
    for name in dict.fromkeys(r["input"] for r in rows):
        sub = [r for r in rows if r["input"] == name and math.isfinite(r["sqnr_db"])]
        if sub:
            best[name] = max(sub, key=lambda r: r["sqnr_db"])["format"]
    return {
        "kind": KIND,
        "rows": len(rows),
        "formats": cfg["formats"],
        "inputs": list(dict.fromkeys(r["input"] for r in rows)),
        "best_sqnr_format": best,
        "sqnr_db": {f"{r['input']}/{r['format']}": _json_float(r["sqnr_db"]) for r in rows},
        "files": ["rows.jsonl", "summary.txt", "errors.png"],
    }


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else str(v)
