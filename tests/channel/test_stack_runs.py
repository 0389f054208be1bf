"""Runs of like items that one strided view holds (``channel._torch_views.stack_runs``): which items join, that each
run gives the items' own (shape, strides, offset), and when a batch's tensors are cut from runs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel._torch_views import STACK_MIN, stack_runs


def _moe_plans(layers: int = 3, experts: int = 32) -> list[Any]:
    """view plans of a MoE-shaped batch laid out back to back in one chunk (256-byte blocks, bf16)."""
    plans: list[Any] = []
    off = 0

    def add(shape: tuple[int, ...], nbytes: int) -> None:
        nonlocal off
        strides = tuple(int(s) for s in _c_strides(shape))
        plans.append(((0, "bfloat16"), (shape, strides, off // 2)))
        off += -(-nbytes // 256) * 256

    for _ in range(layers):
        add((64, 32), 64 * 32 * 2)  # attention weight
        add((32,), 64)              # a norm
        add((experts, 32), experts * 32 * 2)  # the router
        for _ in range(experts):
            add((48, 32), 48 * 32 * 2)  # gate
            add((48, 32), 48 * 32 * 2)  # up
            add((32, 48), 32 * 48 * 2)  # down
    return plans


def _c_strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _check(plans: list[Any], runs: list[Any], singles: list[int], min_run: int) -> None:
    seen = [i for r in runs for i in r[5]] + singles
    assert sorted(seen) == list(range(len(plans)))  # every item once
    for key, shape, strides, first, delta, idx in runs:
        assert len(idx) >= min_run and delta > 0
        assert list(idx) == sorted(idx)  # in batch order
        for k, i in enumerate(idx):
            assert plans[i] == (key, (shape, strides, first + k * delta))


def test_experts_laid_out_in_turn_form_runs_and_the_rest_stays_single() -> None:
    plans = _moe_plans()
    runs, singles = stack_runs(plans)
    _check(plans, runs, singles, STACK_MIN)
    # per layer: gate and up (same shape, every other item) and down, one run of 32 each
    assert sorted(len(r[5]) for r in runs) == [32] * 9
    # the attention weights, norms and routers step evenly across layers, but there are only 3 of each
    assert len(singles) == 9


def test_fewer_like_items_than_a_run_stay_single() -> None:
    plans = [((0, "float32"), ((4,), (1,), 64 * i)) for i in range(STACK_MIN - 1)]
    assert stack_runs(plans) == ([], list(range(STACK_MIN - 1)))


def test_items_at_one_offset_or_stepping_back_form_no_run() -> None:
    same = [((0, "int8"), ((16,), (1,), 0)) for _ in range(20)]
    back = [((0, "int8"), ((16,), (1,), 1000 - 16 * i)) for i in range(20)]
    assert stack_runs(same) == ([], list(range(20)))
    assert stack_runs(back) == ([], list(range(20)))


_plan = st.tuples(st.tuples(st.integers(0, 2), st.sampled_from(["float32", "int8"])),
                  st.tuples(st.sampled_from([(4,), (2, 3)]), st.sampled_from([(1,), (3, 1)]),
                            st.integers(0, 64).map(lambda k: 16 * k)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_plan, max_size=80), st.integers(2, 10))
def test_runs_and_singles_partition_any_batch_and_give_each_items_own_view(plans: list[Any], min_run: int) -> None:
    runs, singles = stack_runs(plans, min_run)
    _check(plans, runs, singles, min_run)


def test_a_run_cut_from_one_view_gives_the_same_tensors_as_one_as_strided_each() -> None:
    torch = pytest.importorskip("torch")
    plans = _moe_plans(layers=2, experts=16)
    base = torch.arange(max(p[1][2] for p in plans) + 4096, dtype=torch.float32).to(torch.bfloat16)
    runs, _ = stack_runs(plans)
    assert runs
    for key, shape, strides, first, delta, idx in runs:
        cut = base.as_strided((len(idx), *shape), (delta, *strides), first).unbind(0)
        for i, t in zip(idx, cut):
            one = base.as_strided(*plans[i][1])
            assert (t.shape, t.stride(), t.storage_offset()) == (one.shape, one.stride(), one.storage_offset())
            assert torch.equal(t, one)


def _cpu_batch(torch: Any, layout: Any, plans: list[Any]) -> tuple[Any, list[Any]]:
    """``BatchViews`` over one CPU tensor per (chunk, dtype) instead of a mapped chunk, and items that
    carry only what ``tensors`` reads: their descriptor's view plan and their chunk."""
    from types import SimpleNamespace

    from dmabuf_interop.channel._torch_views import BatchViews

    chunk = torch.arange(max(p[1][2] for p in plans) + 4096, dtype=torch.float32)

    class CpuViews(BatchViews):
        def _base(self, chunk_: Any, torch_: Any, dtype: Any, keep: Any) -> Any:
            return chunk.to(dtype)

    items = [SimpleNamespace(descriptor=SimpleNamespace(view_plan=p), _chunk=None) for p in plans]
    return CpuViews(layout), items


def test_runs_are_cut_outside_grad_mode_from_a_layouts_second_batch_on() -> None:
    torch = pytest.importorskip("torch")
    from dmabuf_interop.channel._torch_views import LayoutViews

    plans = _moe_plans(layers=1, experts=16)
    layout = LayoutViews()
    with torch.no_grad():
        first = _cpu_batch(torch, layout, plans)
        one = first[0].tensors(first[1], torch)
        assert layout.cached is not None and layout.cached[1] is None  # first sight: one as_strided each
        second = _cpu_batch(torch, layout, plans)
        cut = second[0].tensors(second[1], torch)
        assert layout.cached[1] is not None and sum(len(r[5]) for r in layout.cached[1][0]) == 48
        for a, b in zip(one, cut):
            assert (a.shape, a.stride(), a.storage_offset()) == (b.shape, b.stride(), b.storage_offset())
            assert torch.equal(a, b)
        part = _cpu_batch(torch, layout, plans[:20])  # other items than the layout's: one as_strided each
        assert len(part[0].tensors(part[1], torch)) == 20 and layout.cached[0] == plans


def test_in_grad_mode_each_item_may_be_written_in_place_with_an_operand_that_requires_grad() -> None:
    torch = pytest.importorskip("torch")
    from dmabuf_interop.channel._torch_views import LayoutViews

    plans = _moe_plans(layers=1, experts=16)
    layout = LayoutViews()
    for _ in range(2):
        views, items = _cpu_batch(torch, layout, plans)
        got = views.tensors(items, torch)
    assert layout.cached is None  # grad mode never asks for runs
    ema = torch.ones(got[3].shape, dtype=got[3].dtype, requires_grad=True)
    got[3].mul_(0.9).add_(ema, alpha=0.1)  # an unbind output would refuse this
    assert got[3].requires_grad
