"""Grouping a transfer's blocks into runs of adjacent slots (pure)."""

from __future__ import annotations

from aiokvo.tiers.disk.runs import adjacent_runs, shares

SLOT = 8192


def runs(
    slots: list[int],
    *,
    slabs: list[int] | None = None,
    sizes: list[int] | None = None,
    iovecs: list[int] | None = None,
    order: list[int] | None = None,
    max_bytes: int = 1 << 20,
    max_iovecs: int = 1024,
) -> list[list[int]]:
    n = len(slots)
    return adjacent_runs(
        list(range(n)) if order is None else order,
        slabs or [0] * n,
        slots,
        sizes or [SLOT] * n,
        iovecs or [2] * n,
        slot_bytes=SLOT,
        max_bytes=max_bytes,
        max_iovecs=max_iovecs,
    )


def test_consecutive_slots_of_one_slab_are_one_run() -> None:
    assert runs([4, 5, 6, 7]) == [[0, 1, 2, 3]]
    assert runs([4, 5, 9, 10, 3]) == [[0, 1], [2, 3], [4]]
    assert runs([5, 4, 3]) == [[0, 1, 2]]  # descending: slots freed together come back so
    assert runs([5, 6, 5]) == [[0, 1], [2]]  # a run keeps one direction
    assert runs([7, 5, 6], order=[1, 2, 0]) == [[1, 2, 0]]
    assert runs([]) == []


def test_a_run_never_crosses_a_slab_or_a_gap() -> None:
    assert runs([0, 1, 2], slabs=[0, 0, 1]) == [[0, 1], [2]]
    assert runs([5, 4, 2, 1]) == [[0, 1], [2, 3]]  # descending, a free slot between
    assert runs([6, 5, 4, 3], slabs=[0, 0, 1, 1]) == [[0, 1], [2, 3]]
    # Block 1 leaves part of its slot unwritten: block 2 does not follow it in the file.
    assert runs([0, 1, 2, 3], sizes=[SLOT, 4096, SLOT, SLOT]) == [[0, 1], [2, 3]]
    # A short block may be last in the file, never followed there.
    assert runs([0, 1], sizes=[SLOT, 4096]) == [[0, 1]]
    assert runs([3, 2, 1], sizes=[4096, SLOT, SLOT]) == [[0, 1, 2]]
    assert runs([3, 2, 1], sizes=[SLOT, 4096, SLOT]) == [[0], [1, 2]]


def test_runs_stay_within_their_bytes_and_iovecs() -> None:
    assert runs(list(range(5)), max_bytes=2 * SLOT) == [[0, 1], [2, 3], [4]]
    assert runs(list(range(5)), max_iovecs=6) == [[0, 1, 2], [3, 4]]
    # A limit below one block: every block alone (one call each), none dropped.
    assert runs(list(range(3)), max_bytes=1) == [[0], [1], [2]]
    assert runs([0, 1], iovecs=[2000, 2000]) == [[0], [1]]


def test_shares_are_contiguous_balanced_and_never_empty() -> None:
    four = [[0], [1], [2], [3]]
    assert shares(four, 2) == [[[0], [1]], [[2], [3]]]
    assert shares(four, 1) == [four]
    assert shares([[0, 1, 2, 3], [4]], 2) == [[[0, 1, 2, 3]], [[4]]]
    assert shares([[0, 1, 2, 3, 4, 5]], 3) == [[[0, 1, 2, 3, 4, 5]]]  # a run is not cut
    assert shares([], 2) == []
    cut = shares([[i] for i in range(10)], 3)
    assert [run for part in cut for run in part] == [[i] for i in range(10)]
    assert len(cut) == 3 and max(map(len, cut)) - min(map(len, cut)) <= 1
