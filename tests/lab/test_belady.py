"""Belady's MIN: optimal against an exhaustive search, and a bound on every policy."""

from __future__ import annotations

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvo.lab.belady import belady_hits
from aiokvo.lab.replay import replay
from aiokvo.lab.trace import parse_trace
from aiokvo.manager.policies import BUILTIN_POLICIES
from tests.lab._traces import conversation_trace, traces


def optimum(flat: tuple[int, ...], capacity: int) -> int:
    """The most hits any pool of ``capacity`` blocks serves: every choice tried."""

    @cache
    def best(position: int, pool: frozenset[int]) -> int:
        if position == len(flat):
            return 0
        block = flat[position]
        hit = int(block in pool)
        rest = pool - {block}
        choices = [best(position + 1, rest)]  # drop it (or never keep it)
        if len(rest) < capacity:
            choices.append(best(position + 1, rest | {block}))
        else:
            choices += [best(position + 1, (rest - {out}) | {block}) for out in rest]
        return hit + max(choices)

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(
    flat=st.lists(st.integers(0, 5), min_size=1, max_size=12),
    capacity=st.integers(1, 3),
)
def test_min_serves_as_many_hits_as_an_exhaustive_search(flat: list[int], capacity: int) -> None:
    result = belady_hits([flat], capacity)
    assert result.hits == optimum(tuple(flat), capacity)
    assert result.references == len(flat)


@settings(max_examples=100, deadline=None)
@given(requests=traces, capacity=st.integers(1, 12))
def test_on_prefix_chains_min_keeps_every_prefix_it_needs(
    requests: list[list[int]], capacity: int
) -> None:
    """Its hits are all prefix hits, so it bounds the replay's measure exactly."""
    result = belady_hits(requests, capacity)
    assert result.prefix_hits == result.hits


@settings(max_examples=40, deadline=None)
@given(requests=traces, capacity=st.integers(1, 12))
def test_no_policy_beats_the_bound(requests: list[list[int]], capacity: int) -> None:
    lines = [f'{{"timestamp": {i}, "hash_ids": {ids}}}' for i, ids in enumerate(requests)]
    trace = parse_trace(lines)
    bound = belady_hits(trace.requests, capacity)
    for policy in BUILTIN_POLICIES:
        assert replay(trace.keys, policy, capacity).hits <= bound.hits, policy


def test_a_worked_example() -> None:
    # 1,2,3 | 1,2,4 | 1,2,3 with room for 3: keep 1,2,3, never 4 (not used again).
    result = belady_hits([[1, 2, 3], [1, 2, 4], [1, 2, 3]], 3)
    assert (result.hits, result.prefix_hits, result.references) == (5, 5, 9)
    assert belady_hits([[1, 2, 3], [1, 2, 4], [1, 2, 3]], 0).hits == 0
    assert belady_hits([[1, 2, 3], [1, 2, 4], [1, 2, 3]], 2).hits == 4


def test_a_bigger_pool_never_serves_fewer() -> None:
    requests = conversation_trace(7, 300)
    hits = [belady_hits(requests, capacity).hits for capacity in (1, 4, 16, 64, 256)]
    assert hits == sorted(hits)
    assert hits[-1] == sum(map(len, requests)) - len({b for r in requests for b in r})
