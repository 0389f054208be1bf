"""The command-line tools: ``dmabuf-interop`` (the demos), ``info`` and ``bench``.

They compose library calls only; all demo wording lives in :mod:`.demos`.
"""

from __future__ import annotations

from .main import build_parser, main

__all__ = ["main", "build_parser"]
