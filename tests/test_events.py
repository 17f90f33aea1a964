"""EventSubscription: bounded per-reader queues, overflow policies, the Lagged marker."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Collection

import pytest
import uvloop
from hypothesis import given, settings
from hypothesis import strategies as st

from aiokvo.errors import ConfigError, SubscriptionClosed
from aiokvo.events import EventSubscription, Lagged, SubscriptionItem
from aiokvo.keys import OffloadKey, make_offload_key
from aiokvo.manager.base import OffloadingManager
from aiokvo.manager.sink import EventSink
from aiokvo.specs import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    PrepareStoreOutput,
    ReqContext,
)


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def stored(i: int) -> OffloadingEvent:
    return OffloadingEvent(keys=[key(i)], medium="CPU", removed=False)


class TinyManager(OffloadingManager):
    """Just enough of a manager to publish events: stores always succeed, no eviction."""

    def __init__(self, enable_events: bool = False) -> None:
        self._sink = EventSink(record=enable_events)
        self._ready: set[OffloadKey] = set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return key in self._ready

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec([])

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), CPULoadStoreSpec(range(len(keys))), [])

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        if success:
            self._ready.update(keys)
            self._sink.publish(OffloadingEvent(list(keys), "CPU", removed=False))

    def evict(self, keys: Collection[OffloadKey]) -> None:
        self._ready.difference_update(keys)
        self._sink.publish(OffloadingEvent(list(keys), "CPU", removed=True))

    def store(self, i: int) -> None:
        self.prepare_store([key(i)], ReqContext())
        self.complete_store([key(i)])


def fill(sub: EventSubscription, indices: range) -> None:
    for i in indices:
        sub.push(stored(i))


# -- construction -------------------------------------------------------------


@pytest.mark.parametrize("maxsize", [0, -3, True, 2.5, "8"])
def test_invalid_maxsize_raises_config_error_naming_it(maxsize: object) -> None:
    with pytest.raises(ConfigError, match="maxsize") as info:
        EventSubscription(EventSink(record=False), maxsize=maxsize)  # type: ignore[arg-type]
    assert repr(maxsize) in str(info.value)


def test_invalid_overflow_raises_config_error_naming_it() -> None:
    sink = EventSink(record=False)
    with pytest.raises(ConfigError, match="'drop_all'"):
        EventSubscription(sink, overflow="drop_all")  # type: ignore[arg-type]
    assert not sink.active, "a rejected subscription must not stay attached"


def test_subscribe_attaches_and_passes_options() -> None:
    manager = TinyManager()
    sub = manager.subscribe(maxsize=7, overflow="drop_newest")
    assert (sub.maxsize, sub.overflow, sub.dropped, sub.closed) == (7, "drop_newest", 0, False)
    assert manager.sink.active
    manager.store(1)
    assert sub.drain_nowait() == [stored(1)]


# -- ordering and delivery ------------------------------------------------------


@pytest.mark.both_loops
async def test_events_arrive_in_manager_order() -> None:
    manager = TinyManager()
    async with manager.subscribe() as sub:
        manager.store(1)
        manager.evict([key(1)])
        manager.store(2)
        manager.store(3)
        got = [await sub.receive() for _ in range(4)]
    assert got == [
        stored(1),
        OffloadingEvent([key(1)], "CPU", removed=True),
        stored(2),
        stored(3),
    ]


@pytest.mark.both_loops
async def test_waiting_reader_is_woken_by_push() -> None:
    manager = TinyManager()
    sub = manager.subscribe()
    reader = asyncio.create_task(sub.receive())
    await asyncio.sleep(0)
    assert not reader.done()
    manager.store(5)
    assert await reader == stored(5)


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_push_before_the_loop_runs(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    manager = TinyManager()
    sub = manager.subscribe(maxsize=2)
    for i in range(3):  # no loop exists yet; one event overflows
        manager.store(i)

    async def read_all() -> list[SubscriptionItem]:
        manager.shutdown()
        return [item async for item in sub]

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(read_all()) == [Lagged(1), stored(1), stored(2)]


async def test_two_subscribers_at_different_speeds() -> None:
    manager = TinyManager()
    fast = manager.subscribe(maxsize=64)
    slow = manager.subscribe(maxsize=4)
    fast_seen: list[SubscriptionItem] = []
    produced = asyncio.Event()

    async def fast_reader() -> None:
        async for item in fast:
            fast_seen.append(item)

    async def slow_reader() -> list[SubscriptionItem]:
        await produced.wait()  # falls behind on purpose
        slow.close()
        return [item async for item in slow]

    fast_task = asyncio.create_task(fast_reader())
    slow_task = asyncio.create_task(slow_reader())
    for i in range(10):
        manager.store(i)  # synchronous: never waits for either reader
        await asyncio.sleep(0)
        assert fast_seen[-1] == stored(i), "the fast reader keeps up event by event"
    produced.set()
    assert await slow_task == [Lagged(6), stored(6), stored(7), stored(8), stored(9)]
    assert (fast.dropped, slow.dropped) == (0, 6)
    manager.shutdown()
    await fast_task
    assert fast_seen == [stored(i) for i in range(10)]


async def test_subscribers_are_independent() -> None:
    manager = TinyManager()
    tiny = manager.subscribe(maxsize=1, overflow="drop_newest")
    roomy = manager.subscribe(maxsize=100)
    for i in range(5):
        manager.store(i)
    assert roomy.drain_nowait() == [stored(i) for i in range(5)]
    assert tiny.drain_nowait() == [stored(0), Lagged(4)]


# -- overflow policies and the lag signal ----------------------------------------


def test_drop_oldest_keeps_newest_and_marks_the_gap_at_the_front() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=3, overflow="drop_oldest")
    fill(sub, range(7))
    assert sub.dropped == 4
    assert sub.qsize() == 3
    assert sub.drain_nowait() == [Lagged(4), stored(4), stored(5), stored(6)]
    assert sub.qsize() == 0


def test_drop_oldest_gap_follows_partial_reads() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=3, overflow="drop_oldest")
    fill(sub, range(4))  # [L1, e1, e2, e3]
    assert sub.receive_nowait() == Lagged(1)
    assert sub.receive_nowait() == stored(1)
    fill(sub, range(4, 7))  # e4 fits; e5 drops e2; e6 drops e3
    assert sub.drain_nowait() == [Lagged(2), stored(4), stored(5), stored(6)]
    assert sub.dropped == 3


def test_drop_oldest_merges_a_pending_marker() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=1, overflow="drop_oldest")
    fill(sub, range(3))
    assert sub.drain_nowait() == [Lagged(2), stored(2)]


def test_drop_newest_keeps_oldest_and_marks_the_gap_at_the_back() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=3, overflow="drop_newest")
    fill(sub, range(7))
    assert sub.dropped == 4
    assert sub.qsize() == 3
    assert sub.drain_nowait() == [stored(0), stored(1), stored(2), Lagged(4)]


def test_drop_newest_events_after_catching_up_follow_the_marker() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=3, overflow="drop_newest")
    fill(sub, range(7))  # [e0, e1, e2, L4]
    assert sub.receive_nowait() == stored(0)
    fill(sub, range(7, 9))  # e7 fits; e8 is dropped into a new gap after it
    assert sub.drain_nowait() == [stored(1), stored(2), Lagged(4), stored(7), Lagged(1)]
    assert sub.dropped == 5


@pytest.mark.parametrize(
    ("overflow", "expected"),
    [
        ("drop_oldest", [Lagged(3), stored(3), stored(4)]),
        ("drop_newest", [stored(0), stored(1), Lagged(3)]),
    ],
)
async def test_async_for_sees_the_lag_marker_in_place(
    overflow: str, expected: list[SubscriptionItem]
) -> None:
    manager = TinyManager()
    sub = manager.subscribe(maxsize=2, overflow=overflow)  # type: ignore[arg-type]
    for i in range(5):
        manager.store(i)
    manager.shutdown()
    assert [item async for item in sub] == expected
    assert sub.dropped == 3


def test_markers_do_not_count_against_maxsize() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=2, overflow="drop_newest")
    fill(sub, range(3))  # [e0, e1, L1]
    assert sub.receive_nowait() == stored(0)
    fill(sub, range(3, 4))  # one event of room: e3 must be kept
    assert sub.qsize() == 2
    assert sub.dropped == 1
    assert sub.drain_nowait() == [stored(1), Lagged(1), stored(3)]


@settings(max_examples=150, derandomize=True, deadline=None)
@given(
    maxsize=st.integers(1, 5),
    overflow=st.sampled_from(["drop_oldest", "drop_newest"]),
    ops=st.lists(st.integers(0, 3), max_size=60),
)
def test_markers_account_for_exactly_the_missing_events(
    maxsize: int, overflow: str, ops: list[int]
) -> None:
    """Walking the stream, each Lagged(n) skips exactly n event numbers, in place."""
    sub = EventSubscription(
        EventSink(record=False),
        maxsize=maxsize,
        overflow=overflow,  # type: ignore[arg-type]
    )
    pushed = 0
    stream: list[SubscriptionItem] = []
    for op in ops:  # 0-2: push that many events; 3: read one item if any
        if op == 3:
            with contextlib.suppress(asyncio.QueueEmpty):
                stream.append(sub.receive_nowait())
            continue
        for _ in range(op):
            sub.push(stored(pushed))
            pushed += 1
        assert sub.qsize() <= maxsize
    buffered = sub.drain_nowait()
    for first, second in itertools.pairwise(buffered):
        assert not (isinstance(first, Lagged) and isinstance(second, Lagged)), "gaps merge"
    stream.extend(buffered)

    expected_next = 0
    for item in stream:
        if isinstance(item, Lagged):
            assert item.missed >= 1
            expected_next += item.missed
        else:
            assert item == stored(expected_next)
            expected_next += 1
    assert expected_next == pushed
    assert sum(i.missed for i in stream if isinstance(i, Lagged)) == sub.dropped


# -- receiving -------------------------------------------------------------------


async def test_receive_nowait_on_empty_raises_queue_empty() -> None:
    sub = TinyManager().subscribe()
    with pytest.raises(asyncio.QueueEmpty):
        sub.receive_nowait()
    assert sub.drain_nowait() == []


async def test_cancelled_reader_passes_its_wakeup_on() -> None:
    sub = TinyManager().subscribe()
    first = asyncio.create_task(sub.receive())
    second = asyncio.create_task(sub.receive())
    await asyncio.sleep(0)
    sub.push(stored(1))  # wakes `first`
    first.cancel()  # ...which is cancelled before it runs
    assert await second == stored(1)
    assert first.cancelled()


# -- closing -----------------------------------------------------------------------


@pytest.mark.both_loops
async def test_close_ends_a_waiting_reader_after_it_drains() -> None:
    manager = TinyManager()
    sub = manager.subscribe()
    seen: list[SubscriptionItem] = []

    async def reader() -> None:
        async for item in sub:
            seen.append(item)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0)
    manager.store(1)
    manager.store(2)
    sub.close()
    manager.store(3)  # detached: never delivered
    await task
    assert seen == [stored(1), stored(2)]


async def test_close_detaches_from_the_manager() -> None:
    manager = TinyManager()
    sub = manager.subscribe()
    assert manager.sink.active
    sub.close()
    sub.close()  # idempotent
    assert sub.closed
    assert not manager.sink.active
    sub.push(stored(9))  # a late push after close is ignored
    assert sub.qsize() == 0
    with pytest.raises(SubscriptionClosed):
        await sub.receive()
    with pytest.raises(SubscriptionClosed):
        sub.receive_nowait()


async def test_async_with_and_aclose_detach() -> None:
    manager = TinyManager()
    async with manager.subscribe() as sub:
        manager.store(1)
    assert sub.closed and not manager.sink.active
    assert await sub.receive() == stored(1), "buffered events stay readable after close"

    other = manager.subscribe()
    await other.aclose()
    assert other.closed and not manager.sink.active


async def test_shutdown_closes_every_subscription() -> None:
    manager = TinyManager()
    subs = [manager.subscribe() for _ in range(3)]
    waiting = [asyncio.create_task(sub.receive()) for sub in subs]
    await asyncio.sleep(0)
    manager.shutdown()
    for task in waiting:
        with pytest.raises(SubscriptionClosed):
            await task
    assert all(sub.closed for sub in subs)


# -- recording and subscribing are independent -----------------------------------


@pytest.mark.parametrize("enable_events", [False, True])
async def test_subscription_works_with_and_without_recording(enable_events: bool) -> None:
    manager = TinyManager(enable_events=enable_events)
    sub = manager.subscribe()
    manager.store(1)
    manager.evict([key(1)])
    expected = [stored(1), OffloadingEvent([key(1)], "CPU", removed=True)]
    assert sub.drain_nowait() == expected
    assert list(manager.take_events()) == (expected if enable_events else [])


def test_repr_shows_state() -> None:
    sub = EventSubscription(EventSink(record=False), maxsize=2)
    fill(sub, range(3))
    assert repr(sub) == ("<EventSubscription open queued=2/2 overflow='drop_oldest' dropped=1>")


# -- with the real manager -----------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("enable_events", [False, True])
async def test_real_manager_stream_replays_to_the_ready_set(
    policy: str, enable_events: bool
) -> None:
    from aiokvo.manager.cpu import CPUOffloadingManager

    manager = CPUOffloadingManager(num_blocks=3, cache_policy=policy, enable_events=enable_events)
    sub = manager.subscribe(maxsize=100)
    ctx = ReqContext()
    for batch in ([0, 1], [2, 3], [4], [5, 6]):
        keys = [key(i) for i in batch]
        out = manager.prepare_store(keys, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store)
    failed = manager.prepare_store([key(7)], ctx)
    assert failed is not None
    manager.complete_store(failed.keys_to_store, success=False)  # no "stored" event
    manager.shutdown()

    ready: set[OffloadKey] = set()
    items = [item async for item in sub]
    for item in items:
        assert isinstance(item, OffloadingEvent)
        if item.removed:
            assert set(item.keys) <= ready, "only stored keys are ever removed"
            ready.difference_update(item.keys)
        else:
            ready.update(item.keys)
    assert ready == {k for k in map(key, range(8)) if manager.lookup(k, ctx)}
    assert len(ready) <= 3
    assert key(7) not in ready
    # No block was ever touched, so both policies evict in insertion order.
    expected = [
        ([0, 1], False),
        ([0], True),
        ([2, 3], False),
        ([1], True),
        ([4], False),
        ([2, 3], True),
        ([5, 6], False),
        ([4], True),
    ]
    assert items == [OffloadingEvent([key(i) for i in ids], "CPU", r) for ids, r in expected]
    recorded = list(manager.take_events())
    assert recorded == (items if enable_events else [])


async def test_real_manager_eviction_event_comes_before_the_store() -> None:
    from aiokvo.manager.cpu import CPUOffloadingManager

    manager = CPUOffloadingManager(num_blocks=1)
    async with manager.subscribe() as sub:
        ctx = ReqContext()
        for i in range(2):
            out = manager.prepare_store([key(i)], ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store)
        assert sub.drain_nowait() == [
            OffloadingEvent([key(0)], "CPU", removed=False),
            OffloadingEvent([key(0)], "CPU", removed=True),
            OffloadingEvent([key(1)], "CPU", removed=False),
        ]


async def test_reuse_filter_subscription_sees_the_backing_events() -> None:
    from aiokvo.manager.cpu import CPUOffloadingManager
    from aiokvo.manager.reuse import FilterReusedOffloadingManager

    manager = FilterReusedOffloadingManager(CPUOffloadingManager(num_blocks=4), store_threshold=2)
    sub = manager.subscribe(maxsize=1, overflow="drop_newest")
    ctx = ReqContext()
    for i in range(3):
        for _ in range(2):
            manager.lookup(key(i), ctx)
        out = manager.prepare_store([key(i)], ctx)
        assert out is not None and out.keys_to_store == [key(i)]
        manager.complete_store(out.keys_to_store)
    manager.shutdown()
    assert [item async for item in sub] == [stored(0), Lagged(2)]
    assert sub.dropped == 2


def test_statistics_snapshot_queue_drops_and_closing() -> None:
    sink = EventSink(record=False)
    sub = EventSubscription(sink, maxsize=2, overflow="drop_newest")
    fill(sub, range(5))
    stats = sub.statistics()
    assert (stats.maxsize, stats.overflow, stats.queued, stats.dropped) == (2, "drop_newest", 2, 3)
    assert not stats.closed
    sub.drain_nowait()
    sub.close()
    assert sub.statistics().queued == 0 and sub.statistics().closed
    assert stats.queued == 2  # a snapshot does not change afterwards


# -- abandoned subscriptions -----------------------------------------------------


async def test_a_subscription_dropped_without_close_detaches() -> None:
    import gc
    import weakref

    manager = TinyManager()

    async def first_event() -> OffloadingEvent | None:
        sub = manager.subscribe()
        manager.store(1)
        async for item in sub:  # returns without closing the subscription
            assert isinstance(item, OffloadingEvent)
            return item
        return None

    for _ in range(300):
        assert await first_event() == stored(1)
    gc.collect()  # CPython frees them at once; other interpreters need a collection
    assert len(manager.sink) == 0 and not manager.sink.active
    kept = manager.subscribe()
    dropped = weakref.ref(manager.subscribe())
    gc.collect()
    assert dropped() is None
    assert len(manager.sink) == 1  # only the one still referenced
    manager.store(2)
    assert kept.drain_nowait() == [stored(2)]


async def test_a_reader_keeps_an_otherwise_unreferenced_subscription_alive() -> None:
    import gc

    manager = TinyManager()

    async def read_two() -> list[SubscriptionItem]:
        sub = manager.subscribe()
        return [await sub.receive(), await sub.receive()]

    reader = asyncio.create_task(read_two())
    await asyncio.sleep(0)
    gc.collect()
    assert len(manager.sink) == 1
    manager.store(1)
    manager.store(2)
    assert await asyncio.wait_for(reader, 5) == [stored(1), stored(2)]
    gc.collect()
    assert len(manager.sink) == 0


def test_the_sink_holds_any_subscriber_weakly() -> None:
    import gc

    sink = EventSink(record=False)

    class Counter:
        def __init__(self) -> None:
            self.seen = 0

        def push(self, event: OffloadingEvent) -> None:
            self.seen += 1

        def close(self) -> None:
            pass

    kept = Counter()
    sink.attach(kept)
    sink.attach(Counter())  # nobody keeps this one
    gc.collect()
    assert len(sink) == 1
    sink.publish(stored(1))
    assert kept.seen == 1


def test_a_subscriber_that_cannot_be_held_weakly_is_refused() -> None:
    class Slotted:
        __slots__ = ()

        def push(self, event: OffloadingEvent) -> None:
            pass

        def close(self) -> None:
            pass

    sink = EventSink(record=False)
    with pytest.raises(ConfigError, match="weakly referenceable"):
        sink.attach(Slotted())
    assert len(sink) == 0
