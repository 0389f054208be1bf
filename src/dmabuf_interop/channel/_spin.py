"""The adaptive spin of a consumer's ``recv`` (``Channel.spin = "auto"``): how long to poll the shared-memory ring
before sleeping, learned from how long the last waits lasted. Pure: no clock, no I/O (the reader measures the
waits and asks for the next budget).

Note [adaptive spin]. A slot that lands while ``recv`` spins is taken without waking a sleeping thread (20-40 µs
on the machines measured), but a spin burns a CPU for as long as it lasts when nothing lands. A consumer fed at a
steady pace waits about as long each time: spinning a little past that wait catches the slot, and spinning where
the waits run longer than any bound worth burning only costs CPU. So :class:`AdaptiveSpin` keeps a moving average
of the waits (:meth:`AdaptiveSpin.observe`, each wait counted up to :data:`WAIT_CAP`, the newest weighing
:data:`WEIGHT`), and :meth:`AdaptiveSpin.budget` is twice that average plus :data:`SLACK`, at most
:data:`AUTO_SPIN_MAX`, and nothing while the average is over :data:`AUTO_SPIN_MAX`. A consumer that sleeps still
measures its waits (from the start of the wait to the wake-up), so a pace that quickens turns the spin back on:
from the capped average, six waits of 30 µs do it. The CPU a ``recv`` burns is at most :data:`AUTO_SPIN_MAX` per
wait; a consumer whose messages come further apart than the bound spins for none of it. On a machine where this
process may run on fewer than :data:`AUTO_SPIN_MIN_CPUS` CPUs ``"auto"`` never spins: there a spinning consumer
takes the CPU its producer needs.
"""

from __future__ import annotations

import os

__all__ = ["AUTO", "AUTO_SPIN_MAX", "AUTO_SPIN_MIN_CPUS", "AdaptiveSpin", "SLACK", "WAIT_CAP", "WEIGHT",
           "usable_cpus"]

#: The value of ``spin`` (``Channel.spin``, ``recv(spin=)``, ``listen``/``connect``) that asks for the adaptive spin.
AUTO = "auto"
#: The longest adaptive spin of one wait, seconds.
AUTO_SPIN_MAX = 200e-6
#: Fewer CPUs than this for the process (``sched_getaffinity``): ``"auto"`` does not spin.
AUTO_SPIN_MIN_CPUS = 4
#: Added to twice the average wait, seconds: a wait a little longer than the average is still caught.
SLACK = 10e-6
#: A wait counts for at most this long in the average, seconds: an idle minute is not remembered as one.
WAIT_CAP = 4 * AUTO_SPIN_MAX
#: The newest wait's weight in the average.
WEIGHT = 0.25


def usable_cpus() -> int:
    """The CPUs this process may run on (``sched_getaffinity``; ``os.cpu_count()`` where that is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class AdaptiveSpin:
    """One channel's adaptive spin (Note [adaptive spin]). Used by the one thread that reads the channel at a time
    (under its read lock): no lock of its own.

    Args:
        cpus: the CPUs the process may run on (default :func:`usable_cpus`); under :data:`AUTO_SPIN_MIN_CPUS` the
            budget is always 0.

    Attributes:
        average: the moving average of the waits seen, seconds (it starts at half :data:`AUTO_SPIN_MAX`, so the
            first wait spins for the whole bound and is measured).
        enabled: whether this machine has the CPUs to spin.
    """

    __slots__ = ("average", "enabled")

    def __init__(self, cpus: int | None = None) -> None:
        self.average = AUTO_SPIN_MAX / 2
        self.enabled = (usable_cpus() if cpus is None else cpus) >= AUTO_SPIN_MIN_CPUS

    def budget(self) -> float:
        """Seconds to spin before the next sleep: ``min(2 * average + SLACK, AUTO_SPIN_MAX)``, or 0 while the
        average is over :data:`AUTO_SPIN_MAX` or the machine has too few CPUs."""
        average = self.average
        if not self.enabled or average > AUTO_SPIN_MAX:
            return 0.0
        return min(2 * average + SLACK, AUTO_SPIN_MAX)

    def observe(self, waited: float) -> None:
        """A wait of ``waited`` seconds ended (a slot seen during the spin, or a wake-up, or the timeout)."""
        self.average += (min(max(waited, 0.0), WAIT_CAP) - self.average) * WEIGHT

    def __repr__(self) -> str:
        return f"<AdaptiveSpin average={self.average * 1e6:.1f}us budget={self.budget() * 1e6:.1f}us>"
