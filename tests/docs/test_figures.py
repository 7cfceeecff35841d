"""The site's figures and code blocks fit its content column (default suite, no build).

- Every committed ``docs/img/*.png`` is drawn page-wide: 7.5 inches at 110 dpi, 825 pixels
  (docs/contributing.md, "Building the documentation"). Wider, the browser shrinks it to the
  column (about 736 pixels) and its text with it; much narrower (under 700), it was drawn at
  another size than the page's and its text is not the 9 points the figures are made with.
- No fenced block of ``README.md`` or ``docs/**/*.md`` has a line over 100 characters (what
  fits the column in monospace; longer lines hide behind a scroll bar), except the blocks in
  :data:`ALLOWED`, each with its reason. An entry that no longer matches a block with a long
  line fails too, so the list only shrinks.

The width is read from the PNG's header (its IHDR chunk), not with an image library.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMG = ROOT / "docs" / "img"
MIN_PX, MAX_PX = 700, 825
MAX_COLUMNS = 100

_CMD = "a command line as a reader types it (the examples test runs it as written)"
_MSG = "a one-line error, warning or finding: the CLI and the library print one line by rule"
_CODE = "source code with its comment, as a reader copies it"
_REPR = "a Python value printed as Python prints it (one repr line)"
_RECORD = "a dated measurement of earlier code, kept as recorded (cannot be regenerated)"

#: (page, the start of the block's first line) -> why its long lines stay.
ALLOWED: dict[tuple[str, str], str] = {
    ("README.md", "import jax.numpy as jnp"): _CODE,
    ("docs/benchmarks/codecs.md", "$ precisionlab bench codecs --whole-array"): _CMD,
    (
        "docs/benchmarks/performance.md",
        "unit                           compiles  compile s",
    ): "`run --timings` tables printed as one 134-column table by earlier code (two tables "
    "of at most 88 columns now, regenerated at the top of the page): the runs of "
    "2026-11-26 and 2026-11-27 are " + _RECORD,
    (
        "docs/benchmarks/quant.md",
        "fake_quant vs astype round trip on a 1024x4096 float32 input (",
    ): _RECORD + " (two runs of earlier code; the heading line is two lines now)",
    ("docs/benchmarks/recipes.md", "$ precisionlab bench recipes --recipes"): _CMD,
    ("docs/contributing.md", "python tests/docs/test_notebooks.py --update"): _CMD,
    ("docs/contributing.md", "PRECISIONLAB_TEST_CPU_PROFILE=/tmp/cpu.txt"): _CMD,
    ("docs/explanations/conformance.md", "$ precisionlab conformance --libs"): _CMD,
    ("docs/explanations/hardware-validation.md", "v100: D = 2**-23"): _MSG,
    ("docs/getting-started/cli-tour.md", "$ precisionlab bits 0.1 --format bf17"): _MSG,
    (
        "docs/guides/diagnose.md",
        "$ precisionlab diagnose experiments/broken_layer.toml --comp",
    ): _MSG,
    (
        "docs/guides/diagnose.md",
        "$ precisionlab diagnose experiments/broken_layer.toml --bise",
    ): _CMD + "; " + _MSG,
    (
        "docs/guides/diagnose.md",
        "$ precisionlab diagnose experiments/fp16_vs_bf16.toml --comp",
    ): _CMD + "; " + _MSG,
    (
        "docs/guides/diagnose.md",
        "$ precisionlab diagnose experiments/broken_layer.toml --auto",
    ): _CMD + "; " + _MSG,
    ("docs/guides/diagnose.md", "compare c=f16 with fp32 on f"): _MSG,
    ("docs/guides/diagnose.md", "c=f16 vs fp32: output differs by inf"): _MSG,
    ("docs/guides/emulate.md", "$ precisionlab emulate-check"): _MSG,
    ("docs/guides/experiments.md", "precisionlab run experiments/fp16_vs_bf16.toml --out"): _CMD,
    ("docs/guides/forecast.md", "forecast: step 231"): _MSG,
    ("docs/guides/hardening.md", "  $ mkfifo results.json"): _MSG,
    ("docs/guides/hardening.md", "  $ precisionlab run tiny.toml --out r"): _MSG,
    ("docs/guides/hardening.md", "$ precisionlab run experiments/memory.toml --set"): _MSG,
    ("docs/guides/hardware.md", "{'device': 'h100'"): _REPR,
    ("docs/guides/hardware.md", "accumulate=None  1.0"): _MSG,
    ("docs/guides/hardware.md", "accumulate=None           y[0]"): _MSG,
    ("docs/guides/jax-compatibility.md", "RuntimeError: precisionlab supports jax"): _MSG,
    ("docs/guides/jax-compatibility.md", "dot_general[0] sits inside 'shard_map'"): _MSG,
    ("docs/guides/memory.md", "[train]"): _CODE,
    ("docs/guides/memory.md", "scan_layers = true"): _CODE,
    ("docs/guides/multi-process.md", "# the same file and options in every process"): _CMD,
    ("docs/guides/quantization.md", "import jax, jax.numpy as jnp"): _CODE,
    ("docs/guides/quantization.md", "QArray(fmt=int4"): _REPR,
    ("docs/guides/verify.md", "217604 bytes to write"): _MSG,
    ("docs/guides/verify.md", "True 100.0% bit-equal"): _MSG,
    ("docs/guides/your-model.md", "import jax, numpy as np, optax, flax.nnx as nnx"): _CODE,
    ("docs/guides/your-model.md", "import equinox as eqx, jax, jmp, numpy as np, optax"): _CODE,
    ("docs/guides/your-model.md", "dot_general[0]  attn/query/kernel"): _MSG,
}

#: docs/img figures not yet redrawn page-wide -> why (an entry whose figure fits fails, so the
#: list only shrinks).
FIGURES_ALLOWED: dict[str, str] = {}

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels from a PNG's IHDR chunk; ValueError for anything else."""
    head = path.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError(f"{path}: not a PNG")
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts)
    return [ROOT / "README.md", *docs]


def fenced_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the block's first line, its lines) of every fenced code block, MyST
    directives other than code (a note, a toctree: prose the browser wraps) left out."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        prose = info.startswith("{") and not info.startswith(("{code", "{literalinclude"))
        if not prose:
            out.append((i + 2, lines[i + 1 : j]))
        i = j + 1
    return out


def long_blocks() -> dict[tuple[str, str, int], list[int]]:
    """Every block with a line over MAX_COLUMNS: (page, first line, line number) -> widths."""
    found = {}
    for page in pages():
        rel = str(page.relative_to(ROOT))
        for start, body in fenced_blocks(page.read_text("utf-8")):
            widths = [len(line) for line in body if len(line) > MAX_COLUMNS]
            if widths:
                found[(rel, body[0], start)] = widths
    return found


def _allowed(page: str, first: str) -> tuple[str, str] | None:
    for key in ALLOWED:
        if key[0] == page and first.startswith(key[1]):
            return key
    return None


def test_the_committed_figures_are_page_wide():
    figures = sorted(IMG.glob("*.png"))
    assert figures, IMG
    wrong = {f.name: png_size(f)[0] for f in figures if not MIN_PX <= png_size(f)[0] <= MAX_PX}
    bad = {name: width for name, width in wrong.items() if name not in FIGURES_ALLOWED}
    assert not bad, (
        f"figures not drawn page-wide ({MIN_PX}-{MAX_PX} px; 7.5 in at 110 dpi is {MAX_PX}): "
        f"{bad}; redraw them with the command that makes them (docs/tables.py --list)"
    )
    stale = [name for name in FIGURES_ALLOWED if name not in wrong]
    assert not stale, f"FIGURES_ALLOWED entries that fit now (remove them): {stale}"


def test_no_code_block_is_wider_than_the_column():
    found = long_blocks()
    bad = [
        f"{page}:{start}: {len(widths)} line(s) over {MAX_COLUMNS} characters (up to "
        f"{max(widths)}), block starting {first[:60]!r}"
        for (page, first, start), widths in found.items()
        if _allowed(page, first) is None
    ]
    assert not bad, (
        "code blocks wider than the content column: narrow the output at its source (fewer or "
        "narrower columns, wrapping) and regenerate the page, or add the block to ALLOWED with "
        "its reason:\n" + "\n".join(bad)
    )
    used = {_allowed(page, first) for page, first, _ in found}
    stale = [key for key in ALLOWED if key not in used]
    assert not stale, f"ALLOWED entries that match no wide block any more (remove them): {stale}"


def test_the_checks_can_fail(tmp_path):
    """The parsing the two tests rely on: a PNG's width, fences (``` and ~~~, longer fences,
    a MyST note left out), a long line found."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 2))
    fig.add_subplot().plot(np.arange(3))
    fig.savefig(tmp_path / "f.png", dpi=110)
    assert png_size(tmp_path / "f.png") == (825, 220)
    (tmp_path / "g.png").write_bytes(b"GIF89a" + bytes(30))
    with pytest.raises(ValueError, match="not a PNG"):
        png_size(tmp_path / "g.png")
    wide = "x" * (MAX_COLUMNS + 1)
    text = "\n".join([
        "```text", "short", wide, "```", "", "````md", "```", wide, "```", "````",
        "~~~", "ok", "~~~", "```{note}", wide, "```", "```{code-block} text", wide, "```",
    ])  # fmt: skip
    blocks = fenced_blocks(text)
    assert [start for start, _ in blocks] == [2, 7, 12, 18]
    assert [[len(x) for x in body] for _, body in blocks] == [
        [5, MAX_COLUMNS + 1],
        [3, MAX_COLUMNS + 1, 3],
        [2],
        [MAX_COLUMNS + 1],
    ]
