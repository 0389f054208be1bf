"""``dmabuf-interop info`` (placeholder until the report lands)."""

from __future__ import annotations


def main(json_output: bool = False, timeout: float = 60.0) -> int:
    print("info: not implemented yet")
    return 1
