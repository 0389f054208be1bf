"""``dmabuf-interop bench``: sharing mechanisms measured against what users use today."""

from __future__ import annotations

from .runner import add_arguments, main

__all__ = ["add_arguments", "main"]
