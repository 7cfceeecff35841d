"""The ``mismatch`` experiment kind: trainer vs sampler log-probability gaps, fp32 vs bf16 vs
fp16, on a model trained briefly on real text.

A ``[mismatch]`` table (every key optional)::

    [mismatch]
    formats = ["fp32", "bf16", "fp16"]   # compute formats compared
    eval_rows = 8                        # held-out windows scored
    control = "bf16"                     # the control pair: a trainer stack against itself
    attribution = ["h100/bf16"]          # SETUP/FORMAT pairs whose gap is attributed by layer
    qi_target = 5.0                      # bf16's RMS gap / fp16's that Qi et al. lead to expect
    [mismatch.train]                     # a [train] table: the built-in transformer's training
    ...
    [mismatch.setups.h100]               # name -> trainer and sampler (Stack fields but policy)
    trainer = { hardware = "h100-xla", mode = "full" }
    sampler = { hardware = "h100-cublaslt", mode = "decode", batch_size = 4 }
    [mismatch.rl]                        # the consequence: REINFORCE (off unless enabled)
    enabled = true
    formats = ["bf16", "fp16"]
    seeds = 2
    steps = 100

The model is trained in float32 (``[mismatch.train]``, resumable from its checkpoints), then
for every setup and format the trainer stack and the sampler stack score the same held-out
windows and :func:`precisionlab.consistency.logprob_gap` compares them. ``run`` writes, as
they are produced: ``params.npz`` and ``train.json`` (the trained weights), ``pairs.jsonl``
(one row per pair) and ``deltas/`` (each pair's per-token gaps), ``attribution.jsonl``,
``rl.jsonl`` (one row per REINFORCE run of :mod:`precisionlab.consistency._rl`); then
``mismatch.json`` (per pair: ``a``, ``b``, ``mean_nats``, ``rms_nats``, ``max_nats``,
``clip_share``, ``flip_rate``, ``kl``; the bf16/fp16 ratios; the attribution; the REINFORCE
summary), ``report.md`` and the plots. A killed run resumes: what was written is read back,
not recomputed.
"""

from __future__ import annotations

import copy
import io
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from precisionlab import _io
from precisionlab._schema import Field, validate_table, with_docs
from precisionlab.consistency import Runner, Stack, attribute, gap_from_logits
from precisionlab.consistency._rl import SAMPLERS, RLConfig, reinforce
from precisionlab.experiments import _mismatch_report as mismatch_report
from precisionlab.train import TrainConfig, make_data, make_model, train

__all__ = ["DEFAULT_SETUPS", "DEFAULT_TRAIN", "FIELDS", "KIND", "RL_FIELDS", "run", "validate"]

KIND = "mismatch"

#: The model and its training: the built-in transformer on the Python standard library's
#: source (byte level), float32, a few hundred steps.
DEFAULT_TRAIN: dict[str, Any] = {
    "model": "transformer",
    "model_kwargs": {"d_model": 128, "depth": 2, "heads": 4},
    "data": "text",
    "data_kwargs": {"seq_len": 64},
    "optimizer": "adam",
    "lr": 2e-3,
    "schedule": "cosine",
    "warmup_steps": 20,
    "steps": 300,
    "batch_size": 16,
    "eval_batches": 4,
    "checkpoint_interval": 100,
    "telemetry": {"enabled": False},
}

#: Trainer vs sampler: a JAX trainer (XLA's GEMMs on an H100, one full-sequence call) against
#: a PyTorch-style inference engine (cuBLASLt's GEMMs, KV-cache decoding with a split-KV
#: attention kernel, 4 rows a batch), both as the hardware models compute them; the GEMM
#: library alone (both full-sequence); and the decode kernel alone, natively on this machine.
DEFAULT_SETUPS: dict[str, dict[str, dict[str, Any]]] = {
    "h100": {
        "trainer": {"hardware": "h100-xla", "mode": "full"},
        "sampler": {"hardware": "h100-cublaslt", "mode": "decode", "batch_size": 4},
    },
    "gemm-library": {
        "trainer": {"hardware": "h100-xla", "mode": "full"},
        "sampler": {"hardware": "h100-cublaslt", "mode": "full"},
    },
    "native": {
        "trainer": {"hardware": "native", "mode": "full"},
        "sampler": {"hardware": "native", "mode": "decode", "batch_size": 4},
    },
}

FIELDS: dict[str, Field] = with_docs(
    {
        "formats": Field(list, ["fp32", "bf16", "fp16"], item=str),
        "eval_rows": Field(int, 8, low=1, high=4096, why="4096 windows"),
        "eval_seed": Field(int, 0, low=0, high=2**32 - 1, why="a uint32 seed"),
        "control": Field(str, "bf16"),
        "attribution": Field(list, ["h100/bf16", "h100/fp16"], item=str),
        "qi_target": Field(float, 5.0, above=0.0, high=1e6, why="a ratio"),
        "plots": Field(bool, True),
        "train": Field(dict, {}),
        "setups": Field(dict, {}),
        "rl": Field(dict, {}),
    },
    {
        "formats": "compute formats compared (each a Stack policy: fp32, bf16, fp16, ...)",
        "eval_rows": "held-out windows scored (each of the model's seq_len tokens)",
        "eval_seed": "seed of the held-out windows",
        "control": "format of the control pair: the first setup's trainer against itself",
        "attribution": "SETUP/FORMAT pairs attributed by layer (activation patching)",
        "qi_target": "the bf16 / fp16 RMS-gap ratio checked (Qi et al.: bf16 >> fp16)",
        "plots": "write the ratio histogram, gap-by-position and gap-by-layer plots",
        "train": "a [train] table for the built-in transformer (absent: DEFAULT_TRAIN)",
        "setups": "name -> {trainer = {...}, sampler = {...}}: Stack fields but policy "
        "(default: DEFAULT_SETUPS)",
        "rl": "the REINFORCE study (see [mismatch.rl])",
    },
)

_STACK_KEYS = ("hardware", "mode", "batch_size", "kv_block", "lm_head_fp32", "name")

#: ``[mismatch.rl]``: the REINFORCE study (:func:`precisionlab.consistency._rl.reinforce`).
RL_FIELDS: dict[str, Field] = with_docs(
    {
        "enabled": Field(bool, False),
        "formats": Field(list, ["bf16", "fp16"], item=str),
        "samplers": Field(list, ["matched", "decode", "decode+tis"], item=str),
        "seeds": Field(int, 2, low=1, high=64, why="64 runs per sampler"),
        "steps": Field(int, 100, low=1, high=100_000, why="a toy task"),
        "vocab": Field(int, 8, low=2, high=4096),
        "length": Field(int, 8, low=1, high=512),
        "d_model": Field(int, 32, low=1, high=4096),
        "depth": Field(int, 2, low=1, high=64),
        "heads": Field(int, 4, low=1, high=64),
        "batch": Field(int, 64, low=2, high=1 << 16),
        "lr": Field(float, 3e-3, above=0.0, high=1.0),
        "tis_cap": Field(float, 2.0, above=0.0, high=1e6),
        "kv_block": Field(int, 4, low=1, high=4096),
    },
    {
        "enabled": "run the REINFORCE study",
        "formats": "policy formats trained",
        "samplers": "matched (the trainer's own program), decode, decode+tis",
        "seeds": "runs per format and sampler (seeds 0..seeds-1)",
        "steps": "REINFORCE steps per run",
        "vocab": "the toy task's vocabulary",
        "length": "tokens written per sequence",
        "d_model": "the policy transformer's width",
        "depth": "its blocks",
        "heads": "its attention heads",
        "batch": "sequences per step (even: the noise compares the halves)",
        "lr": "Adam's learning rate",
        "tis_cap": "truncated importance sampling's cap on p_trainer / p_sampler",
        "kv_block": "the decode sampler's split-KV block",
    },
)
_RL_CONFIG = ("vocab", "length", "d_model", "depth", "heads", "batch", "lr", "tis_cap",
              "kv_block", "steps")  # fmt: skip


def _stack(fmt: str, fields: dict[str, Any]) -> Any:
    # Stack parses a format name into a Policy in __post_init__ (as documented); its field's
    # type says what it holds after that
    return Stack(policy=fmt, **fields)  # type: ignore[arg-type]


def _train_config(table: dict[str, Any], where: str) -> Any:
    cfg = TrainConfig.from_dict(table, where)
    if cfg.model != "transformer":
        raise ValueError(f"{where}.model: the mismatch experiment scores a language model: "
                         f"'transformer', got {cfg.model!r}")  # fmt: skip
    return cfg


def validate(section: dict, where: str) -> dict:
    """The ``[mismatch]`` table with defaults filled in; ValueError naming ``where`` and the
    key for an unknown key, a bad value, a bad ``[train]`` table or stack."""
    out = validate_table(section, FIELDS, where)
    train = copy.deepcopy(out["train"] or DEFAULT_TRAIN)  # a table given replaces the default
    try:
        cfg = _train_config(train, f"{where}.train")
    except (ValueError, TypeError) as err:
        msg = str(err).splitlines()[0]
        raise ValueError(msg if msg.startswith(where) else f"{where}.train: {msg}") from None
    setups = out["setups"] or copy.deepcopy(DEFAULT_SETUPS)
    if not out["formats"]:
        raise ValueError(f"{where}.formats: give at least one format")
    for i, fmt in enumerate(out["formats"] + [out["control"]]):
        key = f"formats[{i}]" if i < len(out["formats"]) else "control"
        try:
            _stack(fmt, {})
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}.{key}: {str(err).splitlines()[0]}") from None
    for name, setup in setups.items():
        w = f"{where}.setups.{name}"
        if not isinstance(setup, dict) or set(setup) != {"trainer", "sampler"}:
            raise ValueError(f"{w}: expected a table with exactly 'trainer' and 'sampler'; "
                             f"got {setup!r}"[:300])  # fmt: skip
        for role in ("trainer", "sampler"):
            fields = setup[role]
            if not isinstance(fields, dict):
                raise ValueError(f"{w}.{role}: expected a table of Stack fields")
            bad = [k for k in fields if k not in _STACK_KEYS]
            if bad:
                raise ValueError(
                    f"{w}.{role}: unknown key {bad[0]!r}; allowed: {', '.join(_STACK_KEYS)} "
                    "(the format comes from formats)"
                )
            try:
                st = _stack("fp32", fields)
            except (ValueError, TypeError) as err:
                raise ValueError(f"{w}.{role}: {str(err).splitlines()[0]}") from None
            if st.batch_size is not None and out["eval_rows"] % st.batch_size:
                raise ValueError(f"{w}.{role}.batch_size: {st.batch_size} must divide "
                                 f"eval_rows={out['eval_rows']}")  # fmt: skip
    for i, item in enumerate(out["attribution"]):
        name, _, fmt = item.partition("/")
        if name not in setups or fmt not in out["formats"]:
            raise ValueError(
                f"{where}.attribution[{i}]: {item!r} is not SETUP/FORMAT of this experiment; "
                f"setups: {', '.join(setups)}; formats: {', '.join(out['formats'])}"
            )
    out["train"] = cfg.to_dict()
    out["setups"] = setups
    out["rl"] = _validate_rl(out["rl"], f"{where}.rl")
    return out


def _validate_rl(table: dict[str, Any], where: str) -> dict[str, Any]:
    rl = validate_table(table, RL_FIELDS, where)
    for i, fmt in enumerate(rl["formats"]):
        try:
            _stack(fmt, {})
        except (ValueError, TypeError) as err:
            raise ValueError(f"{where}.formats[{i}]: {str(err).splitlines()[0]}") from None
    for i, name in enumerate(rl["samplers"]):
        if name not in SAMPLERS:
            raise ValueError(f"{where}.samplers[{i}]: unknown {name!r}; allowed: "
                             f"{', '.join(SAMPLERS)}")  # fmt: skip
    try:
        RLConfig(**{k: rl[k] for k in _RL_CONFIG})
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    if rl["batch"] % 2:
        raise ValueError(f"{where}.batch: must be even (the noise compares the halves)")
    if rl["d_model"] % rl["heads"]:
        raise ValueError(f"{where}.d_model: {rl['d_model']} is not divisible by heads "
                         f"{rl['heads']}")  # fmt: skip
    return rl


# --- the trained model --------------------------------------------------------------------


def _save_params(path: Path, params: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    buf = io.BytesIO()
    arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy stub: **arrays vs allow_pickle
    with _io.atomic_open(path, "wb") as f:
        f.write(buf.getvalue())


def _load_params(path: Path, like: Any) -> Any:
    data = np.load(io.BytesIO(_io.read_bytes(path, 1 << 30)))
    paths, tree = jax.tree_util.tree_flatten_with_path(like)
    leaves = []
    for k, v in paths:
        arr = data[jax.tree_util.keystr(k)]
        if arr.shape != v.shape:
            raise ValueError(f"{path}: {jax.tree_util.keystr(k)} has shape {arr.shape}, the "
                             f"model's is {v.shape}; remove the file to retrain")  # fmt: skip
        leaves.append(jax.numpy.asarray(arr))
    return jax.tree_util.tree_unflatten(tree, leaves)


def _trained(
    cfg: Any, out_dir: Path, say: Callable[[str], None]
) -> tuple[Any, Any, dict[str, Any]]:
    """(model, params, train summary): read back if this run trained already."""
    model = make_model(cfg.model, **cfg.model_kwargs, **_model_sizes(cfg))
    params_path, info_path = out_dir / "params.npz", out_dir / "train.json"
    if params_path.exists() and info_path.exists():
        say("mismatch: trained weights found, not retraining")
        return model, _load_params(params_path, model.param_shapes()), _io.read_json(info_path)
    say(f"mismatch: training the transformer ({cfg.steps} steps)")
    start = time.perf_counter()
    result = train(cfg, checkpoint_dir=out_dir / "checkpoints" if cfg.checkpoint_interval
                   else None, resume=True, quiet=True)  # fmt: skip
    params = jax.device_get(result.state.params)
    info = {
        "steps": int(result.steps_done),
        "final_loss": float(result.final_loss),
        "eval_loss": None if result.eval_loss is None else float(result.eval_loss),
        "eval_metric": None if result.eval_metric is None else float(result.eval_metric),
        "wall_s": time.perf_counter() - start,
        "param_count": int(model.param_count(params)),
    }
    _save_params(params_path, params)
    _io.write_json(info_path, info)
    return model, params, info


def _model_sizes(cfg: Any) -> dict[str, Any]:
    sizes = make_data(cfg.data, **cfg.data_kwargs).model_kwargs()
    return {k: v for k, v in sizes.items() if k not in cfg.model_kwargs}


def _eval_tokens(cfg: Any, rows: int, seed: int) -> np.ndarray:
    """Held-out windows of the model's length: [rows, seq_len] int32."""
    data = make_data(cfg.data, **cfg.data_kwargs)
    batch = data.batch(0, rows, seed=seed + 1_000_003, split="eval")
    return np.asarray(batch["tokens"])[:, :-1].astype(np.int32)


# --- the run --------------------------------------------------------------------------------


def _pair_key(setup: str, fmt: str) -> str:
    return f"{setup}/{fmt}"


def run(section: dict, out_dir: Path, *, quiet: bool = False) -> dict:
    """Run a ``[mismatch]`` table into ``out_dir``; returns the JSON-able summary."""
    t0 = time.perf_counter()
    cfg = validate(section, "mismatch")
    out_dir = Path(out_dir)
    _io.makedirs(out_dir / "deltas")
    say = (lambda *_: None) if quiet else print
    tcfg = _train_config(cfg["train"], "mismatch.train")
    model, params, train_info = _trained(tcfg, out_dir, say)
    tokens = _eval_tokens(tcfg, cfg["eval_rows"], cfg["eval_seed"])
    runner = Runner(model, params)

    done = {r["key"]: r for r in _io.read_jsonl(out_dir / "pairs.jsonl")}
    wanted = [(name, fmt) for name in cfg["setups"] for fmt in cfg["formats"]]
    first = next(iter(cfg["setups"]))
    wanted.append(("control", cfg["control"]))
    rows = []
    with _io.JsonlWriter(out_dir / "pairs.jsonl") as pairs_file:
        for setup, fmt in wanted:
            key = _pair_key(setup, fmt)
            delta_path = out_dir / "deltas" / f"{key.replace('/', '_')}.npy"
            if key in done and delta_path.exists():
                rows.append(done[key])
                continue
            src = cfg["setups"][first if setup == "control" else setup]
            a = _stack(fmt, src["trainer"])
            b = a if setup == "control" else _stack(fmt, src["sampler"])
            start = time.perf_counter()
            ra = runner.run(a, tokens)
            rb = runner.run(b, tokens)  # the control: the same stack run a second time
            gap = gap_from_logits(tokens, ra.logits, rb.logits, a, b)
            buf = io.BytesIO()
            np.save(buf, np.stack([gap.delta, gap.kl_tokens]))
            with _io.atomic_open(delta_path, "wb") as f:
                f.write(buf.getvalue())
            row = {"key": key, "setup": setup, "format": fmt, **gap.summary(),
                   "by_position": [_num(x) for x in gap.by_position()],
                   "seconds": time.perf_counter() - start}  # fmt: skip
            pairs_file.write(_io.to_jsonable(row))
            rows.append(row)
            say(f"mismatch: {key}: {gap.text()}")
    rows = [_plain(r) for r in rows]

    done_attr = {r["key"]: r for r in _io.read_jsonl(out_dir / "attribution.jsonl")}
    attributions = []
    with _io.JsonlWriter(out_dir / "attribution.jsonl") as attr_file:
        for item in cfg["attribution"]:
            if item in done_attr:
                attributions.append(done_attr[item])
                continue
            setup, _, fmt = item.partition("/")
            a = _stack(fmt, cfg["setups"][setup]["trainer"])
            b = _stack(fmt, cfg["setups"][setup]["sampler"])
            att = attribute(model, params, tokens, a, b, runner=runner)
            row = {"key": item, **att.to_dict(), "ranked": [r.layer for r in att.ranked()]}
            attr_file.write(_io.to_jsonable(row))
            attributions.append(row)
            say(f"mismatch: attribution {item}:\n{att.text()}")

    rl_runs = _rl(cfg["rl"], out_dir, say)
    ratios = _ratios(rows, cfg)
    summary = {
        "kind": KIND,
        "train": train_info,
        "model": {**tcfg.model_kwargs, **_model_sizes(tcfg)},
        "eval_rows": cfg["eval_rows"],
        "tokens_scored": int(tokens.shape[0] * (tokens.shape[1] - 1)),
        "setups": cfg["setups"],
        "pairs": [r for r in rows if r["setup"] != "control"],
        "control": next(r for r in rows if r["setup"] == "control"),
        "ratios": ratios,
        "qi_target": cfg["qi_target"],
        "attribution": attributions,
        "rl": _rl_summary(rl_runs, cfg["rl"]) if rl_runs else None,
        "wall_s_this_session": time.perf_counter() - t0,
    }
    files = ["mismatch.json", "report.md", "pairs.jsonl", "attribution.jsonl", "params.npz",
             "train.json", *(["rl.jsonl"] if rl_runs else [])]  # fmt: skip
    if cfg["plots"]:
        files += mismatch_report.plots(summary, out_dir)
    summary["files"] = files
    _io.write_text(out_dir / "report.md", mismatch_report.markdown(summary, cfg["qi_target"]))
    _io.write_json(out_dir / "mismatch.json", summary)
    return summary


def _num(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: (_io.from_json_float(v) if isinstance(v, str) and k.endswith(("nats", "share",
            "rate", "kl")) else v) for k, v in row.items()}  # fmt: skip


def _rl(rl: dict[str, Any], out_dir: Path, say: Callable[[str], None]) -> list[dict[str, Any]]:
    """The REINFORCE runs (read back from ``rl.jsonl`` where finished)."""
    if not rl["enabled"]:
        return []

    cfg = RLConfig(**{k: rl[k] for k in _RL_CONFIG})
    done = {(r["format"], r["sampler"], r["seed"]): r
            for r in _io.read_jsonl(out_dir / "rl.jsonl")}  # fmt: skip
    runs = []
    with _io.JsonlWriter(out_dir / "rl.jsonl") as f:
        for fmt in rl["formats"]:
            for sampler in rl["samplers"]:
                seeds = tuple(range(rl["seeds"]))
                todo = tuple(s for s in seeds if (fmt, sampler, s) not in done)
                new = reinforce(fmt, sampler, cfg, seeds=todo) if todo else []
                for r in new:
                    f.write(_io.to_jsonable(r))
                    done[(fmt, sampler, r["seed"])] = r
                for s in seeds:
                    runs.append(done[(fmt, sampler, s)])
                if new:
                    say(f"mismatch: REINFORCE {fmt} {sampler}: final reward "
                        + ", ".join(f"{r['final_reward']:.3f}" for r in new))  # fmt: skip
    return runs


def _rl_summary(runs: list[dict[str, Any]], rl: dict[str, Any]) -> dict[str, Any]:
    """Per format and sampler: the mean over seeds of each run's final reward and of its
    per-step means (mismatch RMS and max, clip share, TIS change, noise); the runs' rewards."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["format"], r["sampler"]), []).append(r)
    rows = []
    for (fmt, sampler), rs in groups.items():
        row = {"format": fmt, "sampler": sampler, "seeds": len(rs),
               "final_reward": [r["final_reward"] for r in rs]}  # fmt: skip
        for k in ("mismatch_rms", "mismatch_max", "clip_share", "tis_change", "noise"):
            row[k] = float(np.mean([np.mean(r[k]) for r in rs]))
        row["mismatch_max"] = float(max(max(r["mismatch_max"]) for r in rs))
        row["reward"] = [r["reward"] for r in rs]
        rows.append(row)
    return {"config": {k: rl[k] for k in _RL_CONFIG}, "groups": rows}


def _ratios(rows: list[dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    """Per setup: bf16's RMS gap over fp16's, against ``qi_target``."""
    out = {}
    for setup in cfg["setups"]:
        by = {r["format"]: r for r in rows if r["setup"] == setup}
        if "bf16" in by and "fp16" in by:
            b, f = by["bf16"]["rms_nats"], by["fp16"]["rms_nats"]
            ratio = b / f if f else math.inf
            out[setup] = {
                "bf16_rms_nats": b,
                "fp16_rms_nats": f,
                "ratio": ratio if math.isfinite(ratio) else None,
                "target": cfg["qi_target"],
                "reproduced": bool(ratio >= cfg["qi_target"]),
            }
    return out
