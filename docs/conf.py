"""Sphinx configuration of precisionlab's documentation.

Build (offline, warnings are errors), from the repository root:
``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (see docs/contributing.md).
The reference pages under ``reference/`` are generated at build time from the code by
``_ext/precisionlab_docs.py``; the notebooks are rendered, never executed.
"""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS.parent))  # this checkout's precisionlab, not an installed one
sys.path.insert(0, str(DOCS / "_ext"))

import precisionlab  # noqa: E402

project = "precisionlab"
author = "the precisionlab developers"
copyright = "the precisionlab developers"
release = version = precisionlab.__version__

extensions = [
    "myst_nb",  # Markdown pages (MyST) and the notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' Args:/Returns:/Attributes: sections
    "precisionlab_docs",  # API, CLI and experiment-file references generated from the code
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints", "README.md"]
root_doc = "index"

# MyST: heading anchors so that a link such as guides/telemetry.md#numerics-telemetry-in-training
# resolves (and is checked).
myst_heading_anchors = 3
myst_enable_extensions = ["dollarmath", "colon_fence"]

# Notebooks are shown with the outputs they were saved with; the build runs nothing.
nb_execution_mode = "off"

# Every cross-reference must resolve (a missing one is a warning, so an error under -W), but
# the types of other libraries are not documented here.
nitpicky = True
_OTHERS = "jax|jaxlib|numpy|np|jnp|optax|ml_dtypes|flax|equinox|jmp|orbax|matplotlib"
nitpick_ignore_regex = [
    (r"py:.*", rf"({_OTHERS})(\..*)?"),
    (r"py:.*", r"(Array|ArrayLike|PyTree|DTypeLike|Any|Callable|Sequence|Mapping|Iterable)"),
    (r"py:.*", r"(collections|typing|types|pathlib|os|io|argparse|dataclasses|enum)\..*"),
    (r"py:.*", r"(Path|ModuleType|Enum|IntEnum|NamedTuple|Protocol|TextIO)"),
]

autodoc_typehints = "none"  # signatures show the parameters; the docstrings say the types
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields, not as duplicate attribute entries
# TrainConfig's docstring groups its fields under these headings, each a "key: meaning" list
napoleon_custom_sections = [
    (name, "params_style")
    for name in ("Model and data", "Optimizer", "Precision", "Loop", "Loss", "Telemetry")
]

html_theme = "furo"
html_title = f"precisionlab {release}"
html_static_path = ["_static"]
html_css_files = ["precisionlab.css"]  # the CLI reference's help blocks
suppress_warnings = ["myst.header"]  # pages moved from the README may start at any level
