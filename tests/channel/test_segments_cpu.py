"""How torch's pages are grouped into segment chunks (``segments.group_runs``): pure bookkeeping, no GPU."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dmabuf_interop.channel.segments import group_runs

MiB = 1 << 20


def pages(first: int, count: int, size: int = 20 * MiB) -> list[tuple[int, int]]:
    return [((first + k) * size, size) for k in range(count)]


def test_tensors_whose_pages_touch_share_one_chunk_and_a_gap_starts_another() -> None:
    runs = group_runs({"a": pages(0, 2), "b": pages(1, 3), "c": pages(4, 1), "d": pages(10, 2)})
    assert runs == [(pages(0, 5), ["a", "b", "c"]), (pages(10, 2), ["d"])]


def test_a_run_never_passes_max_parts_pages_and_the_next_starts_at_a_tensors_first_page() -> None:
    runs = group_runs({"a": pages(0, 3), "b": pages(2, 3)}, max_parts=4)
    assert runs == [(pages(0, 3), ["a"]), (pages(2, 3), ["b"])]  # they share page 2


def test_a_tensor_inside_a_run_adds_no_page() -> None:
    assert group_runs({"big": pages(0, 6), "inner": pages(2, 1)}, max_parts=6) == [(pages(0, 6), ["big", "inner"])]


@st.composite
def requests(draw):
    n = draw(st.integers(1, 12))
    out = {}
    for i in range(n):
        first = draw(st.integers(0, 40))
        out[i] = pages(first, draw(st.integers(1, 5)))
    return out, draw(st.integers(5, 12))


@settings(max_examples=300)
@given(requests())
def test_every_request_lies_in_exactly_one_contiguous_run_of_at_most_max_parts(case) -> None:
    reqs, max_parts = case
    runs = group_runs(reqs, max_parts)
    seen = [k for _, keys in runs for k in keys]
    assert sorted(seen) == sorted(reqs)
    for run_pages, keys in runs:
        assert 1 <= len(run_pages) <= max_parts
        assert all(a + n == b for (a, n), (b, _) in zip(run_pages, run_pages[1:]))  # contiguous, no repeats
        for k in keys:
            assert set(reqs[k]) <= set(run_pages)
