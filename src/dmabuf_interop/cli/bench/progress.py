"""Progress on stderr: a tqdm bar over the cells on a terminal, else one line per cell."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["Progress"]


class Progress:
    """``say`` a line; ``cell`` a finished cell (advances the bar).

    tqdm (``pip install 'dmabuf-interop[bench]'``) draws the bar when stderr is
    a terminal and tqdm is installed; otherwise every line and cell is one line
    ``bench: ...`` on stderr, which is what logs and pipes want.
    """

    def __init__(self, cells: int) -> None:
        self._bar: Any = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=cells, unit="cell", file=sys.stderr, dynamic_ncols=True, leave=False)

    def say(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(f"bench: {line}", file=sys.stderr)
        else:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    def cell(self, line: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(line, refresh=False)
            self._bar.update(1)
        else:
            self.say(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
