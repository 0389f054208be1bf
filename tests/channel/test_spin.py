"""The adaptive spin's arithmetic (``Channel.spin = "auto"``), without a channel: Note [adaptive spin]."""

from __future__ import annotations

import pytest

from dmabuf_interop.channel._spin import (AUTO_SPIN_MAX, AUTO_SPIN_MIN_CPUS, SLACK, WAIT_CAP, AdaptiveSpin,
                                          usable_cpus)


def test_the_first_wait_spins_for_the_bound() -> None:
    assert AdaptiveSpin(cpus=AUTO_SPIN_MIN_CPUS).budget() == AUTO_SPIN_MAX


def test_short_waits_spin_twice_their_average_and_long_ones_not_at_all() -> None:
    spin = AdaptiveSpin(cpus=64)
    for _ in range(40):
        spin.observe(30e-6)
    assert spin.average == pytest.approx(30e-6, rel=1e-3)
    assert spin.budget() == pytest.approx(2 * 30e-6 + SLACK, rel=1e-3)
    for _ in range(40):
        spin.observe(0.5)  # half a second between messages
    assert spin.average == pytest.approx(WAIT_CAP, rel=1e-3)  # counted up to the cap
    assert spin.budget() == 0.0


def test_a_pace_that_quickens_turns_the_spin_back_on_within_six_waits() -> None:
    spin = AdaptiveSpin(cpus=64)
    spin.average = WAIT_CAP
    seen = []
    for _ in range(6):
        seen.append(spin.budget())
        spin.observe(30e-6)
    assert seen[:5] == [0.0] * 5 and spin.budget() > 0


def test_the_budget_never_exceeds_the_bound_and_a_wait_never_counts_below_zero() -> None:
    spin = AdaptiveSpin(cpus=64)
    spin.average = AUTO_SPIN_MAX
    assert spin.budget() == AUTO_SPIN_MAX
    spin.average = 0.0
    spin.observe(-1.0)  # (a clock read out of order)
    assert spin.average == 0.0 and spin.budget() == SLACK


def test_few_cpus_never_spin() -> None:
    spin = AdaptiveSpin(cpus=AUTO_SPIN_MIN_CPUS - 1)
    assert not spin.enabled
    for _ in range(10):
        spin.observe(10e-6)
    assert spin.budget() == 0.0
    assert AdaptiveSpin().enabled == (usable_cpus() >= AUTO_SPIN_MIN_CPUS)
    assert "budget=" in repr(spin)
