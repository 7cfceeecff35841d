"""The tournament's results: ``tournament.json``, ``report.md`` and plots, from the units' files.

Per variant (a recipe on one format): the final evaluation loss per seed, its gap to the
baseline paired by seed (same initialisation and data order: ``gap = mean_s (L_v(s) -
L_base(s))``), a 95% confidence interval over seeds (Student's t on the paired differences),
``tokens_to_match`` (the tokens at which the seed-averaged evaluation curve first reaches the
target loss: the baseline's seed-averaged loss at ``match_fraction`` of training, linearly
interpolated between evaluations; None if never) and the gradient statistics per GEMM at each
measured step (:mod:`precisionlab.train.gemm_stats`, over all matmuls, averaged over seeds).
The ranking orders variants by gap; a difference is significant when its 95% interval excludes
0 (against the baseline, and between neighbours in the ranking, paired by seed).

The claims of the published papers that the tournament checks (:func:`claims`): NVFP4's gap
below MXFP4's for the same recipe (NVIDIA sec. 5), MS-EDEN at most half of stochastic
rounding's error (Quartet II), stochastic rounding unbiased where round-to-nearest is biased,
the random Hadamard transform lowering stochastic rounding's variance on blocks with outliers
(Tseng et al.), and the sqrt(3) crossing of the weight gradient's norm-to-noise ratio (Chmiel et
al.); each is reported as reproduced or not, with the numbers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from precisionlab import _io
from precisionlab.experiments import _store as store
from precisionlab.quant import fp4
from precisionlab.train.gemm_stats import GEMMS, SQRT3

__all__ = [
    "T975",
    "ci95",
    "claims",
    "claims_markdown",
    "quantizer_claims",
    "ranking_markdown",
    "report_markdown",
    "stats_markdown",
    "status_markdown",
    "summarize",
    "write",
]

#: Student's t 97.5% quantiles for 1..30 degrees of freedom (two-sided 95% intervals).
T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
    2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
    2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def ci95(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """(mean, low, high) of a 95% Student-t interval of the mean; (mean, None, None) below 2
    values."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], np.float64)
    if v.size == 0:
        return None, None, None
    m = float(v.mean())
    if v.size < 2:
        return m, None, None
    t = T975[min(v.size - 1, len(T975)) - 1] if v.size - 1 <= len(T975) else 1.96
    h = t * float(v.std(ddof=1)) / math.sqrt(v.size)
    return m, m - h, m + h


# --- reading the units ------------------------------------------------------------------------
def _units(units: list, out_dir: Path) -> dict[str, dict]:
    found = {}
    for u in units:
        d = out_dir / "units" / u.id
        if not (d / "result.json").exists():
            continue
        found[u.id] = {
            "unit": u,
            "result": store.read_json(d / "result.json"),
            "evals": store.read_jsonl(d / "evals.jsonl") if (d / "evals.jsonl").exists() else [],
            "stats": store.read_jsonl(d / "stats.jsonl") if (d / "stats.jsonl").exists() else [],
        }
    return found


def _curve(runs: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The seed-averaged evaluation curve (tokens, loss) over the evaluations every run has."""
    if not runs:
        return np.zeros(0), np.zeros(0)
    common = set.intersection(*({e["tokens"] for e in r["evals"]} for r in runs))
    tokens = np.array(sorted(common), np.float64)
    by = [{e["tokens"]: e["eval_loss"] for e in r["evals"]} for r in runs]
    loss = np.array([np.mean([b[t] for b in by]) for t in tokens], np.float64)
    return tokens, loss


def _tokens_at(tokens: np.ndarray, loss: np.ndarray, target: float) -> float | None:
    """The first tokens at which ``loss`` reaches ``target`` (linear interpolation)."""
    for i in range(len(tokens)):
        if loss[i] <= target:
            if i == 0:
                return float(tokens[0])
            t0, t1, l0, l1 = tokens[i - 1], tokens[i], loss[i - 1], loss[i]
            return float(t0 + (t1 - t0) * (l0 - target) / (l0 - l1))
    return None


def _loss_at(tokens: np.ndarray, loss: np.ndarray, at: float) -> float | None:
    if len(tokens) == 0 or at < tokens[0] or at > tokens[-1]:
        return None
    return float(np.interp(at, tokens, loss))


def _real(x: Any) -> float | None:
    """A statistic as read back from JSON: a number, or None for a missing or non-finite one
    (strict JSON writes inf and NaN as the strings "inf", "-inf", "nan")."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else None


def _stats(runs: list[dict]) -> dict[str, Any]:
    """Per GEMM, per measured step: the seed means of the all-matmul statistics; and the
    first step at which the wgrad ratio falls below sqrt(3) (seed mean, and per seed)."""
    rows = [r for run in runs for r in run["stats"] if r["site"] == "all"]
    if not rows:
        return {}
    steps = sorted({r["step"] for r in rows})
    out: dict[str, Any] = {"steps": steps}
    for gemm in GEMMS:
        per = {}
        for key in ("rel_bias", "rel_var", "cosine", "ratio"):
            vals = []
            for s in steps:
                got = [_real(r[key]) for r in rows if r["step"] == s and r["gemm"] == gemm]
                v = [x for x in got if x is not None]
                vals.append(float(np.mean(v)) if v else None)
            per[key] = vals
        out[gemm] = per
    ratio = out["wgrad"]["ratio"]
    cross = [s for s, r in zip(steps, ratio, strict=True) if r is not None and r < SQRT3]
    out["sqrt3_crossing_step"] = cross[0] if cross else None
    seeds = {}
    for run in runs:
        w = [r for r in run["stats"] if r["site"] == "all" and r["gemm"] == "wgrad"]
        c = [r["step"] for r in w if (q := _real(r["ratio"])) is not None and q < SQRT3]
        seeds[str(run["unit"].seed)] = c[0] if c else None
    out["sqrt3_crossing_step_per_seed"] = seeds
    return out


def summarize(
    section: dict, units: list, out_dir: Path, *, measure_quantizers: bool = True
) -> dict[str, Any]:
    """The tournament's summary (the content of ``tournament.json``); ``measure_quantizers``:
    also measure the quantizer-level claims (:func:`quantizer_claims`, a minute of CPU)."""
    found = _units(units, Path(out_dir))
    variants: dict[str, list] = {}
    for u in units:
        variants.setdefault(u.variant, [])
        if u.id in found:
            variants[u.variant].append(found[u.id])
    base = variants.get(section["baseline"], [])
    base_loss = {r["unit"].seed: r["result"]["final_eval_loss"] for r in base}
    bt, bl = _curve(base)
    total = max((r["result"]["tokens"] for rs in variants.values() for r in rs), default=0)
    target = _loss_at(bt, bl, section["match_fraction"] * total) if total else None
    base_tokens = None if target is None else _tokens_at(bt, bl, target)
    out_variants = {}
    for name, runs in variants.items():
        losses = {r["unit"].seed: r["result"]["final_eval_loss"] for r in runs}
        diffs = [losses[s] - base_loss[s] for s in losses if s in base_loss
                 and losses[s] is not None and base_loss[s] is not None]  # fmt: skip
        gap, lo, hi = ci95(diffs)
        t, lcurve = _curve(runs)
        ttm = None if target is None else _tokens_at(t, lcurve, target)
        first = runs[0]["unit"] if runs else None
        out_variants[name] = {
            "recipe": first.entry["name"] if first else None,
            "format": first.fmt if first else None,
            "seeds": sorted(losses),
            "final_eval_loss": {str(s): v for s, v in sorted(losses.items())},
            "gap_nats": gap,
            "ci95_low": lo,
            "ci95_high": hi,
            "significant": None if lo is None or hi is None else bool(lo > 0 or hi < 0),
            "tokens_to_match": ttm,
            "tokens_to_match_vs_baseline": (
                None if ttm is None or not base_tokens else ttm / base_tokens
            ),
            "diverged": [r["unit"].seed for r in runs if r["result"].get("diverged")],
            "wall_s": sum(r["result"]["wall_s"] for r in runs),
            "cpu_s": sum(r["result"]["cpu_s"] for r in runs),
            "gemm_stats": _stats(runs),
            "curve": {"tokens": t.tolist(), "eval_loss": lcurve.tolist()},
        }
    ranking = _ranking(out_variants, variants, section["baseline"])
    params = next((r["result"]["params"] for rs in variants.values() for r in rs), None)
    return {
        "baseline": section["baseline"],
        "seeds": section["seeds"],
        "units_done": len(found),
        "units_total": len(units),
        "params": params,
        "tokens_per_run": total,
        "tokens_per_param": (total / params) if params else None,
        "match_loss": target,
        "match_fraction": section["match_fraction"],
        "baseline_tokens_to_match": base_tokens,
        "wall_s": sum(v["wall_s"] for v in out_variants.values()),
        "cpu_s": sum(v["cpu_s"] for v in out_variants.values()),
        "variants": out_variants,
        "ranking": ranking,
        "claims": claims(out_variants, variants, section["baseline"], measure_quantizers),
    }


def _paired(a: list[dict], b: list[dict]) -> tuple[float | None, float | None, float | None]:
    la = {r["unit"].seed: r["result"]["final_eval_loss"] for r in a}
    lb = {r["unit"].seed: r["result"]["final_eval_loss"] for r in b}
    d = [la[s] - lb[s] for s in la if s in lb and la[s] is not None and lb[s] is not None]
    return ci95(d)


def _ranking(out: dict, runs: dict, baseline: str) -> list[dict[str, Any]]:
    names = [n for n in out if out[n]["gap_nats"] is not None or n == baseline]
    names.sort(key=lambda n: 0.0 if n == baseline else out[n]["gap_nats"])
    rows = []
    for i, n in enumerate(names):
        lo, hi = out[n]["ci95_low"], out[n]["ci95_high"]
        row = {
            "rank": i + 1,
            "variant": n,
            "gap_nats": out[n]["gap_nats"] or 0.0,
            "ci95_low": None if n == baseline else lo,
            "ci95_high": None if n == baseline else hi,
            "vs_baseline": "baseline" if n == baseline else _sig(lo, hi),
        }
        if i + 1 < len(names):
            m, lo, hi = _paired(runs[names[i + 1]], runs[n])
            row["vs_next"] = {"next": names[i + 1], "diff": m, "ci95_low": lo, "ci95_high": hi,
                              "significant": _sig(lo, hi) == "significant"}  # fmt: skip
        rows.append(row)
    return rows


def _direction(m: float | None, lo: float | None, hi: float | None) -> str:
    """A claimed negative difference: reproduced (significant), in its direction but within
    the noise, not reproduced, or contradicted (significantly positive)."""
    if m is None:
        return "not measured"
    sig = lo is not None and hi is not None and (lo > 0 or hi < 0)
    if m < 0:
        return "reproduced" if sig else "same direction, not significant"
    return "contradicted" if sig else "not reproduced"


def _sig(lo: float | None, hi: float | None) -> str:
    if lo is None or hi is None:
        return "n/a"
    return "significant" if (lo > 0 or hi < 0) else "not significant"


# --- claims -----------------------------------------------------------------------------------
def claims(out: dict, runs: dict, baseline: str, quantizers: bool = True) -> dict[str, Any]:
    """The papers' claims, from the runs and (``quantizers``) :func:`quantizer_claims`."""
    pairs = []
    recipes = {v["recipe"] for v in out.values()}
    for r in sorted(x for x in recipes if x):
        nv, mx = f"{r}-nvfp4", f"{r}-mxfp4"
        if nv in runs and mx in runs and runs[nv] and runs[mx]:
            m, lo, hi = _paired(runs[nv], runs[mx])
            pairs.append({
                "recipe": r, "gap_nvfp4": out[nv]["gap_nats"], "gap_mxfp4": out[mx]["gap_nats"],
                "nvfp4_minus_mxfp4": m, "ci95_low": lo, "ci95_high": hi,
                "reproduced": None if m is None else bool(m < 0),
                "significant": _sig(lo, hi) == "significant",
                "verdict": _direction(m, lo, hi),
            })  # fmt: skip
    crossings = {n: v["gemm_stats"].get("sqrt3_crossing_step") for n, v in out.items()
                 if v["gemm_stats"]}  # fmt: skip
    final_ratio = {
        n: (v["gemm_stats"]["wgrad"]["ratio"][-1] if v["gemm_stats"] else None)
        for n, v in out.items()
        if v["gemm_stats"]
    }
    return {
        "nvfp4_gap_below_mxfp4": {
            "source": "NVIDIA, arXiv 2509.25149 sec. 5 (MXFP4 needs more tokens than NVFP4)",
            "pairs": pairs,
            "reproduced": (all(p["verdict"] == "reproduced" for p in pairs) if pairs else None),
        },
        "sqrt3_crossing": {
            "source": "Chmiel et al., arXiv 2505.19115 sec. 5",
            "crossing_step": crossings,
            "final_wgrad_ratio": final_ratio,
            "observed": any(s is not None for s in crossings.values()) if crossings else None,
        },
        "quantizers": quantizer_claims() if quantizers else None,
    }


def quantizer_claims(seed: int = 0, rows: int = 256, cols: int = 1024, draws: int = 64) -> dict:
    """The quantizer-level claims measured on synthetic blocks (Gaussian and Student-t with 3
    degrees of freedom, ``rows x cols``, ``seed``), in float32 with the library's quantizers:

    - ``ms_eden_vs_sr``: relative MSE ``E||Q(x) - x||^2 / ||x||^2`` of MS-EDEN (rotation 128,
      un-rotated back) and of NVFP4 stochastic rounding (target 6 * 16/17 so it never clips), on
      the same rotated data and on the raw data; reproduced when MS-EDEN <= SR / 2;
    - ``sr_unbiased``: the relative bias ``||E[Q(x)] - x|| / ||x||`` of NVFP4 stochastic
      rounding over ``draws`` draws (estimated without the variance's share) against that of
      round-to-nearest (deterministic: its error);
    - ``hadamard_lowers_sr_variance``: MXFP4 stochastic rounding (3/4 pre-scale) variance on
      blocks with one outlier per 32 (x100), without and with a 64-point random Hadamard
      transform.
    """
    rng = np.random.default_rng(seed)
    data = {
        "gaussian": rng.standard_normal((rows, cols)).astype(np.float32),
        "student_t3": rng.standard_t(3, (rows, cols)).astype(np.float32),
    }
    key = jax.random.PRNGKey(seed)
    out: dict[str, Any] = {}

    eden = {}
    for name, x_np in data.items():
        xj = jnp.asarray(x_np)
        signs = fp4.random_signs(jax.random.fold_in(key, 7), 128)
        xr = fp4.rotate(xj, signs)
        e, sr_rot, sr_raw = [], [], []
        for i in range(8):
            k = jax.random.fold_in(key, 100 + i)
            q = fp4.rotate(fp4.ms_eden(xr, k, group=128).values(), signs, inverse=True)
            e.append(float(jnp.sum((q - xj) ** 2) / jnp.sum(xj**2)))
            s = fp4.nvfp4(xr, rounding="stochastic", key=k, val_max=6.0 * 16 / 17)
            sr_rot.append(float(jnp.sum((s.values() - xr) ** 2) / jnp.sum(xr**2)))
            s = fp4.nvfp4(xj, rounding="stochastic", key=k, val_max=6.0 * 16 / 17)
            sr_raw.append(float(jnp.sum((s.values() - xj) ** 2) / jnp.sum(xj**2)))
        me, ms, mr = float(np.mean(e)), float(np.mean(sr_rot)), float(np.mean(sr_raw))
        eden[name] = {"ms_eden_mse": me, "sr_mse_rotated": ms, "sr_mse_raw": mr,
                      "ratio_rotated": me / ms, "ratio_raw": me / mr,
                      "reproduced": bool(me <= ms / 2)}  # fmt: skip
    out["ms_eden_vs_sr"] = {
        "source": "Quartet II, arXiv 2601.22813 (abstract: more than 2x lower error than SR)",
        "blocks": eden,
        "reproduced": all(v["reproduced"] for v in eden.values()),
    }

    x = jnp.asarray(data["gaussian"][:64])
    acc = jnp.zeros_like(x)
    sq = 0.0
    for i in range(draws):
        q = fp4.nvfp4(x, rounding="stochastic", key=jax.random.fold_in(key, 1000 + i),
                      val_max=6.0 * 16 / 17).values()  # fmt: skip
        acc = acc + q
        sq += float(jnp.sum((q - x) ** 2))
    mean = acc / draws
    xx = float(jnp.sum(x**2))
    var_total = sq / draws - float(jnp.sum((mean - x) ** 2))  # per-draw variance, summed
    b2 = float(jnp.sum((mean - x) ** 2)) - var_total / (draws - 1)
    rtn = fp4.nvfp4(x).values()
    out["sr_unbiased"] = {
        "source": "stochastic rounding (every SR recipe); RTN's deterministic error",
        "draws": draws,
        "sr_rel_bias": math.copysign(math.sqrt(abs(b2) / xx), b2),
        "sr_rel_std_of_mean": math.sqrt(max(var_total, 0.0) / draws / xx),
        "rtn_rel_bias": math.sqrt(float(jnp.sum((rtn - x) ** 2)) / xx),
    }
    sr = out["sr_unbiased"]
    sr["reproduced"] = bool(abs(sr["sr_rel_bias"]) < 3 * sr["sr_rel_std_of_mean"]
                            and sr["rtn_rel_bias"] > 3 * sr["sr_rel_std_of_mean"])  # fmt: skip

    g = data["gaussian"][:64].copy()
    g[:, ::32] *= 100.0  # one outlier per block of 32
    gj = jnp.asarray(g)
    signs = fp4.random_signs(jax.random.fold_in(key, 11), 64)
    plain, rot = [], []
    for i in range(16):
        k = jax.random.fold_in(key, 2000 + i)
        q = fp4.mxfp4(gj, rounding="stochastic", key=k, prescale=True).values()
        plain.append(float(jnp.sum((q - gj) ** 2) / jnp.sum(gj**2)))
        gr = fp4.rotate(gj, signs)
        qr = fp4.rotate(fp4.mxfp4(gr, rounding="stochastic", key=k, prescale=True).values(),
                        signs, inverse=True)  # fmt: skip
        rot.append(float(jnp.sum((qr - gj) ** 2) / jnp.sum(gj**2)))
    out["hadamard_lowers_sr_variance"] = {
        "source": "Tseng, Yu and Park, arXiv 2502.20586 sec. 3.2",
        "sr_var_plain": float(np.mean(plain)),
        "sr_var_hadamard64": float(np.mean(rot)),
        "reproduced": bool(np.mean(rot) < np.mean(plain)),
    }
    return out


# --- writing ----------------------------------------------------------------------------------
def write(section: dict, units: list, out_dir: Path, *, plots: bool = True) -> dict[str, Any]:
    """Write ``tournament.json``, ``report.md`` and (``plots``) the PNGs; returns the summary."""
    out_dir = Path(out_dir)
    summary = summarize(section, units, out_dir)
    store.write_json(out_dir / "tournament.json", summary)
    store.write_text(out_dir / "report.md", report_markdown(summary))
    if plots and summary["units_done"]:
        plot(summary, out_dir)
    return {k: summary[k] for k in ("units_done", "units_total", "wall_s", "cpu_s")}


def _f(v: Any, fmt: str = ".3f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return format(v, fmt)


def report_markdown(s: dict[str, Any]) -> str:
    """The ranking table, the gradient statistics and the claims' verdicts, in Markdown."""
    lines = [
        "# FP4 recipe tournament",
        "",
        status_markdown(s),
        "",
        ranking_markdown(s),
        "",
        "## Gradient statistics (all matmuls, seed mean, last measured step)",
        "",
        stats_markdown(s),
        "",
        "## The papers' claims at this scale",
        "",
        claims_markdown(s),
    ]
    return "\n".join(lines) + "\n"


def status_markdown(s: dict[str, Any]) -> str:
    """One paragraph: the runs finished, the model's size and tokens, and the time spent (the
    sum over the finished runs of their wall and CPU seconds)."""
    missing = sorted(n for n, v in s["variants"].items() if len(v["seeds"]) < len(s["seeds"]))
    text = (
        f"{s['units_done']} of {s['units_total']} runs finished; {s['params']} parameters, "
        f"{_f(s['tokens_per_run'], ',.0f')} tokens per run ({_f(s['tokens_per_param'], '.1f')} "
        f"per parameter); {_f(s['wall_s'] / 3600 if s['wall_s'] else None, '.2f')} hours of "
        f"wall time and {_f(s['cpu_s'] / 3600 if s['cpu_s'] else None, '.2f')} hours of CPU "
        "time over the finished runs."
    )
    if missing:
        text += " Variants with fewer seeds than planned: " + ", ".join(missing) + "."
    return text


def ranking_markdown(s: dict[str, Any]) -> str:
    """The ranking table (gap, interval, significance, tokens to match) with its legend."""
    lines = [
        f"Gap: final evaluation loss minus the baseline's ({s['baseline']}), paired by seed, "
        "in nats, with a 95% Student-t interval over seeds. Tokens to match: tokens until the "
        f"seed-mean evaluation loss reaches {_f(s['match_loss'])} (the baseline's at "
        f"{s['match_fraction']:.0%} of training).",
        "",
        "| rank | variant | gap (nats) | 95% CI | vs baseline | vs next | tokens to match |",
        "|---:|---|---:|---|---|---|---:|",
    ]
    for r in s["ranking"]:
        v = s["variants"][r["variant"]]
        nxt = r.get("vs_next")
        nxt_s = (
            "-"
            if not nxt
            else (
                f"{'significant' if nxt['significant'] else 'not significant'} "
                f"({_f(nxt['diff'], '+.3f')})"
            )
        )
        ttm = v["tokens_to_match"]
        ttm_s = (
            "not reached"
            if ttm is None
            else (f"{_tokens(ttm)} (x{_f(v['tokens_to_match_vs_baseline'], '.2f')})")
        )
        ci = "-" if r["ci95_low"] is None else f"[{r['ci95_low']:+.3f}, {r['ci95_high']:+.3f}]"
        lines.append(
            f"| {r['rank']} | {r['variant']} | {r['gap_nats']:+.3f} | {ci} | {r['vs_baseline']} "
            f"| {nxt_s} | {ttm_s} |"
        )
    return "\n".join(lines)


def stats_markdown(s: dict[str, Any]) -> str:
    """Per variant and GEMM: relative bias, variance, cosine and norm-to-noise ratio at the
    last measured step (seed means over all matmuls)."""
    lines = [
        "| variant | GEMM | rel. bias | rel. variance | cosine | norm/noise |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, v in s["variants"].items():
        st = v["gemm_stats"]
        if not st:
            continue
        for gemm in GEMMS:
            g = st[gemm]
            lines.append(
                f"| {name} | {gemm} | {_f(g['rel_bias'][-1], '+.4f')} | "
                f"{_f(g['rel_var'][-1], '.2e')} | {_f(g['cosine'][-1], '.4f')} | "
                f"{_f(g['ratio'][-1], '.2f')} |"
            )
    return "\n".join(lines)


def claims_markdown(s: dict[str, Any]) -> str:
    """Each claim of the papers: reproduced or not, with the numbers."""
    c = s["claims"]
    lines = []
    p = c["nvfp4_gap_below_mxfp4"]
    verdicts = sorted({q["verdict"] for q in p["pairs"]})
    n_reproduced = sum(q["verdict"] == "reproduced" for q in p["pairs"])
    if p["reproduced"] is not False:
        overall = _verdict(p["reproduced"])
    elif n_reproduced:  # some recipes significantly, the others not: say so, not a list
        overall = "partly reproduced"
    else:
        overall = ", ".join(verdicts)
    lines.append(
        f"- **NVFP4's gap below MXFP4's for the same recipe** ({p['source']}): {overall} "
        f"({sum(q['verdict'] == 'reproduced' for q in p['pairs'])} of {len(p['pairs'])} "
        "recipes significantly)."
    )
    for q in p["pairs"]:
        lines.append(
            f"  - {q['recipe']}: NVFP4 {_f(q['gap_nvfp4'], '+.3f')}, MXFP4 "
            f"{_f(q['gap_mxfp4'], '+.3f')} nats; difference {_f(q['nvfp4_minus_mxfp4'], '+.3f')} "
            f"[{_f(q['ci95_low'], '+.3f')}, {_f(q['ci95_high'], '+.3f')}]: {q['verdict']}"
        )
    qz = c["quantizers"]
    if qz is None:
        lines.append("- The quantizer-level claims (MS-EDEN, SR, Hadamard): not measured.")
        qz = {}
    else:
        lines.extend(_quantizer_lines(qz))
    sq = c["sqrt3_crossing"]
    crossed = {k: v for k, v in sq["crossing_step"].items() if v is not None}
    lines.append(
        f"- **The sqrt(3) crossing of the weight gradient's norm-to-noise ratio** "
        f"({sq['source']}): {'observed' if crossed else 'not observed'} at this scale"
        + (f" (first step: {crossed})" if crossed else "")
        + "; final ratios: "
        + ", ".join(f"{k} {_f(v, '.2f')}" for k, v in sq["final_wgrad_ratio"].items())
        + "."
    )
    return "\n".join(lines)


def _quantizer_lines(qz: dict[str, Any]) -> list[str]:
    lines = []
    e = qz["ms_eden_vs_sr"]
    lines.append(
        f"- **MS-EDEN's error at most half of stochastic rounding's** ({e['source']}): "
        f"{_verdict(e['reproduced'])}."
    )
    for name, b in e["blocks"].items():
        lines.append(
            f"  - {name} blocks: MS-EDEN {b['ms_eden_mse']:.4f}, SR {b['sr_mse_rotated']:.4f} "
            f"(same rotation; ratio {b['ratio_rotated']:.2f}), SR without rotation "
            f"{b['sr_mse_raw']:.4f} (ratio {b['ratio_raw']:.2f})"
        )
    u = qz["sr_unbiased"]
    lines.append(
        f"- **Stochastic rounding unbiased where round-to-nearest is biased**: "
        f"{_verdict(u['reproduced'])}: relative bias of NVFP4 SR {u['sr_rel_bias']:+.5f} "
        f"(standard error {u['sr_rel_std_of_mean']:.5f}, {u['draws']} draws) vs RTN "
        f"{u['rtn_rel_bias']:.4f}."
    )
    h = qz["hadamard_lowers_sr_variance"]
    lines.append(
        f"- **The Hadamard transform lowers SR variance on blocks with outliers** "
        f"({h['source']}): {_verdict(h['reproduced'])}: relative variance "
        f"{h['sr_var_plain']:.4f} without, {h['sr_var_hadamard64']:.4f} with."
    )
    return lines


def _tokens(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def _verdict(ok: bool | None) -> str:
    return "not measured" if ok is None else ("reproduced" if ok else "NOT reproduced")


def plot(s: dict[str, Any], out_dir: Path) -> list[Path]:
    """``loss_curves.png``, ``gaps.png`` and ``gemm_stats.png`` in ``out_dir``."""
    from matplotlib.figure import Figure

    out_dir = Path(out_dir)
    paths = []
    # page-wide figures (7.5 in at 110 dpi: 825 px), text of 9 points or more: readable on the site
    fig = Figure(figsize=(7.5, 5))
    ax = fig.add_subplot(1, 1, 1)
    for name, v in s["variants"].items():
        t, loss = v["curve"]["tokens"], v["curve"]["eval_loss"]
        if t:
            style = "-" if (v["format"] or "") != "mxfp4" else "--"
            ax.plot(np.asarray(t) / 1e6, loss, style, label=name, lw=2 if name == s["baseline"]
                    else 1)  # fmt: skip
    if s["match_loss"] is not None:
        ax.axhline(s["match_loss"], color="0.5", lw=0.5)
    ax.set_xlabel("tokens (millions)")
    ax.set_ylabel("evaluation loss (nats, seed mean)")
    ax.legend(fontsize=9, ncol=2)
    ax.set_title("Evaluation loss")
    fig.tight_layout()
    _io.save_figure(fig, out_dir / "loss_curves.png", dpi=110)
    paths.append(out_dir / "loss_curves.png")

    rows = [r for r in s["ranking"] if r["variant"] != s["baseline"]]
    if rows:
        fig = Figure(figsize=(7.5, 0.3 * len(rows) + 1.2))
        ax = fig.add_subplot(1, 1, 1)
        y = np.arange(len(rows))[::-1]
        gap = [r["gap_nats"] for r in rows]
        err = [[(r["gap_nats"] - r["ci95_low"]) if r["ci95_low"] is not None else 0 for r in rows],
               [(r["ci95_high"] - r["gap_nats"]) if r["ci95_high"] is not None else 0
                for r in rows]]  # fmt: skip
        ax.errorbar(gap, y, xerr=err, fmt="o", capsize=3)
        ax.axvline(0, color="0.5", lw=0.5)
        ax.set_yticks(y, [r["variant"] for r in rows], fontsize=9)
        ax.set_xlabel(f"gap to {s['baseline']} (nats, 95% CI)")
        fig.subplots_adjust(left=0.3, bottom=0.7 / (0.3 * len(rows) + 1.2))
        _io.save_figure(fig, out_dir / "gaps.png", dpi=110)
        paths.append(out_dir / "gaps.png")

    with_stats = {n: v for n, v in s["variants"].items() if v["gemm_stats"]}
    if with_stats:
        legend_in = 0.22 * math.ceil(len(with_stats) / 3) + 0.3
        fig = Figure(figsize=(7.5, 3 * 2.4 + legend_in))
        for j, (gemm, key, label) in enumerate(
            (("wgrad", "ratio", "wgrad norm / noise"), ("dgrad", "cosine", "dgrad cosine"),
             ("fprop", "cosine", "fprop cosine"))
        ):  # fmt: skip
            ax = fig.add_subplot(3, 1, j + 1)
            for name, v in with_stats.items():
                st = v["gemm_stats"]
                vals = [np.nan if x is None else x for x in st[gemm][key]]
                ax.plot(st["steps"], vals, label=name, lw=1)
            if key == "ratio":
                ax.axhline(SQRT3, color="k", lw=0.8, ls=":")
                ax.set_yscale("log")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("step")
        handles, labels = fig.axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncols=3, fontsize=9, frameon=False)
        fig.tight_layout(rect=(0, legend_in / (3 * 2.4 + legend_in), 1, 1))
        _io.save_figure(fig, out_dir / "gemm_stats.png", dpi=110)
        paths.append(out_dir / "gemm_stats.png")
    return paths
