"""Look at the built documentation in a real browser: screenshots and layout checks.

    python tools/docs_screenshots.py [--html DIR] [--out DIR] [--width 1280] [--height 2400]
                                     [PAGE ...]

Builds the site as ``docs/check_site.py`` does (Sphinx, warnings as errors) unless ``--html``
names a built one, then, for each page (a document name such as ``guides/hardware``; default:
:data:`PAGES`), takes a screenshot with headless Chromium (``OUT/<page>.png``, the window's
size) and measures the rendered page in the same browser:

- a code block, output or table wider than its column (the reader sees a scroll bar, or a
  cut line);
- an image drawn at less than :data:`MIN_SCALE` of its own width (its labels shrink with it:
  a 2112-pixel figure in the 736-pixel column shows 10-point text at 3.5 points);
- an image that did not load.

Prints one line per finding and exits 1 if there is one (2 if Chromium or the build is
missing). Not a test of the default suite: Chromium is not installed in CI. Look at the
screenshots too: what a reader stumbles on is not all measurable.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: Pages looked at by default: the hardware pages, the main job, a guide with figures and a
#: notebook with outputs.
PAGES = (
    "getting-started/main-job",
    "guides/hardware",
    "explanations/tensor-core-model",
    "explanations/hardware-validation",
    "benchmarks/hardware",
    "benchmarks/performance",
    "guides/training-with-recipes",
    "notebooks/03_fp16_vs_bf16_training",
)
#: An image shown at less than this fraction of its width is reported.
MIN_SCALE = 0.6

#: Runs in a page that loads the page under test in a same-size frame, and writes what it
#: measured into its own DOM, which ``chromium --dump-dom`` prints.
_PROBE = """<!doctype html><html><body><pre id="out">pending</pre>
<iframe id="f" style="width:%(width)dpx;height:%(height)dpx;border:0" src="%(src)s"></iframe>
<script>
document.getElementById("f").onload = function () {
  var frame = this;
  setTimeout(function () {
    var d = frame.contentDocument, found = [];
    var main = d.querySelector("article") || d.body;
    d.querySelectorAll("pre, div.table-wrapper, table, div.cell_output").forEach(
      function (e) {
        if (e.scrollWidth > e.clientWidth + 2) {
          found.push({kind: "wide", tag: e.tagName.toLowerCase(), need: e.scrollWidth,
                      have: e.clientWidth,
                      text: (e.textContent || "").replace(/\\s+/g, " ").trim().slice(0, 70)});
        }
      });
    d.querySelectorAll("img").forEach(function (e) {
      found.push({kind: "img", src: e.getAttribute("src"), natural: e.naturalWidth,
                  shown: e.clientWidth, complete: e.complete});
    });
    document.getElementById("out").textContent = JSON.stringify(
      {column: main.clientWidth, found: found});
  }, 1500);
};
</script></body></html>"""


def chromium() -> str | None:
    """The Chromium executable, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def build(out: Path) -> bool:
    """Build the site into ``out`` as docs/check_site.py does; whether it succeeded."""
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q",
               "-b", "html", str(DOCS), str(out)]  # fmt: skip
    return subprocess.call(command, cwd=ROOT) == 0


def _browser(exe: str, *args: str) -> subprocess.CompletedProcess:
    command = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def screenshot(exe: str, page: Path, png: Path, width: int, height: int) -> None:
    """``page`` (an HTML file) as Chromium draws it in a ``width`` x ``height`` window."""
    _browser(exe, f"--screenshot={png}", f"--window-size={width},{height}", page.as_uri())


def png_size(png: Path) -> tuple[int, int]:
    """(width, height) of a PNG file, read from its header."""
    head = png.read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{png} is not a PNG file")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def measure(exe: str, page: Path, width: int, height: int, tmp: Path) -> dict:
    """What the probe measured on ``page``: the content column's width and the findings."""
    probe = tmp / "probe.html"
    probe.write_text(_PROBE % {"width": width, "height": height, "src": page.as_uri()})
    proc = _browser(exe, "--allow-file-access-from-files", "--virtual-time-budget=10000",
                    "--dump-dom", probe.as_uri())  # fmt: skip
    match = re.search(r'<pre id="out">(.*?)</pre>', proc.stdout, re.S)
    if not match or match.group(1) == "pending":
        raise RuntimeError(f"the probe measured nothing on {page}: {proc.stderr[-500:]}")
    text = match.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text)


def problems(name: str, measured: dict) -> list[str]:
    """One line per finding on page ``name``."""
    lines = []
    for f in measured["found"]:
        if f["kind"] == "wide":
            lines.append(f"{name}: a {f['tag']} needs {f['need']} px of a {f['have']} px column "
                         f"(scrolls or is cut): {f['text']!r}")  # fmt: skip
        elif not f["complete"] or f["natural"] == 0:
            lines.append(f"{name}: image {f['src']} did not load")
        elif f["shown"] < MIN_SCALE * f["natural"]:
            lines.append(f"{name}: image {f['src']} is {f['natural']} px wide, shown at "
                         f"{f['shown']} px ({f['shown'] / f['natural']:.0%}: its text shrinks "
                         "as much)")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", help="document names (default: a selection)")
    parser.add_argument("--html", type=Path, help="a built site (default: build one)")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("docs-screenshots"),
        help="folder for the screenshots (default: ./docs-screenshots)",
    )
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args(argv)
    exe = chromium()
    if exe is None:
        print("docs_screenshots: no chromium on PATH (apt-get install chromium)")
        return 2
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        html = args.html
        if html is None:
            html = tmp / "html"
            if not build(html):
                print("docs_screenshots: the build failed or warned; see above")
                return 2
        args.out.mkdir(parents=True, exist_ok=True)
        found = []
        for name in args.pages or PAGES:
            page = html / f"{name}.html"
            if not page.is_file():
                found.append(f"{name}: no such page in {html}")
                continue
            png = args.out / f"{name.replace('/', '_')}.png"
            screenshot(exe, page, png, args.width, args.height)
            if not png.is_file() or png_size(png) != (args.width, args.height):
                found.append(f"{name}: no {args.width}x{args.height} screenshot was written")
            measured = measure(exe, page, args.width, args.height, tmp)
            lines = problems(name, measured)
            found += lines
            print(f"{name}: {png} (content column {measured['column']} px, "
                  f"{len(lines)} finding(s))")  # fmt: skip
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
