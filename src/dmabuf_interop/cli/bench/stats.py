"""The benchmark's one statistics shape: :class:`Stats` of a list of samples, and the percentile behind it.

Every median, p90 and p99 the tools report (latency cells, weight-sync steps, bandwidth, the Python
overhead, the remote bench's reads) is a :class:`Stats` field, computed one way: linear interpolation
between closest ranks, NumPy's default. The JSON keeps each tool's own keys (:meth:`Stats.to_json`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

__all__ = ["Stats", "percentile"]


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) by linear interpolation between closest ranks (NumPy's default).

    Raises:
        ValueError: no values.
    """
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


#: JSON key -> field, where a tool's key differs from the field's name.
_ALIASES = {"p50": "median"}


@dataclass(frozen=True, slots=True)
class Stats:
    """Order statistics of ``n`` samples, in the samples' unit (µs, ms, GB/s, a ratio)."""

    n: int
    median: float
    p10: float
    p90: float
    p99: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats | None:
        """The statistics of ``values``, or ``None`` for no values."""
        xs = sorted(values)
        if not xs:
            return None
        return cls(n=len(xs), median=percentile(xs, 50), p10=percentile(xs, 10), p90=percentile(xs, 90),
                   p99=percentile(xs, 99), min=xs[0], max=xs[-1])

    @property
    def spread(self) -> float:
        """The middle 80 % of the samples as a share of the median: ``(p90 - p10) / median``
        (``inf`` for a zero median with any spread, 0 for none)."""
        width = self.p90 - self.p10
        if self.median == 0:
            return 0.0 if width == 0 else float("inf")
        return width / abs(self.median)

    @property
    def median_error(self) -> float:
        """The standard error of the median, estimated from the p10-p90 width as for normally distributed
        samples: ``1.2533 * sigma / sqrt(n)`` with ``sigma = (p90 - p10) / 2.5631`` (0 for one sample)."""
        return 1.2533 * (self.p90 - self.p10) / 2.5631 / math.sqrt(self.n)

    def to_json(self, *keys: str, digits: int = 3) -> dict[str, float | int]:
        """``{key: value}`` for ``keys`` (field names; ``p50`` names the median), floats rounded to ``digits``."""
        return {key: self.n if key == "n" else round(getattr(self, _ALIASES.get(key, key)), digits) for key in keys}
