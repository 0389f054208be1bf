"""Sphinx configuration: the Markdown guides (read by MyST) and the API reference from the public docstrings.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(``pip install '.[docs]'`` first); ``-W`` turns every warning into an error.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # document the source tree

from dmabuf_interop import __version__  # noqa: E402

project = "dmabuf-interop"
release = version = __version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
# The guides link to each other's sections by their titles (``protocol.md#limits``), as GitHub renders them.
myst_heading_anchors = 3
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# cuda.bindings / cuda.core are imported lazily inside functions; nothing to mock at import time.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields: no second description of a property
html_theme = "alabaster"
