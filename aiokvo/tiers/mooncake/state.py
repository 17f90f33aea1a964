"""``MooncakeTierState``: the Mooncake tier's pure core (decisions, no I/O).

The cluster owns placement and eviction, so unlike the disk tier this core
allocates nothing. It decides, from what the tier has seen (DESIGN.md,
"Tiers": "an index of what it has seen and a negative cache"):

* whether the cluster may be used now: connected, and the circuit breaker
  closed (a trial while it is half-open is the tier's own probe, never a
  caller's lookup);
* which keys a lookup asks the cluster about (those before the first key
  in the negative cache) and what the answers mean;
* what a read or a write that ended means, block by block (the spec's
  :class:`~aiokvo.tiers.mooncake.spec.BlockReport`): good blocks are indexed;
  a block whose get failed after the cluster said it exists goes into the
  negative cache for ``negative_ttl`` seconds, so one lost segment does not
  cause a storm of doomed gets; a block whose bytes are wrong is to be removed
  from the cluster; a call that failed as a whole counts against the breaker;
* which keys to write: admitted by the filter, not being written by us, not
  seen in the cluster within ``index_ttl`` seconds, not in the negative cache.

Events (medium ``"MOONCAKE"``) go to the shared sink: a block this tier wrote
(the cluster answered 0), and the removal of a block it had announced once a
read shows it is gone. Every call takes ``now`` (seconds, any monotonic
clock), so a test drives it with a fake clock. Pure and synchronous.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokvo.keys import OffloadKey
from aiokvo.manager.sink import EventSink
from aiokvo.specs import OffloadingEvent
from aiokvo.tiers.admission import Admission
from aiokvo.tiers.base import TierLoad, TierStore
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.counters import TierCounters
from aiokvo.tiers.mooncake.spec import (
    BAD_OBJECT,
    FAILED_CALL,
    MOONCAKE_MEDIUM,
    STALE_EXISTS,
    BlockStatus,
    MooncakeLoadStoreSpec,
)

__all__ = ["MooncakeTierState"]

NameOf = Callable[[OffloadKey], str]

_NEVER = float("-inf")


@dataclass(slots=True, eq=False)
class _Ticket:
    """A transfer's private bookkeeping (``TierLoad.state`` / ``TierStore.state``)."""

    timed_out: bool = False


@dataclass(slots=True)
class _Seen:
    at: float  # when the cluster last said (or showed) it holds the block
    ours: bool  # this tier announced it (a "stored" event went out)


class MooncakeTierState(TierCounters):
    """The Mooncake tier's decisions; see the module docstring.

    ``name_of`` gives a key's object name; ``sink`` receives the tier's
    events. ``max_tracked`` bounds the index and the negative cache (oldest
    forgotten first) as well as the admission filter.
    """

    def __init__(
        self,
        name_of: NameOf,
        *,
        admit_after: int = 1,
        max_tracked: int = 64_000,
        negative_ttl: float = 10.0,
        index_ttl: float = 10.0,
        breaker: CircuitBreaker | None = None,
        sink: EventSink | None = None,
    ) -> None:
        super().__init__()
        self.name_of = name_of
        self.admission = Admission(admit_after, max_tracked)
        self.breaker = breaker or CircuitBreaker()
        self.max_tracked = max_tracked
        self.negative_ttl = negative_ttl
        self.index_ttl = index_ttl
        self._sink = sink
        self.connected = False
        self._index: OrderedDict[OffloadKey, _Seen] = OrderedDict()
        self._negative: OrderedDict[OffloadKey, float] = OrderedDict()  # key -> expiry
        self._writing: set[OffloadKey] = set()
        self._removals: list[str] = []
        # Counters beyond TierCounters' (see MooncakeTierStatistics).
        self.remote_lookups = self.lookup_failures = self.negative_hits = self.rpc_failures = 0
        self.by_status: dict[BlockStatus, int] = dict.fromkeys(BlockStatus, 0)

    # ---------------------------------------------------------------- views
    def usable(self, now: float) -> bool:
        """Whether callers' lookups and transfers may go to the cluster now."""
        return self.connected and self.breaker.state(now) == "closed"

    def needs_probe(self, now: float) -> bool:
        """Whether the tier's own probe (a reconnection, or the breaker's
        half-open trial) is due now."""
        return not self.connected or self.breaker.state(now) == "half_open"

    @property
    def indexed(self) -> int:
        """Keys the tier has seen in the cluster (bounded by ``max_tracked``)."""
        return len(self._index)

    def negative(self, now: float) -> int:
        """Keys in the negative cache now."""
        self._expire(now)
        return len(self._negative)

    @property
    def writing(self) -> int:
        """Keys with a write of ours in flight."""
        return len(self._writing)

    def is_negative(self, key: OffloadKey, now: float) -> bool:
        expiry = self._negative.get(key)
        if expiry is None:
            return False
        if expiry <= now:
            del self._negative[key]
            return False
        return True

    def is_fresh(self, key: OffloadKey, now: float) -> bool:
        """The cluster held ``key`` less than ``index_ttl`` seconds ago (as far as we saw)."""
        seen = self._index.get(key)
        return seen is not None and now - seen.at < self.index_ttl

    # ----------------------------------------------------------- connection
    def set_connected(self, connected: bool, now: float) -> None:
        """The client was set up (or lost). A new connection trusts nothing it saw."""
        if connected and not self.connected:
            self._forget_freshness()
        self.connected = connected

    def record_probe(self, ok: bool, now: float) -> None:
        """The outcome of the tier's own probe (the breaker's trial)."""
        if ok:
            self.breaker.record_success(now)
        else:
            self._record_failure(now)

    def _record_failure(self, now: float) -> None:
        was_open = self.breaker.state(now) != "closed"
        self.breaker.record_failure(now)
        if not was_open and self.breaker.state(now) != "closed":
            # Tripped: the cluster may have lost everything (a master restart does).
            self._forget_freshness()

    def _forget_freshness(self) -> None:
        for seen in self._index.values():
            seen.at = _NEVER

    # -------------------------------------------------------------- lookups
    def begin_lookup(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey] | None:
        """The keys of a lookup to ask the cluster about: those before the first key
        in the negative cache (maybe none); None when the cluster may not be used
        now (counted as bypassed: the lookup answers 0).
        """
        self.lookups += 1
        if not self.usable(now):
            self.lookups_bypassed += 1
            return None
        for i, key in enumerate(keys):
            if self.is_negative(key, now):
                self.negative_hits += 1
                return list(keys[:i])
        return list(keys)

    def finish_lookup(
        self, keys: Sequence[OffloadKey], asked: Sequence[OffloadKey],
        answers: Sequence[int] | None, now: float,
    ) -> int:  # fmt: skip
        """How many leading ``keys`` the cluster holds, given its ``answers`` for
        ``asked`` (a prefix of ``keys``; None: the call failed or timed out)."""
        n = 0
        if answers is not None:
            for key, answer in zip(asked, answers, strict=True):
                if answer != 1:
                    break
                self._see(key, now)
                n += 1
        if n < len(keys):
            self.lookup_misses += 1
        self.lookup_hits += n
        return n

    def record_lookup_call(self, ok: bool, now: float) -> None:
        """One ``batch_is_exist`` ended (``ok``: every answer was 0 or 1)."""
        self.remote_lookups += 1
        if ok:
            self.breaker.record_success(now)
        else:
            self.lookup_failures += 1
            self._record_failure(now)

    # ---------------------------------------------------------------- reads
    def prepare_read(self, keys: Sequence[OffloadKey], now: float) -> TierLoad | None:
        """A read of ``keys`` (found by a lookup), or None if the cluster may not be used."""
        if not keys:
            return None
        if not self.usable(now):
            self.breaker.reject()
            return None
        spec = MooncakeLoadStoreSpec(keys, [self.name_of(k) for k in keys])
        return TierLoad(list(keys), spec, _Ticket())

    def complete_read(
        self, load: TierLoad, *, now: float, nbytes: int = 0, seconds: float = 0.0
    ) -> list[OffloadKey]:
        """The read of ``load`` ended (its spec's report says how); the good keys."""
        spec = load.spec
        assert isinstance(spec, MooncakeLoadStoreSpec)
        good: list[OffloadKey] = []
        gone: list[OffloadKey] = []
        failed_call = False
        for key, name, status in zip(spec.keys, spec.names, spec.report.status, strict=True):
            self.by_status[status] += 1
            if status is BlockStatus.OK:
                good.append(key)
                self._see(key, now)
                continue
            self.read_failures += 1
            if status in FAILED_CALL:
                failed_call = True
            if status in STALE_EXISTS:
                self._remember_absent(key, now)
                seen = self._index.pop(key, None)
                if seen is not None and seen.ours:
                    gone.append(key)
            if status in BAD_OBJECT:
                self._removals.append(name)
        if gone:
            self._publish(gone, removed=True)
        self.reads += 1
        self.blocks_read += len(good)
        self.bytes_read += nbytes
        self.read_seconds += seconds
        self._record(load.state, failed=failed_call, now=now)
        return good

    # --------------------------------------------------------------- writes
    def offer(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """Count an offer of each key; those to write now. None while the
        cluster may not be used (counted as refused)."""
        self.offers += len(keys)
        if not self.usable(now):
            self.writes_refused += len(keys)
            return []
        wanted = [k for k in self.admission.offer(keys) if self._wants(k, now)]
        self.admitted += len(wanted)
        return wanted

    def _wants(self, key: OffloadKey, now: float) -> bool:
        return (
            key not in self._writing
            and not self.is_fresh(key, now)
            and not self.is_negative(key, now)
        )

    def prepare_write(self, keys: Sequence[OffloadKey], now: float) -> TierStore | None:
        """A write of the ``keys`` still wanted (marked in flight), or None."""
        new = [k for k in dict.fromkeys(keys) if self._wants(k, now)]
        if not new:
            return None
        if not self.usable(now):
            self.writes_refused += len(new)
            self.breaker.reject()
            return None
        self._writing.update(new)
        spec = MooncakeLoadStoreSpec(new, [self.name_of(k) for k in new])
        return TierStore(new, spec, [], _Ticket())

    def complete_write(
        self, store: TierStore, *, now: float, nbytes: int = 0, seconds: float = 0.0
    ) -> list[OffloadKey]:
        """The write of ``store`` ended: the keys the cluster took (a "stored" event)."""
        spec = store.spec
        assert isinstance(spec, MooncakeLoadStoreSpec)
        done: list[OffloadKey] = []
        failed_call = False
        for key, status in zip(spec.keys, spec.report.status, strict=True):
            self._writing.discard(key)
            self.by_status[status] += 1
            if status is BlockStatus.OK:
                done.append(key)
                self._see(key, now, ours=True)
            else:
                if status in FAILED_CALL:
                    failed_call = True
        if done:
            self._publish(done, removed=False)
        self.writes += 1
        self.blocks_written += len(done)
        self.write_failures += len(spec.keys) - len(done)
        self.bytes_written += nbytes
        self.write_seconds += seconds
        self._record(store.state, failed=failed_call, now=now)
        store.written = done
        return done

    # ------------------------------------------------------------- liveness
    def note_timeout(self, ticket: object, now: float) -> None:
        """A transfer of ``ticket`` is past its deadline: count it, against the breaker once."""
        assert isinstance(ticket, _Ticket)
        if ticket.timed_out:
            return
        ticket.timed_out = True
        self.timeouts += 1
        self._record_failure(now)

    def _record(self, ticket: object, *, failed: bool, now: float) -> None:
        assert isinstance(ticket, _Ticket)
        if ticket.timed_out:
            return  # counted when the deadline passed
        if failed:
            self.rpc_failures += 1
            self._record_failure(now)
        else:
            self.breaker.record_success(now)

    def take_removals(self) -> list[str]:
        """Object names holding wrong bytes, to remove from the cluster (once)."""
        removals, self._removals = self._removals, []
        return removals

    # ------------------------------------------------------------ internals
    def _see(self, key: OffloadKey, now: float, *, ours: bool = False) -> None:
        index = self._index
        seen = index.get(key)
        if seen is None:
            if len(index) >= self.max_tracked:
                index.popitem(last=False)
            index[key] = _Seen(now, ours)
        else:
            seen.at = now
            seen.ours = seen.ours or ours
            index.move_to_end(key)
        self._negative.pop(key, None)

    def _remember_absent(self, key: OffloadKey, now: float) -> None:
        negative = self._negative
        negative.pop(key, None)
        if len(negative) >= self.max_tracked:
            negative.popitem(last=False)
        negative[key] = now + self.negative_ttl

    def _expire(self, now: float) -> None:
        negative = self._negative
        while negative:
            key, expiry = next(iter(negative.items()))
            if expiry > now:
                break
            del negative[key]

    def _publish(self, keys: list[OffloadKey], *, removed: bool) -> None:
        sink = self._sink
        if sink is not None and sink.active:
            sink.publish(OffloadingEvent(keys, MOONCAKE_MEDIUM, removed))
