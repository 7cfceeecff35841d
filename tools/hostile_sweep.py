"""Hostile-input sweep of the command line (a tool, not a test: pytest does not collect it).

Runs ``python -m precisionlab ARGS`` for each case in a subprocess in a scratch directory with
a time limit, and flags what breaks the project's rule for bad input (one line
``precisionlab CMD: error: ...`` on stderr, exit status 2, no traceback, no hang):

    python tools/hostile_sweep.py              # every case (minutes: each one starts Python)
    python tools/hostile_sweep.py -k diagnose  # the cases whose name contains a word
    python tools/hostile_sweep.py --list

A case that is valid input (expected status 0) is marked so; everything else must exit 2.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 30
MEMORY_LIMIT = 8 << 30  # address space per case: a runaway read fails here, not the machine


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


TINY = """
kind = "train"
name = "tiny"
seeds = [0]
[train]
model = "mlp"
steps = 2
batch_size = 8
eval_batches = 1
model_kwargs = {{ width = 8, depth = 2 }}
{extra}
[diagnose]
threshold = 0.1
{diag}
[[variant]]
name = "a"
policy = "f32"
[[variant]]
name = "b"
policy = "p=f32,c=f16"
[[variant]]
name = "r"
policy = "p=f32,c=bf16"
recipe = "current"
"""


def tiny(extra: str = "", diag: str = "") -> str:
    return TINY.format(extra=extra, diag=diag)


def _files(work: Path) -> None:
    """The files the cases name, in the scratch directory."""
    (work / "tiny.toml").write_text(tiny())
    (work / "adir.toml").mkdir(exist_ok=True)
    (work / "binary.toml").write_bytes(bytes(range(256)) * 64)
    (work / "badtoml.toml").write_text('kind = "train"\n[train\nsteps = 2\n')
    (work / "huge.toml").write_text(tiny() + "# " + "x" * (64 << 20) + "\n")
    (work / "types.toml").write_text(tiny().replace("steps = 2", 'steps = "two"'))
    (work / "unknown.toml").write_text(tiny(extra="bogus_key = 1"))
    (work / "survey.toml").write_text(
        'kind = "survey"\nname = "s"\n[survey]\nformats = ["int8"]\ndists = ["normal"]\n'
    )
    (work / "afile").write_text("x")
    (work / "oldrun").mkdir(exist_ok=True)  # another run's files, its config.json gone
    (work / "oldrun" / "run.json").write_text('{"status": "finished"}')
    (work / "memory_seq0.toml").write_text('kind = "memory"\nname = "m"\n[memory]\nseq = 0\n')
    (work / "raises.py").write_text(
        "import jax.numpy as jnp\n\ndef model(x):\n    raise RuntimeError('broken')\n\n"
        "def inputs():\n    return (jnp.ones(2),)\n"
    )
    (work / "utf16.toml").write_bytes(tiny().encode("utf-16"))
    for key, value in DIAG_TABLE.items():
        (work / f"diag_{key}.toml").write_text(tiny(diag=value))
    for name, (base, old, new) in MUTATED.items():
        text = (ROOT / "experiments" / base).read_text()
        assert old in text, (base, old)
        (work / f"mut_{name}.toml").write_text(text.replace(old, new, 1))


#: Bad values of the ``[diagnose]`` table of a file.
DIAG_TABLE = {
    "nan": "tolerance = nan",
    "neg": "tail = -1",
    "huge": "tail = 1000000000000000000",
    "type": 'underflow = "x"',
    "unknown": "bogus = 1",
    "inf": "mse = inf",
    "bool": "tail = true",
}

#: experiments/*.toml with one value made hostile: name -> (file, text, replacement).
MUTATED = {
    "ckpt_repeats_huge": ("checkpointing.toml", "repeats = 5", "repeats = 1000000000000000000"),
    "ckpt_repeats_zero": ("checkpointing.toml", "repeats = 5", "repeats = 0"),
    "ckpt_remat_neg": ("checkpointing.toml", "remat_every = [1, 2,", "remat_every = [-1, 2,"),
    "ckpt_remat_huge": ("checkpointing.toml", "remat_every = [1, 2,", "remat_every = [99999, 2,"),
    "ckpt_micro_zero": ("checkpointing.toml", "microbatches = [1, 2,", "microbatches = [0, 2,"),
    "ckpt_policy": (
        "checkpointing.toml", 'remat_policy = "nothing_saveable"', 'remat_policy = "x"'
    ),
    "ckpt_depth_huge": ("checkpointing.toml", "depth = 32,", "depth = 100000000,"),
    "ckpt_batch_huge": ("checkpointing.toml", "batch_size = 2048", "batch_size = 1000000000000"),
    "ckpt_plots": ("checkpointing.toml", "plots = true", 'plots = "yes"'),
    "ckpt_models_empty": ("checkpointing.toml", "[checkpointing.models.mlp]", "[x]"),
    "fp8_history_neg": ("fp8_recipes.toml", "amax_history_len = 16", "amax_history_len = -1"),
    "fp8_history_huge": (
        "fp8_recipes.toml", "amax_history_len = 16", "amax_history_len = 1000000000000"
    ),
    "fp8_acc_bits": ("fp8_recipes.toml", "accumulate_bits = 14", "accumulate_bits = 99"),
    "fp8_acc_round": ("fp8_recipes.toml", 'accumulate_rounding = "toward_zero"',
                      'accumulate_rounding = "x"'),
    "fp8_scale_rule": ("fp8_recipes.toml", 'scale_rule = "rceil"', 'scale_rule = "nope"'),
    "fp8_hadamard": ("fp8_recipes.toml", "hadamard = true", 'hadamard = "yes"'),
    "fp8_recipe_name": ("fp8_recipes.toml", '{ name = "current"', '{ name = "nope"'),
    "fp8_recipe_type": ("fp8_recipes.toml", '{ name = "current"', '{ name = 3'),
    # the file no longer sets telemetry (on by default): the bad table is added beside
    # hist_interval
    "fp8_telemetry": ("fp8_recipes.toml", "hist_interval = 50",
                      "hist_interval = 50\ntelemetry = { interval = -1 }"),
    "fp8_telemetry_key": ("fp8_recipes.toml", "hist_interval = 50",
                          "hist_interval = 50\ntelemetry = { bogus = 1 }"),
    "fp8_telemetry_type": ("fp8_recipes.toml", "hist_interval = 50",
                           'hist_interval = 50\ntelemetry = "on"'),
    "fp8_hist_neg": ("fp8_recipes.toml", "hist_interval = 50", "hist_interval = -50"),
    "fp8_outliers_huge": ("fp8_recipes_outliers.toml", "outlier_channels = 4",
                          "outlier_channels = 1000000"),
    "fp8_outlier_scale": ("fp8_recipes_outliers.toml", "outlier_scale = 100.0",
                          "outlier_scale = nan"),
    "broken_layer_overflow": ("broken_layer.toml", "overflow_layer = 4 }", "overflow_layer = 99 }"),
    # third pass (issue 27): a bool where a layer index goes, inf scales, huge sweep counts
    "broken_layer_overflow_bool": (
        "broken_layer.toml", "overflow_layer = 4 }", "overflow_layer = true }"
    ),
    "fp8_outlier_scale_inf": ("fp8_recipes_outliers.toml", "outlier_scale = 100.0",
                              "outlier_scale = inf"),
    "memory_measure_layers_huge": (
        "memory.toml", "measure_layers = 16", "measure_layers = 9223372036854775807"
    ),
    "broken_layer_threshold": ("broken_layer.toml", "threshold = 0.1", "threshold = nan"),
    "broken_layer_tail": ("broken_layer.toml", "tail = 10 ", "tail = 0 "),
    "broken_layer_width": ("broken_layer.toml", "width = 32,", "width = 1000000000000,"),
    "real_data_warmup": ("real_data.toml", "warmup_steps = 20", "warmup_steps = -20"),
    "real_data_data": ("real_data.toml", 'data = "text"', 'data = "../../etc/passwd"'),
    "real_data_seq": ("real_data.toml", "seq_len = 64", "seq_len = 1000000000000"),
}  # fmt: skip

BIG = "1000000000000000000"
DIAG = ["diagnose", "tiny.toml", "--quiet", "--no-plots"]
CMP = [*DIAG, "--compare", "a", "b"]
BIS = [*DIAG, "--bisect", "b", "a"]
AUTO = [*DIAG, "--autoswitch", "r"]
MEM = ["memory", "--preset", "gpt3-small"]
MEAS = ["memory", "--measure", "tiny.toml"]
RUN = ["run", "tiny.toml", "--quiet", "--no-report"]
DIST = ["--coordinator", "localhost:1", "--num-processes", "1", "--process-id", "0"]


def cases() -> dict[str, list[str]]:
    """Case name -> argv (after ``precisionlab``)."""
    c: dict[str, list[str]] = {}
    # diagnose: variants
    for name, argv in {
        "cmp_unknown": [*DIAG, "--compare", "nope", "a"],
        "cmp_same": [*DIAG, "--compare", "a", "a"],
        "cmp_empty": [*DIAG, "--compare", "", "a"],
        "cmp_path": [*DIAG, "--compare", "../a", "a"],
        "cmp_long": [*DIAG, "--compare", "x" * 100_000, "a"],
        "bis_unknown": [*DIAG, "--bisect", "b", "nope"],
        "bis_same": [*DIAG, "--bisect", "a", "a"],
        "auto_unknown": [*DIAG, "--autoswitch", "nope"],
        "auto_norecipe": [*DIAG, "--autoswitch", "a"],
        "auto_empty": [*DIAG, "--autoswitch", ""],
        "no_mode": DIAG,
        "two_modes": [*CMP, "--autoswitch", "r"],
    }.items():
        c[f"diagnose_{name}"] = argv
    for flag, base in (
        ("--threshold", CMP), ("--tolerance", BIS), ("--underflow", AUTO), ("--mse", AUTO),
    ):  # fmt: skip
        for v in ("nan", "-nan", "-1", "inf", "-inf", "1e400", "0x1p3", "abc", ""):
            c[f"diagnose{flag}_{v}"] = [*base, flag, v]
    for flag, base in (("--every", CMP), ("--tail", BIS), ("--steps", CMP), ("--steps", AUTO)):
        for v in ("0", "-1", BIG, "2147483648", "1.5", "nan", "abc"):
            c[f"diagnose{flag}_{base[-1]}_{v}"] = [*base, flag, v]
    for v in ("", ",", "nope*", "[", "x" * 10_000, "layer0,,nope"):
        c[f"diagnose_layers_{v[:8]}"] = [*BIS, "--layers", v]
    c["diagnose_wrong_mode_flag"] = [*BIS, "--threshold", "0.1"]
    for v in ("train.steps=abc", "nope.x=1", "train.telemetry.interval=-1", "=", "train.steps"):
        c[f"diagnose_set_{v}"] = [*CMP, "--set", v]
    for f in ("adir.toml", "missing.toml", "binary.toml", "badtoml.toml", "huge.toml",
              "types.toml", "unknown.toml", "survey.toml", "utf16.toml", "/dev/zero"):  # fmt: skip
        c[f"diagnose_file_{f}"] = ["diagnose", f, "--quiet", "--no-plots", "--compare", "a", "b"]
    for key in DIAG_TABLE:
        mode = ["--compare", "a", "b"] if key != "nan" and key != "neg" else ["--bisect", "b", "a"]
        mode = ["--autoswitch", "r"] if key in ("type", "inf") else mode
        c[f"diagnose_table_{key}"] = ["diagnose", f"diag_{key}.toml", "--quiet", *mode]
    for v in ("afile", "afile/sub", "/proc/self/x", "/proc/x", "", "/dev/null", "/", "."):
        c[f"diagnose_out_{v}"] = [*CMP, "--out", v]
    # memory
    for flag in ("--zero-stage", "--dp", "--batch", "--seq", "--microbatches",
                 "--checkpoint-every"):  # fmt: skip
        for v in ("-1", "0", BIG, "4", "abc", "1e3"):
            c[f"memory{flag}_{v}"] = [*MEM, flag, v]
    for v in ("nope", "", "{}", "mxfp8,nvfp4", "x" * 10_000, "delayed:amax_history_len=-1"):
        c[f"memory_recipe_{v[:12]}"] = [*MEM, "--recipe", v]
    for v in ("nan", "1e400GiB", "-1GiB", "0", "nanGiB", "infGB"):
        c[f"memory_budget_{v}"] = [*MEM, "--budget", v]
    for f in ("adir.toml", "missing.toml", "binary.toml", "badtoml.toml", "survey.toml",
              "types.toml", "unknown.toml", "/dev/zero"):  # fmt: skip
        c[f"memory_measure_{f}"] = ["memory", "--measure", f]
    c["memory_measure_dp_big"] = [*MEAS, "--dp", BIG]
    c["memory_measure_dp_2"] = [*MEAS, "--dp", "2"]
    c["memory_measure_dp_neg"] = [*MEAS, "--dp", "-3"]
    c["memory_measure_zero_5"] = [*MEAS, "--zero-stage", "5"]
    c["memory_measure_zero_neg"] = [*MEAS, "--zero-stage", "-1"]
    c["memory_measure_zero_dp1"] = [*MEAS, "--zero-stage", "1"]
    c["memory_measure_recipe"] = [*MEAS, "--recipe", "nope"]
    c["memory_measure_and_preset"] = [*MEAS, "--preset", "gpt3-small"]
    c["memory_measure_ckpt"] = ["memory", "--measure", "mut_ckpt_repeats_zero.toml"]
    # run: multi-process flags
    for name, argv in {
        "coord_empty": ["--coordinator", "", "--num-processes", "1", "--process-id", "0"],
        "coord_colon": ["--coordinator", ":", "--num-processes", "1", "--process-id", "0"],
        "coord_port0": ["--coordinator", "h:0", "--num-processes", "1", "--process-id", "0"],
        "coord_sup2": ["--coordinator", "h:\u00b2", "--num-processes", "1", "--process-id", "0"],
        "coord_arabic": ["--coordinator", "h:\u0663", "--num-processes", "2", "--process-id", "0"],
        "coord_bigport": ["--coordinator", "h:" + "9" * 30, "--num-processes", "1",
                          "--process-id", "0"],
        "coord_space": ["--coordinator", "a b:1", "--num-processes", "1", "--process-id", "0"],
        "coord_long": ["--coordinator", "h" * 100_000 + ":1", "--num-processes", "1",
                       "--process-id", "0"],
        "nproc_big": ["--coordinator", "localhost:1", "--num-processes", BIG, "--process-id", "0",
                      "--timeout", "2"],
        "nproc_int32": ["--coordinator", "localhost:1", "--num-processes", "2147483648",
                        "--process-id", "0", "--timeout", "2"],
        "pid_big": ["--coordinator", "h:1", "--num-processes", "2", "--process-id", BIG],
        "pid_neg": ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "-1"],
        "pid_float": ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0.0"],
        "timeout_big": [*DIST, "--timeout", BIG],
        "timeout_nan": [*DIST, "--timeout", "nan"],
        "timeout_neg": [*DIST, "--timeout", "-1"],
        "timeout_int64": [*DIST, "--timeout", str(2**63)],
        "resume_and_config": ["--resume", "x"],
    }.items():  # fmt: skip
        c[f"run_{name}"] = [*RUN, *argv]
    # run: --set of the new train keys
    for v in (
        "train.telemetry.interval=-1", "train.telemetry.interval=1000000000000",
        "train.telemetry=nope", 'train.telemetry.targets=["nope"]', "train.telemetry.targets=3",
        "train.telemetry.bogus=1", "train.telemetry.enabled=maybe", "train.telemetry.matmuls=7",
        'train.telemetry.state=["x"]', "train.scan_layers=yes", "train.scan_layers=1",
        "train.remat_every=-1", "train.remat_every=1e400", f"train.remat_every={BIG}",
        "train.remat_every=2", "train.remat_policy=nope", "train.remat_policy=",
        "train.zero_stage=4", "train.zero_stage=-1", "train.zero_stage=true",
        "train.zero_stage=1", "train.zero_stage=1.0", "train.recipe=nope",
        'train.recipe={name="nope"}',
        'train.recipe={name="delayed",amax_history_len=-1}',
        f'train.recipe={{name="delayed",amax_history_len={BIG}}}',
        'train.recipe={name="current",bogus=1}', "train.recipe=[1]",
        "train.high_precision_layers=nope", 'train.high_precision_layers=["nope*"]',
        "train.high_precision_layers=[1]", 'train.high_precision_layers=["["]',
        'train.high_precision_layers=""', "train.data_parallel=true",
        "=", "train.=1", "a..b=1", "train.steps", "train.steps=1e400", "variant.nope.lr=1",
        "variant.a.policy=bogus", "x" * 100_000 + "=1", "train.steps=" + "9" * 5000,
        "train.model_kwargs.width=1000000000000", "train.model_kwargs.depth=100000000",
        "train.batch_size=16777216", "train.eval_batches=65536",
        "train.data_kwargs.in_dim=1000000000000", "train.data_kwargs.teacher_width=" + BIG,
    ):  # fmt: skip
        c[f"run_set_{v[:48]}"] = [*RUN, "--set", v]
    # experiment files with a hostile value
    for name in MUTATED:
        c[f"run_file_{name}"] = ["run", f"mut_{name}.toml", "--quiet", "--no-report"]
    for name in ("broken_layer_threshold", "broken_layer_tail"):
        c[f"diagnose_file_{name}"] = [
            "diagnose", f"mut_{name}.toml", "--quiet", "--no-plots", "--bisect", "fp16", "fp32",
        ]  # fmt: skip
    for f in ("adir.toml", "binary.toml", "badtoml.toml", "huge.toml", "utf16.toml"):
        c[f"run_file_{f}"] = ["run", f, "--quiet", "--no-report"]
    for v in ("afile", "afile/sub", "/proc/self/x", "", "/dev/null", "/proc/x", " "):
        c[f"run_out_{v}"] = [*RUN, "--out", v]
    # bench
    for bench, flags in {
        "telemetry": ("--repeats", "--batch", "--interval", "--steps"),
        "recipes": ("--repeats", "--batch", "--seq", "--d-model", "--layers", "--heads",
                    "--vocab"),
        "quant": ("--repeats", "--rows", "--cols"),
        "codecs": ("--repeats", "--size"),
        "train": ("--repeats", "--batch", "--steps"),
    }.items():  # fmt: skip
        for flag in flags:
            for v in ("0", "-1", BIG, "nan", "1e3"):
                c[f"bench_{bench}{flag}_{v}"] = ["bench", bench, flag, v]
    c["bench_recipes_names"] = ["bench", "recipes", "--recipes", "nope"]
    c["bench_recipes_empty"] = ["bench", "recipes", "--recipes", ","]
    c["bench_quant_cases"] = ["bench", "quant", "--cases", "nope"]
    c["bench_telemetry_model"] = ["bench", "telemetry", "--model", "conv"]
    c["bench_telemetry_out"] = ["bench", "telemetry", "--out", "/nonexistent/x.json"]
    # issue 39: the trust pass's options and commands
    c["bench_recipes_accumulator_names"] = ["bench", "recipes", "--accumulator", "--recipes", "x"]
    for flag in ("--m", "--n", "--k"):
        for v in ("2147483647", BIG, "0", "-1"):
            c[f"bench_hardware{flag}_{v}"] = ["bench", "hardware", flag, v]
    c["run_deterministic_survey"] = ["run", "survey.toml", "--deterministic", "--quiet"]
    c["run_deterministic_resume"] = ["run", "--resume", "afile", "--deterministic"]
    c["run_force_old_files"] = ["run", "tiny.toml", "--out", "oldrun", "--force", "--quiet"]
    c["run_set_input_scale"] = [*RUN, "--set", "train.data_kwargs.input_scale=1e308"]
    c["run_set_deterministic"] = [*RUN, "--set", "train.deterministic=maybe"]
    c["memory_run_seq0"] = ["run", "memory_seq0.toml", "--quiet", "--no-report"]
    c["emulate_check_raises"] = ["emulate-check", "raises.py"]
    c["run_set_markov_vocab_huge"] = [*RUN, "--set", "train.data=markov", "--set",
                                      "train.model=transformer", "--set",
                                      "train.data_kwargs.vocab_size=10000000"]  # fmt: skip
    return c


#: Cases that are valid input, with why: they must not fail (status 0, or still running at the
#: time limit: a long run of a valid file), and print no traceback.
VALID = {
    "diagnose_cmp_same": "a variant against itself: the check that a difference is real",
    "diagnose_bis_same": "likewise, for --bisect: it passes as it is",
    "memory--zero-stage_0": "ZeRO stage 0 is plain data parallelism",
    "memory--dp_4": "4 data-parallel devices (estimated, none needed)",
    "memory--batch_4": "a batch of 4",
    "memory--seq_4": "a sequence of 4 tokens",
    "memory--checkpoint-every_4": "checkpointing every 4 layers",
    "memory_measure_zero_dp1": "ZeRO stage 1 on one device is allowed (nothing to shard)",
    "run_set_train.data_parallel=true": "all devices: one on a CPU",
    "run_set_train.batch_size=16777216": "the largest batch allowed (2^24): long, not wrong",
    "run_set_train.eval_batches=65536": "the most evaluation batches allowed: long, not wrong",
    "run_file_ckpt_repeats_zero": "repeats = 0 means no timing (documented)",
    "run_file_ckpt_remat_huge": "K is capped at the stacked layer count (documented)",
}


def classify(code: int | None, err: str, valid: bool = False) -> list[str]:
    """What is wrong with a case's result (empty: it followed the rule); ``valid``: the case
    is valid input (:data:`VALID`)."""
    if valid:
        problems = [] if code in (0, None) else [f"status {code} (valid input)"]
        return problems + (["traceback"] if "Traceback" in err else [])
    if code is None:
        return ["hang"]
    problems = []
    if code != 2:
        problems.append(f"status {code}")
    if "Traceback" in err:
        problems.append("traceback")
    lines = err.strip().splitlines()
    if len(lines) > 1:
        problems.append(f"{len(lines)} stderr lines")
    if code == 2 and lines and ": error: " not in lines[-1]:
        problems.append("no error line")
    return problems


def run_case(argv: list[str], work: Path) -> tuple[int | None, str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NO_COLOR="1", JAX_PLATFORMS="cpu")
    env.pop("PRECISIONLAB_DEBUG", None)
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "precisionlab", *argv], cwd=work, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
        start_new_session=True, preexec_fn=_limit_memory,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the case's own process group: its children too
        out, err = proc.communicate()
        return None, out, err


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", action="append", default=[], help="cases whose name contains K")
    parser.add_argument("-j", type=int, default=2, help="cases run at once (default 2)")
    parser.add_argument("--list", action="store_true", help="list the case names")
    args = parser.parse_args()
    chosen = {n: a for n, a in cases().items() if not args.k or any(k in n for k in args.k)}
    if args.list:
        print("\n".join(chosen))
        return 0
    bad = 0
    with tempfile.TemporaryDirectory(prefix="pl-hostile-") as tmp:
        work = Path(tmp)
        _files(work)

        def one(item):
            name, argv = item
            code, out, err = run_case(argv, work)
            return name, argv, code, out, err

        with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
            for name, argv, code, _out, err in pool.map(one, chosen.items()):
                problems = classify(code, err, name in VALID)
                last = (err.strip().splitlines() or [""])[-1][:160]
                if problems:
                    bad += 1
                    print(f"FLAG {name}: {', '.join(problems)}\n     {last}", flush=True)
                    shown = " ".join(a[:40] for a in argv)[:300]
                    print(f"     argv: {shown}", flush=True)
                    if "Traceback" in err:
                        tb = [ln for ln in err.splitlines() if ln.strip()][-3:]
                        print("     " + "\n     ".join(x[:200] for x in tb), flush=True)
                else:
                    print(f"ok   {name}: {last[:120]}", flush=True)
    print(f"{bad} of {len(chosen)} cases flagged")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
