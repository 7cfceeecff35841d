"""The ``memory`` experiment kind: sweeps of estimated and measured memory, with plots.

A ``[memory]`` table (all keys optional)::

    [memory]
    preset = "gpt3-175b"                 # model of the estimated sweeps
    policies = ["f32", "p=f32,c=bf16", "p=f32,c=f16", "bf16"]   # bytes/param per policy
    optimizer = "adam"
    batch = 1
    # seq = 2048                         # absent: the model's context length
    checkpoint_intervals = []            # K of the memory-vs-K sweep; [] = 1..n_layers
    measure = true                       # also measure a real jitted step vs K with XLA
    measure_layers = 16                  # its residual stack: layers, width, batch
    measure_d_model = 64
    measure_batch = 256
    measure_microbatches = [1, 2, 4]     # gradient accumulation sweep of the measured step
    plots = true

Measured rows carry XLA's temporaries, FLOPs (``cost_analysis``) and the median step time on
this machine, so the price of checkpointing (recompute) sits beside what it saves.

``run`` writes ``rows.jsonl`` (one JSON object per result, appended and flushed as produced),
``memory.json`` (the summary, written atomically) and PNG plots.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from precisionlab import _io
from precisionlab._schema import Field, validate_table, with_docs
from precisionlab.memory.estimate import (
    OPTIMIZERS,
    TrainSetup,
    best_checkpoint_interval,
    estimate,
    estimate_step,
)
from precisionlab.memory.measure import measure, time_step
from precisionlab.memory.presets import get_preset
from precisionlab.memory.steps import stack_step
from precisionlab.mixed import get_policy

__all__ = ["DEFAULTS", "KIND", "run", "validate"]

KIND = "memory"

DEFAULTS: dict[str, Any] = {
    "preset": "gpt3-175b",
    "policies": ["f32", "p=f32,c=bf16", "p=f32,c=f16", "bf16"],
    "optimizer": "adam",
    "batch": 1,
    "seq": None,
    "checkpoint_intervals": [],
    "measure": True,
    "measure_layers": 16,
    "measure_d_model": 64,
    "measure_batch": 256,
    "measure_microbatches": [1, 2, 4],
    "plots": True,
}
#: The ``[memory]`` keys with their types and ranges (names are checked by :func:`validate`).
FIELDS: dict[str, Field] = {
    "preset": Field(str, DEFAULTS["preset"]),
    "policies": Field(list, DEFAULTS["policies"], item=str),
    "optimizer": Field(str, DEFAULTS["optimizer"]),
    # Bounds: every count here sizes a loop or an allocation (measure_layers = 2^63 hung in a
    # divisor loop); past them the sweep is not a measurement this machine can make.
    "batch": Field(int, DEFAULTS["batch"], low=1, high=1 << 24),
    "seq": Field(int, DEFAULTS["seq"], nullable=True, low=1, high=1 << 24),
    "checkpoint_intervals": Field(
        list, DEFAULTS["checkpoint_intervals"], item=int, low=1, high=1 << 16
    ),
    "measure": Field(bool, DEFAULTS["measure"]),
    "measure_layers": Field(
        int, DEFAULTS["measure_layers"], low=1, high=256, why="one compiled step per divisor"
    ),
    "measure_d_model": Field(int, DEFAULTS["measure_d_model"], low=1, high=1 << 14),
    "measure_batch": Field(int, DEFAULTS["measure_batch"], low=1, high=1 << 16),
    "measure_microbatches": Field(
        list, DEFAULTS["measure_microbatches"], item=int, low=1, high=1 << 16
    ),
    "plots": Field(bool, DEFAULTS["plots"]),
}
FIELDS = with_docs(
    FIELDS,
    {
        "preset": "model of the estimated sweeps (a preset name)",
        "policies": "precision policies compared (bytes per parameter per policy)",
        "optimizer": "optimizer whose state is counted",
        "batch": "sequences per step",
        "seq": "sequence length (absent: the model's context length)",
        "checkpoint_intervals": "K of the memory-vs-K sweep ([] = 1 .. the layer count)",
        "measure": "also measure a real jitted step vs K with XLA",
        "measure_layers": "layers of the measured residual stack",
        "measure_d_model": "width of the measured residual stack",
        "measure_batch": "batch of the measured residual stack",
        "measure_microbatches": "gradient accumulation sweep of the measured step",
        "plots": "write PNG plots",
    },
)


def _type_ok(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def validate(section: dict, where: str) -> dict:
    """The ``[memory]`` table with defaults filled in.

    Raises:
      ValueError: naming ``where`` and the key for an unknown key, a wrong type, an unknown
        preset, policy or optimizer, or a bad number.
    """
    out = validate_table(section, FIELDS, where)
    try:
        model = get_preset(out["preset"])
    except ValueError as err:
        raise ValueError(f"{where}.preset: {err}") from None
    if not out["policies"]:
        raise ValueError(f"{where}.policies: give at least one policy")
    for i, spec in enumerate(out["policies"]):
        try:
            get_policy(spec)
        except ValueError as err:
            raise ValueError(f"{where}.policies[{i}]: {err}") from None
    if out["optimizer"] not in OPTIMIZERS:
        raise ValueError(
            f"{where}.optimizer: unknown optimizer {out['optimizer']!r}; "
            f"allowed: {', '.join(OPTIMIZERS)}"
        )
    for i, k in enumerate(out["checkpoint_intervals"]):
        if not _type_ok(k, int) or not 1 <= k <= model.n_layers:
            raise ValueError(
                f"{where}.checkpoint_intervals[{i}]: expected an int in 1..{model.n_layers}, "
                f"got {k!r}"
            )
    for i, m in enumerate(out["measure_microbatches"]):
        if not _type_ok(m, int) or m < 1 or out["measure_batch"] % m:
            raise ValueError(
                f"{where}.measure_microbatches[{i}]: expected an int >= 1 dividing "
                f"measure_batch={out['measure_batch']}, got {m!r}"
            )
    out["measure_microbatches"] = list(out["measure_microbatches"])
    out["policies"] = list(out["policies"])
    out["checkpoint_intervals"] = list(out["checkpoint_intervals"])
    return out


def _write_json(path: Path, data: Any) -> None:
    _io.write_json(path, data)


class _Rows:
    """Append-and-flush JSONL writer."""

    def __init__(self, path: Path) -> None:
        self.file = _io.JsonlWriter(path)

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(row)

    def close(self) -> None:
        self.file.close()


def run(section: dict, out_dir: Path, *, quiet: bool = False) -> dict:
    """Run the sweeps of a validated ``[memory]`` table; returns the JSON-able summary."""
    cfg = validate(section, "memory")
    out_dir = Path(out_dir)
    _io.makedirs(out_dir)
    model = get_preset(cfg["preset"])
    seq = cfg["seq"] or None
    rows = _Rows(out_dir / "rows.jsonl")
    say = (lambda *_: None) if quiet else print
    try:
        policies = []
        for spec in cfg["policies"]:
            setup = TrainSetup(policy=spec, optimizer=cfg["optimizer"], batch=cfg["batch"], seq=seq)
            b = estimate(model, setup)
            row = {"sweep": "policy", "policy": spec, **b.to_dict()}
            rows.write(row)
            policies.append(row)
            say(f"{spec:<16} {b.bytes_per_param:6.2f} bytes/param  total {b.total / 1e9:10.2f} GB")
        base = TrainSetup(
            policy=cfg["policies"][0], optimizer=cfg["optimizer"], batch=cfg["batch"], seq=seq
        )
        ks = cfg["checkpoint_intervals"] or list(range(1, model.n_layers + 1))
        sweep = []
        for k in ks:
            b = estimate(model, dataclasses.replace(base, checkpoint_every=k))
            row = {"sweep": "checkpoint", "policy": cfg["policies"][0], "k": k, **b.to_dict()}
            rows.write(row)
            sweep.append(row)
        plain = estimate(model, base)
        best_boundary = best_checkpoint_interval(model, base, full=False)
        best_full = best_checkpoint_interval(model, base, full=True)
        say(
            f"{model.name}: least activation memory at K={best_full} (transformer block count), "
            f"K={best_boundary} (boundary only; sqrt(N) = {math.sqrt(model.n_layers):.1f})"
        )
        measured = _measure_sweep(cfg, rows, say) if cfg["measure"] else []
    finally:
        rows.close()
    checkpointed = [r for r in measured if r["k"] is not None]
    files = ["rows.jsonl", "memory.json"]
    if cfg["plots"]:
        files += _plots(model, cfg["optimizer"], policies, sweep, plain, measured, out_dir)
    summary = {
        "kind": KIND,
        "preset": model.name,
        "bytes_per_param": {row["policy"]: row["bytes_per_param"] for row in policies},
        "total_bytes": {row["policy"]: row["total"] for row in policies},
        "best_k_boundary": best_boundary,
        "best_k_full": best_full,
        "sqrt_n_layers": math.sqrt(model.n_layers),
        "measured": [
            {
                k: r[k]
                for k in ("k", "microbatches", "estimated_temp", "measured_temp", "flops", "step_s")
            }
            for r in measured
        ],
        "measured_best_k": min(checkpointed, key=lambda r: r["measured_temp"])["k"]
        if checkpointed
        else None,
        "files": files,
    }
    _write_json(out_dir / "memory.json", summary)
    return summary


def _measure_sweep(cfg: dict, rows: _Rows, say: Any) -> list[dict[str, Any]]:
    n = cfg["measure_layers"]
    runs = [(k, 1) for k in [None] + [k for k in range(1, n + 1) if n % k == 0]]
    runs += [(None, m) for m in cfg["measure_microbatches"] if m > 1]
    out = []
    for k, m in runs:
        built = stack_step(
            n_layers=n,
            d_model=cfg["measure_d_model"],
            batch=cfg["measure_batch"],
            checkpoint_every=k,
            microbatches=m,
        )
        got = measure(built.step, *built.args, run=False)
        est = estimate_step(
            built.params, built.batch, activation_bytes=built.activation_bytes, microbatches=m
        )
        step_s = time_step(built.step, *built.args, repeats=3)
        row = {
            "sweep": "measured_checkpoint" if m == 1 else "measured_microbatches",
            "k": k,
            "microbatches": m,
            "description": built.description,
            "estimated_temp": est.temporaries,
            "measured_temp": got.temporaries,
            "estimated_arguments": est.arguments,
            "measured_arguments": got.arguments,
            "flops": got.flops,
            "step_s": step_s,
            "backend": got.backend,
        }
        rows.write(row)
        out.append(row)
        say(
            f"measured K={k or '-':>3} M={m}: temporaries {got.temporaries / 2**20:7.2f} MiB "
            f"(estimate {est.temporaries / 2**20:7.2f} MiB), {got.flops or 0:.3g} FLOPs, "
            f"{step_s * 1e3:.2f} ms/step"
        )
    return out


def _plots(
    model: Any,
    optimizer: str,
    policies: list[dict[str, Any]],
    sweep: list[dict[str, Any]],
    plain: Any,
    measured: list[dict[str, Any]],
    out_dir: Path,
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    # Bytes per parameter per policy, stacked by kind of state.
    fig, ax = plt.subplots(figsize=(7, 4.2))
    parts = [
        ("weights", "weights"),
        ("master_weights", "master weights"),
        ("gradients", "gradients"),
        ("optimizer_state", "optimizer state"),
    ]
    names = [row["policy"] for row in policies]
    bottom = [0.0] * len(policies)
    for key, label in parts:
        values = [row[key] / row["n_params"] for row in policies]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:g}", ha="center", va="bottom")
    ax.set_ylabel("bytes per parameter")
    ax.set_xlabel("precision policy")
    ax.set_title(f"{model.name}: model-state bytes per parameter ({optimizer})")
    ax.set_ylim(0, max(bottom) * 1.15)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    _io.save_figure(fig, out_dir / "bytes_per_param.png", dpi=120)
    plt.close(fig)
    files.append("bytes_per_param.png")

    # Activation memory vs checkpoint interval K.
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ks = [row["k"] for row in sweep]
    for key, style, label in (
        ("activations_full", "o-", "transformer-block count"),
        ("activations_boundary", "s-", "boundary-only count"),
    ):
        ax.plot(ks, [row[key] / 1e9 for row in sweep], style, ms=3, label=label)
    ax.axhline(
        plain.activations_full / 1e9, color="gray", ls=":", label="no checkpointing (block count)"
    )
    ax.axvline(math.sqrt(model.n_layers), color="k", ls="--", lw=0.8, label="K = sqrt(N)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"checkpoint every K layers (N = {model.n_layers})")
    ax.set_ylabel("activation memory (GB = 1e9 bytes)")
    ax.set_title(f"{model.name}: activation memory vs checkpoint interval")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _io.save_figure(fig, out_dir / "checkpoint_interval.png", dpi=120)
    plt.close(fig)
    files.append("checkpoint_interval.png")

    if any(r["k"] is not None for r in measured):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        ck = [r for r in measured if r["k"] is not None]
        base = next((r for r in measured if r["k"] is None and r["microbatches"] == 1), None)
        ax.plot(
            [r["k"] for r in ck],
            [r["measured_temp"] / 2**20 for r in ck],
            "o-",
            label=f"XLA temp_size ({ck[0]['backend']})",
        )
        ax.plot(
            [r["k"] for r in ck], [r["estimated_temp"] / 2**20 for r in ck], "s--", label="estimate"
        )
        if base is not None:
            ax.axhline(
                base["measured_temp"] / 2**20, color="gray", ls=":", label="XLA, no checkpointing"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["k"] for r in ck], [str(r["k"]) for r in ck])
        ax.set_xlabel("checkpoint every K layers")
        ax.set_ylabel("temporaries (MiB = 2^20 bytes)")
        ax.set_title(ck[0]["description"].split(",")[0] + ": measured vs estimated")
        ax.legend(fontsize=8)
        fig.tight_layout()
        _io.save_figure(fig, out_dir / "measured_checkpoint.png", dpi=120)
        plt.close(fig)
        files.append("measured_checkpoint.png")
    return files
