"""Every example in README.md and in the documentation pages (``docs/**/*.md``) runs, and shows
what it prints.

Marker convention: an HTML comment on the line just before a fence classifies the example.

    <!-- readme: run [OPTIONS] -->       run it and compare the output it shows exactly
    <!-- readme: run-only [OPTIONS] -->  run it; it must succeed; the output is not compared
    <!-- readme: skip REASON -->         not run (installs, multi-minute jobs, ...)

What is run:

- a ```console block: ``$ cmd`` lines (a trailing ``\\`` continues a command on the next line;
  ``# comment`` ends it), each followed by its exact output (stdout and stderr together, as a
  terminal shows them). ``precisionlab ...`` and ``python -m precisionlab ...`` run in-process
  through :func:`precisionlab.cli.main` (fast: JAX is imported once); other commands run in a
  shell.
- a ```bash or ```sh block: every non-comment line is a command (``run-only`` or ``skip`` only).
- a ```python block: executed in this process in a fresh namespace; with ``run`` it must be
  followed directly by a plain ``` block holding its exact stdout.

``python tests/docs/test_readme.py --update [FILE ...]`` reruns every ``run`` example (of the files
named, or of all of them) and rewrites the outputs shown from what they print now (blocks
whose expected output uses ``...`` are left alone and listed); review the diff before
committing.

Each example runs in its own temporary directory, which holds links to the repository's
``experiments/``, ``notebooks/`` and ``docs/``, so relative paths work and nothing is written
into the checkout.

In expected output a line ``...`` alone matches any number of lines (zero or more), and
trailing whitespace is ignored. A fenced ``bash``/``sh``/``shell``/``console``/``python``
block without a marker fails the test, and so does a plain block whose first line starts with
``$ ``: every example is classified.

OPTIONS (after ``run`` or ``run-only``; shell-quoted):

    --set KEY=VALUE     appended as ``--set KEY=VALUE`` to every ``precisionlab run CONFIG``
                        in the block (repeatable): reduces long runs, e.g. train.steps=10.
                        Implies nothing about the output: use it with ``run-only``.
    --replace OLD NEW   replace the text OLD by NEW in the block before running it
                        (repeatable), e.g. ``--replace steps=300 steps=20`` in a Python snippet.
    --status N          the exit status every command of the block must return (default 0).
    --rtol R            numbers in the output may differ from those shown by a relative R (the
                        text around them must match exactly): for results whose last digit
                        depends on the CPU's vector unit (XLA emits different code for AVX2
                        and AVX-512), e.g. a loss after 20 fp8 training steps.
    --slow              run the example only under ``-m slow``.
    --from-jax X.Y TEXT the output shown is what jax below X.Y prints; XLA changed it in X.Y, and
                        on that jax or newer the output must contain TEXT instead (``\n`` in it is
                        a newline; the text around the example says what newer jax prints).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
LINKED = ("experiments", "notebooks", "docs")

_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*readme:\s*(run-only|run|skip)\b(.*?)-->\s*$")
_SHELL = {"bash", "sh", "shell", "console"}
_PYTHON = {"python", "py"}


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None = None  # run, run-only, skip
    options: list[str] = dataclasses.field(default_factory=list)
    output: str | None = None  # the plain block following a python block
    end: int = 0  # 0-based index of the closing fence
    output_end: int = 0  # 0-based index of the output block's closing fence
    source: str = "README.md"  # the file, relative to the repository root

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}-{self.lang or 'plain'}"


def example_files() -> list[Path]:
    """README.md and every Markdown page of the documentation (not its build or generated
    parts, whose names start with ``_``)."""
    pages = [
        p
        for p in sorted(DOCS.rglob("*.md"))
        if not any(part.startswith("_") for part in p.relative_to(DOCS).parts)
        and not p.relative_to(DOCS).parts[0] == "notebooks"  # a link to ../notebooks
    ]
    return [README, *pages]


def parse_readme(text: str, source: str = "README.md") -> list[Block]:
    """Every fenced block of ``text`` with its marker; python outputs attached."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        ticks, lang = match.group(1), match.group(2).lower()
        end = i + 1
        while end < len(lines) and lines[end].strip() != ticks:
            end += 1
        block = Block(
            line=i + 1, lang=lang, text="\n".join(lines[i + 1 : end]), end=end, source=source
        )
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        if marker:
            block.marker = marker.group(1)
            rest = marker.group(2).strip()
            block.options = [rest] if block.marker == "skip" else shlex.split(rest)
        previous = blocks[-1] if blocks else None
        follows = previous is not None and previous.end == i - 1
        if lang == "" and previous and previous.lang in _PYTHON and follows and not marker:
            previous.output = block.text  # the stdout of the python block just above
            previous.output_end = end
        else:
            blocks.append(block)
        i = end + 1
    return blocks


@dataclasses.dataclass
class Options:
    sets: list[str]
    replace: list[tuple[str, str]]
    status: int
    slow: bool
    rtol: float = 0.0
    newer_jax: tuple[tuple[int, ...], str] | None = None  # (X.Y, what X.Y and newer print)


def parse_options(words: list[str], where: str) -> Options:
    opts = Options([], [], 0, False)
    it = iter(words)
    for word in it:
        try:
            if word == "--set":
                opts.sets.append(next(it))
            elif word == "--replace":
                opts.replace.append((next(it), next(it)))
            elif word == "--status":
                opts.status = int(next(it))
            elif word == "--slow":
                opts.slow = True
            elif word == "--rtol":
                opts.rtol = float(next(it))
            elif word == "--from-jax":
                version = tuple(int(p) for p in next(it).split("."))
                opts.newer_jax = (version, next(it).replace("\\n", "\n"))
            else:
                raise ValueError(f"unknown option {word!r}")
        except StopIteration:
            raise ValueError(f"{where}: option {word!r} needs a value") from None
    return opts


def commands(block: Block) -> list[tuple[str, str]]:
    """(command, expected output) pairs of a shell block."""
    pairs: list[list[str]] = []
    lines = block.text.splitlines()
    if block.lang != "console" and not any(ln.startswith("$ ") for ln in lines):
        return [(ln, "") for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    continuing = False
    for ln in lines:
        if continuing:
            pairs[-1][0] += "\n" + ln
            continuing = ln.rstrip().endswith("\\")
        elif ln.startswith("$ "):
            pairs.append([ln[2:], ""])
            continuing = ln.rstrip().endswith("\\")
        elif pairs:
            pairs[-1][1] += ln + "\n"
        elif ln.strip():
            raise ValueError(f"{block.id}: output before the first '$ ' command: {ln!r}")
    return [(cmd, out) for cmd, out in pairs]


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _same_line(exp: str, have: str, rtol: float) -> bool:
    if exp == have or rtol == 0.0:
        return exp == have
    if _NUMBER.split(exp) != _NUMBER.split(have):
        return False
    a, b = _NUMBER.findall(exp), _NUMBER.findall(have)
    return len(a) == len(b) and all(
        abs(float(x) - float(y)) <= rtol * max(abs(float(x)), abs(float(y)))
        for x, y in zip(a, b, strict=True)
    )


def matches(expected: str, got: str, rtol: float = 0.0) -> bool:
    """Line by line, trailing whitespace ignored; a line ``...`` matches any lines; with
    ``rtol``, numbers may differ by that relative amount (the text between them may not)."""
    exp = [ln.rstrip() for ln in expected.rstrip("\n").splitlines()]
    have = [ln.rstrip() for ln in got.rstrip("\n").splitlines()]

    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(have)
        if exp[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and _same_line(exp[i], have[j], rtol) and match(i + 1, j + 1)

    return match(0, 0)


def _precisionlab_argv(cmd: str) -> list[str] | None:
    argv = shlex.split(cmd.replace("\\\n", " "), comments=True)
    if argv[:1] == ["precisionlab"]:
        return argv[1:]
    if argv[:3] == ["python", "-m", "precisionlab"]:
        return argv[3:]
    return None


def run_command(cmd: str, opts: Options) -> tuple[int, str]:
    """Exit status and combined stdout + stderr of one command, in the current directory."""
    argv = _precisionlab_argv(cmd)
    if argv is None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
        proc = subprocess.run(
            cmd, shell=True, capture_output=True, text=True, env=env, timeout=600,
            executable="/bin/bash",
        )  # fmt: skip
        return proc.returncode, proc.stdout + proc.stderr
    if argv[:1] == ["run"] and "--resume" not in argv:
        for item in opts.sets:
            argv += ["--set", item]
    from precisionlab.cli import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(buffer):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, buffer.getvalue()


def run_python(source: str, where: str) -> str:
    buffer = io.StringIO()
    namespace = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(buffer):
        # compiled as a user's script is: without this file's `from __future__ import
        # annotations` (string annotations send dataclasses, an eqx.Module's fields, looking
        # for a module "__readme__" that does not exist)
        exec(compile(source, where, "exec", dont_inherit=True), namespace)
    return buffer.getvalue()


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    for name in LINKED:
        if (ROOT / name).exists():
            (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")  # argparse and tables wrap as without a terminal (CI)
    monkeypatch.delenv("PRECISIONLAB_DEBUG", raising=False)
    return tmp_path


BLOCKS = [
    block
    for path in example_files()
    for block in parse_readme(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
]
EXAMPLES = [
    b
    for b in BLOCKS
    if b.lang in _SHELL | _PYTHON or (b.lang == "" and b.text.lstrip().startswith("$ "))
]


def _params():
    for block in EXAMPLES:
        marks = []
        if block.marker in ("run", "run-only"):
            try:
                if parse_options(block.options, block.id).slow:
                    marks.append(pytest.mark.slow)
            except ValueError:
                pass  # reported by the test itself
        yield pytest.param(block, id=block.id, marks=marks)


def test_every_example_is_classified():
    unmarked = [b.id for b in EXAMPLES if b.marker is None]
    assert not unmarked, (
        "examples without a '<!-- readme: run|run-only|skip REASON -->' marker on the "
        f"line before the fence: {unmarked}"
    )
    for block in EXAMPLES:
        if block.marker == "skip":
            assert block.options[0].strip(), f"{block.id}: skip needs a reason"
        if block.marker == "run" and block.lang in _PYTHON:
            assert block.output is not None, (
                f"{block.id}: a 'run' python block must be followed directly by a plain ``` "
                "block with its exact output (or be marked run-only)"
            )
        if block.marker == "run" and block.lang in _SHELL | {""}:
            assert block.lang == "console", f"{block.id}: 'run' shell examples are ```console"


@pytest.mark.parametrize("block", _params())
def test_readme_example(block: Block, sandbox):
    if block.marker in (None, "skip"):
        pytest.skip(f"not run: {block.options[0] if block.options else 'no marker'}")
    opts = parse_options(block.options, block.id)
    newer = None  # on a jax whose XLA prints otherwise: the text its output must contain
    if opts.newer_jax is not None:
        import jax

        if tuple(int(p) for p in jax.__version__.split(".")[:2]) >= opts.newer_jax[0]:
            newer = opts.newer_jax[1]
    text = block.text
    for old, new in opts.replace:
        assert old in text, f"{block.id}: --replace {old!r}: not in the example"
        text = text.replace(old, new)
    compare = block.marker == "run"
    if block.lang in _PYTHON:
        got = run_python(text, block.id)
        if compare and newer is not None:
            assert newer in got, f"{block.id}: printed\n{got}"
        elif compare:
            assert matches(block.output, got, opts.rtol), f"{block.id}: printed\n{got}"
        return
    for cmd, expected in commands(dataclasses.replace(block, text=text)):
        status, got = run_command(cmd, opts)
        assert status == opts.status, f"{block.id}: `{cmd}` exited {status}:\n{got[-3000:]}"
        if compare and newer is not None:
            assert newer in got, f"{block.id}: `{cmd}` printed\n{got}"
        elif compare:
            assert matches(expected, got, opts.rtol), f"{block.id}: `{cmd}` printed\n{got}"


# --- the harness itself ----------------------------------------------------------------------
def test_parser_classifies_markers_and_outputs():
    text = "\n".join(
        [
            "<!-- readme: run --replace a b -->",
            "```python",
            "print(1)",
            "```",
            "```",
            "1",
            "```",
            "",
            "```console",
            "$ precisionlab x",
            "```",
            "<!-- readme: skip installs -->",
            "```bash",
            "pip install x",
            "```",
        ]
    )
    blocks = parse_readme(text)
    assert [(b.lang, b.marker) for b in blocks] == [
        ("python", "run"), ("console", None), ("bash", "skip"),
    ]  # fmt: skip
    assert blocks[0].output == "1" and blocks[0].options == ["--replace", "a", "b"]
    assert blocks[2].options == ["installs"]


def test_docs_pages_are_scanned():
    files = [str(p.relative_to(ROOT)) for p in example_files()]
    assert files[0] == "README.md" and "docs/getting-started/cli-tour.md" in files
    assert not [f for f in files if "/_" in f or f.startswith("docs/notebooks")]
    sources = {b.source for b in EXAMPLES}
    assert "docs/guides/formats.md" in sources and "README.md" in sources
    ids = [b.id for b in EXAMPLES]
    assert len(ids) == len(set(ids))


def test_matches_and_commands():
    assert matches("a\n...\nd\n", "a\nb\nc\nd")
    assert matches("a\n...\n", "a")
    assert matches("loss 2.238, 6 of 8\n", "loss 2.239, 6 of 8", rtol=1e-3)
    assert not matches("loss 2.238, 6 of 8\n", "loss 2.239, 6 of 8")
    assert not matches("loss 2.238, 6 of 8\n", "loss 2.248, 6 of 8", rtol=1e-3)
    assert not matches("loss 2.238, 6 of 8\n", "loss 2.238, 5 of 8", rtol=1e-3)
    assert not matches("loss 2.238, 6 of 8\n", "cost 2.238, 6 of 8", rtol=1e-3)
    assert not matches("a\nb", "a\nc")
    assert not matches("a", "a\nb")
    block = Block(1, "console", "$ precisionlab a \\\n  --b\nout1\n$ precisionlab c  # note\nout2")
    assert commands(block) == [
        ("precisionlab a \\\n  --b", "out1\n"),
        ("precisionlab c  # note", "out2\n"),
    ]
    assert _precisionlab_argv("precisionlab c  # note") == ["c"]
    assert parse_options(["--set", "a=1", "--status", "2", "--slow"], "x") == Options(
        ["a=1"], [], 2, True
    )
    assert parse_options(["--from-jax", "0.11", "a\\nb"], "x").newer_jax == ((0, 11), "a\nb")
    with pytest.raises(ValueError, match="unknown option"):
        parse_options(["--bogus"], "x")


# --- regeneration -----------------------------------------------------------------------------
def update_readme(files: list[str] | None = None) -> None:
    """Rewrite the outputs of ``run`` examples from real runs, file by file."""
    chosen = [str(p.relative_to(ROOT)) for p in example_files()]
    if files:
        wanted = {str(Path(f).resolve().relative_to(ROOT)) for f in files}
        unknown = wanted - set(chosen)
        if unknown:
            sys.exit(f"not an example file: {', '.join(sorted(unknown))}")
        chosen = [c for c in chosen if c in wanted]
    for source in chosen:
        _update_file(source)


def _update_file(source: str) -> None:
    import tempfile

    path = ROOT / source
    lines = path.read_text(encoding="utf-8").splitlines()
    kept = []
    examples = [b for b in EXAMPLES if b.source == source and b.marker == "run"]
    for block in reversed(examples):
        opts = parse_options(block.options, block.id)
        with tempfile.TemporaryDirectory() as tmp:
            for name in LINKED:
                (Path(tmp) / name).symlink_to(ROOT / name)
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                if block.lang in _PYTHON:
                    if "..." in (block.output or "").splitlines():
                        kept.append(block.id)
                        continue
                    got = run_python(block.text, block.id)
                    new = [ln.rstrip() for ln in got.rstrip("\n").splitlines()]
                    lines[block.end + 2 : block.output_end] = new
                    continue
                body = []
                pairs = commands(block)
                if any("..." in expected.splitlines() for _, expected in pairs):
                    kept.append(block.id)
                    continue
                for cmd, _ in pairs:
                    _, got = run_command(cmd, opts)
                    body += ["$ " + part for part in cmd.splitlines()[:1]]
                    body += cmd.splitlines()[1:]
                    body += [ln.rstrip() for ln in got.rstrip("\n").splitlines()]
                lines[block.line : block.end] = body
            finally:
                os.chdir(cwd)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if kept:
        print("left alone (expected output uses '...'):", ", ".join(reversed(kept)))


if __name__ == "__main__":
    if sys.argv[1:2] != ["--update"]:
        sys.exit("usage: python tests/docs/test_readme.py --update [FILE ...]")
    os.environ["NO_COLOR"] = "1"
    os.environ["COLUMNS"] = "80"
    update_readme(sys.argv[2:])
