"""``TierCore``: every tier's decisions in one sans-I/O state machine.

Calls in, decisions out, on the loop's thread, deterministic for a given
sequence of calls and clock readings (the way websockets' protocol objects
are). The tier's :class:`~aiokvo.tiers.index.Index` says where keys live;
the core adds what every tier does the same way:

* **one gate** in front of every operation: the store must be connected and
  the circuit breaker must let the operation through. Lookups and offers
  only look (:meth:`CircuitBreaker.available`); reads and writes take the
  half-open trial (:meth:`CircuitBreaker.acquire`), unless the store runs
  its own probe as the trial (``probes``: callers then wait for the breaker
  to close). Every operation the gate turns away is one ``rejected`` in the
  breaker's statistics, whatever the tier;
* **admission**: a key is written once it has been offered ``admit_after``
  times (:class:`~aiokvo.tiers.admission.Admission`);
* **tickets**: each transfer's bookkeeping, so a transfer past its deadline
  counts against the breaker once, and its late outcome changes nothing;
* **outcomes**: what each block's :class:`~aiokvo.tiers.outcome.Outcome`
  means for the counters and the breaker (``IO_ERROR`` and ``TIMEOUT`` are
  the store failing; the rest are misses); the index decides what it means
  for placement;
* **never ran**: a transfer that failed before its store call ran (never
  submitted, the handler closed) leaves its blocks ``NOT_RUN``.

Pure: no asyncio, no I/O, no clock of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from aiokvo.keys import OffloadKey
from aiokvo.tiers.admission import Admission
from aiokvo.tiers.base import TierLoad, TierStore
from aiokvo.tiers.breaker import CircuitBreaker
from aiokvo.tiers.counters import TierCounters
from aiokvo.tiers.index import Index, RemoteIndex, Reservation
from aiokvo.tiers.outcome import STORE_FAILURES, Outcome, Outcomes
from aiokvo.tiers.settings import TierSettings
from aiokvo.tiers.spec import TierSpec

__all__ = ["Ticket", "TierCore"]


@dataclass(slots=True, eq=False)
class Ticket:
    """One transfer's bookkeeping (``TierLoad.state`` / ``TierStore.state``)."""

    reservation: Reservation
    trial: bool = False
    timed_out: bool = False


class TierCore(TierCounters):
    """The decisions of one tier over ``index``; see the module.

    ``spec_class`` makes the tier-side specs; ``probes`` says the store runs
    the breaker's half-open trial itself; ``connected`` is where a store that
    connects starts (False until it has).
    """

    def __init__(
        self,
        index: Index,
        settings: TierSettings,
        *,
        spec_class: type[TierSpec],
        probes: bool = False,
        connected: bool = True,
    ) -> None:
        super().__init__()
        self.index = index
        self.spec_class = spec_class
        self.probes = probes
        self.connected = connected
        self.admission = Admission(settings.admit_after, settings.max_tracked)
        self.breaker = CircuitBreaker(
            failure_threshold=settings.failure_threshold,
            reset_after=settings.reset_after,
            max_reset_after=settings.max_reset_after,
        )
        self.causes: Counter[str] = Counter()

    # --------------------------------------------------------------- the gate
    def usable(self, now: float) -> bool:
        """Whether callers' operations would go through now (changes nothing)."""
        if not self.connected:
            return False
        if self.probes:
            return self.breaker.state(now) == "closed"
        return self.breaker.available(now)

    def needs_probe(self, now: float) -> bool:
        """Whether the store's own probe is due: a reconnection, or (``probes``) the
        breaker's half-open trial."""
        return not self.connected or (self.probes and self.breaker.state(now) == "half_open")

    def _admit(self, now: float) -> bool:
        """The one gate, for an operation that only looks (a lookup, an offer)."""
        if self.usable(now):
            return True
        self.breaker.reject()
        return False

    def _take(self, now: float) -> bool | None:
        """The one gate, for a transfer: None (rejected, counted), else whether it is
        the breaker's half-open trial (taken now)."""
        if not self._admit(now):
            return None
        trial = self.breaker.state(now) == "half_open"
        taken = self.breaker.acquire(now)
        assert taken, "the gate said the breaker lets it through"
        return trial

    # -------------------------------------------------------------- lookups
    def lookup(self, keys: Sequence[OffloadKey], now: float) -> int:
        """How many leading ``keys`` the index holds; 0 (bypassed) through a closed gate."""
        self.lookups += 1
        if not self._admit(now):
            self.lookups_bypassed += 1
            return 0
        return self._found(keys, self.index.lookup(keys, now))

    def begin_lookup(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey] | None:
        """A remote lookup: the keys to ask the store about (maybe none); None through a
        closed gate (bypassed: the lookup answers 0)."""
        self.lookups += 1
        if not self._admit(now):
            self.lookups_bypassed += 1
            return None
        return cast(RemoteIndex, self.index).to_ask(keys, now)

    def finish_lookup(
        self, keys: Sequence[OffloadKey], asked: Sequence[OffloadKey],
        answers: Sequence[int] | None, now: float,
    ) -> int:  # fmt: skip
        """How many leading ``keys`` exist, from the store's ``answers`` for ``asked``."""
        index = cast(RemoteIndex, self.index)
        return self._found(keys, index.answered(asked, answers, now) if asked else 0)

    def _found(self, keys: Sequence[OffloadKey], n: int) -> int:
        if n < len(keys):
            self.lookup_misses += 1
        self.lookup_hits += n
        return n

    def record_lookup_call(self, ok: bool, now: float, *, timed_out: bool = False) -> None:
        """One remote lookup call ended (``ok``: every answer made sense)."""
        self.remote_lookups += 1
        if timed_out:
            self.lookup_timeouts += 1
        if ok:
            self.breaker.record_success(now)
        else:
            self.lookup_failures += 1
            self._record_failure(now)

    # ---------------------------------------------------------------- reads
    def prepare_read(self, keys: Sequence[OffloadKey], now: float) -> TierLoad | None:
        """Pin ``keys`` (found by a lookup) for reading, or None (nothing pinned)."""
        if not keys:
            return None
        if not self.usable(now):
            self.breaker.reject()
            return None
        reservation = self.index.reserve_read(keys, now)
        if reservation is None:
            return None
        trial = self._take(now)
        assert trial is not None
        spec = self.spec_class(reservation.keys, reservation.where)
        return TierLoad(list(reservation.keys), spec, Ticket(reservation, trial))

    def complete_read(
        self, load: TierLoad, *, error: BaseException | None, now: float,
        nbytes: int = 0, seconds: float = 0.0,
    ) -> list[OffloadKey]:  # fmt: skip
        """The read of ``load`` ended (``error``: the transfer's); the good keys."""
        ticket, outcomes = self._ended(load.state, load.spec, error)
        good = self.index.commit(ticket.reservation, outcomes, write=False, now=now)
        self.reads += 1
        self.blocks_read += len(good)
        self.read_failures += len(ticket.reservation.keys) - len(good)
        self.checksum_failures += outcomes.count(Outcome.CORRUPT)
        self.stale_reads += outcomes.count(Outcome.STALE)
        self.bytes_read += nbytes
        self.read_seconds += seconds
        self._record(ticket, outcomes, now)
        return good

    # --------------------------------------------------------------- writes
    def offer(self, keys: Sequence[OffloadKey], now: float) -> list[OffloadKey]:
        """Count one offer of each key; those admitted that the tier wants now.

        Nothing is admitted through a closed gate (counted as refused).
        """
        self.offers += len(keys)
        if not self._admit(now):
            self.writes_refused += len(keys)
            return []
        wanted = self.index.wants(self.admission.offer(keys), now)
        self.admitted += len(wanted)
        return wanted

    def prepare_write(self, keys: Sequence[OffloadKey], now: float) -> TierStore | None:
        """Place the ``keys`` the tier still wants (evicting by policy), or None.

        None when there is nothing to write, no room, or the gate says no
        (the keys counted as refused).
        """
        new = self.index.wants(keys, now)
        if not new:
            return None
        if not self._admit(now):
            self.writes_refused += len(new)
            return None
        reservation = self.index.reserve_write(new, now)
        if reservation is None:
            self.writes_refused += len(new)
            return None
        trial = self._take(now)
        assert trial is not None
        spec = self.spec_class(reservation.keys, reservation.where)
        return TierStore(
            list(reservation.keys), spec, list(reservation.evicted), Ticket(reservation, trial)
        )

    def complete_write(
        self, store: TierStore, *, error: BaseException | None, now: float,
        nbytes: int = 0, seconds: float = 0.0,
    ) -> list[OffloadKey]:  # fmt: skip
        """The write of ``store`` ended: the keys committed (also set in ``store.written``)."""
        ticket, outcomes = self._ended(store.state, store.spec, error)
        done = self.index.commit(ticket.reservation, outcomes, write=True, now=now)
        self.writes += 1
        self.blocks_written += len(done)
        self.write_failures += len(ticket.reservation.keys) - len(done)
        self.bytes_written += nbytes
        self.write_seconds += seconds
        self._record(ticket, outcomes, now)
        store.written = done
        return done

    # ------------------------------------------------------------- liveness
    def note_timeout(self, ticket: object, now: float) -> None:
        """A transfer of ``ticket`` is past its deadline: count it, against the breaker once."""
        assert isinstance(ticket, Ticket)
        if ticket.timed_out:
            return
        ticket.timed_out = True
        self.timeouts += 1
        self._record_failure(now)

    def record_probe(self, ok: bool, now: float) -> None:
        """The store's own probe (the breaker's trial, or a reconnection check) ended."""
        if ok:
            self.breaker.record_success(now)
        else:
            self._record_failure(now)

    def set_connected(self, connected: bool, now: float) -> None:
        """The store connected (or was lost). A new connection trusts nothing it saw."""
        if connected and not self.connected:
            self.index.distrust(now)
            self.breaker.record_success(now)
        self.connected = connected

    # ------------------------------------------------------------ internals
    def _ended(
        self, ticket: Any, spec: Any, error: BaseException | None
    ) -> tuple[Ticket, Outcomes]:
        assert isinstance(ticket, Ticket) and isinstance(spec, TierSpec)
        outcomes = spec.outcomes
        if error is not None and outcomes.error is None:
            outcomes.fail_rest(Outcome.NOT_RUN, error)  # failed before its store call ran
        for status, cause in outcomes.failures():
            self.causes[cause or status.name.lower()] += 1
        return ticket, outcomes

    def _record(self, ticket: Ticket, outcomes: Outcomes, now: float) -> None:
        if ticket.timed_out:
            return  # counted when the deadline passed; a late outcome changes nothing
        if outcomes.all_ok():
            self.breaker.record_success(now)
            return
        if Outcome.TIMEOUT in outcomes.status:
            # The store saw the deadline first (a job that started after it does no I/O
            # and ends at once, before the loop's timer): the same one timeout.
            self.note_timeout(ticket, now)
            return
        if any(status in STORE_FAILURES for status in outcomes.status):
            self.store_failures += 1
            self._record_failure(now)
        else:
            self.breaker.record_success(now)

    def _record_failure(self, now: float) -> None:
        was_closed = self.breaker.state(now) == "closed"
        self.breaker.record_failure(now)
        if was_closed and self.breaker.state(now) != "closed":
            self.index.distrust(now)  # tripped: the store may have lost what it held
