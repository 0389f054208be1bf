"""``dmabuf-interop bench`` (placeholder until the benchmark lands)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def main(args: argparse.Namespace) -> int:
    print("bench: not implemented yet")
    return 1
