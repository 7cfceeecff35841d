"""Build the documentation as CI does and check that every page was rendered.

    python docs/check_site.py

Runs Sphinx from scratch (``-E``) with warnings as errors into a temporary directory, then
checks that each source page (``docs/**/*.md``, the generated ``reference/*.rst`` pages, the
notebooks) has its HTML file. Exit status 0 when both hold; otherwise one line per problem.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent


def sources() -> list[str]:
    """Document names (paths under docs/ without suffix) the site must render."""
    names = []
    for path in sorted(DOCS.rglob("*")):
        rel = path.relative_to(DOCS)
        if rel.parts[0].startswith("_") or rel.parts[0] == "notebooks":
            continue
        if path.suffix in (".md", ".rst") and path.is_file():
            names.append(str(rel.with_suffix("")))
    names += [f"notebooks/{p.stem}" for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    return names


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "html"
        command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q",
                   "-b", "html", str(DOCS), str(out)]  # fmt: skip
        if subprocess.call(command, cwd=ROOT) != 0:
            print("docs: the build failed or warned (warnings are errors); see above")
            return 1
        expected = sources()  # after the build: it generates the reference pages
        missing = [name for name in expected if not (out / f"{name}.html").is_file()]
        for name in missing:
            print(f"docs: no HTML for {name} (is it in a toctree of docs/index.md?)")
        if missing:
            return 1
        print(f"docs: {len(expected)} pages built without a warning")
        return 0


if __name__ == "__main__":
    sys.exit(main())
