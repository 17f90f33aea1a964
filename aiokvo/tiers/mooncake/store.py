"""``MooncakeStore``: the Mooncake tier's byte I/O, one batch call per transfer.

Objects are ``key_prefix/<layout fingerprint>/<key hex>``: every replica of a
model with the same cluster and layout finds the others' blocks, and no
other layout ever reads them. Placement is the cluster's; the tier keeps a
:class:`~aiokvo.tiers.seen_index.SeenIndex` of what it has seen.

A transfer is one batch call with, per block, the pool rows of its group and
its 64-byte trailer (:mod:`~aiokvo.tiers.mooncake.rows`), straight from or
into the CPU pool's pages (registered once at connect; no staging copy). A
put computes each block's xxh3 checksum and seals its trailer before the
call; a get verifies length, trailer and checksum of every block after it,
on ``checksum_threads`` threads together. With ``pipeline_bytes``, a larger
transfer is split into calls of about that size, and a helper thread runs
one chunk's call (put) or verification (get) while the store's thread works
on the next. A chunk whose call fails as a whole stops the transfer: the
chunks after it are not tried (the cluster just failed).

Mooncake's C++ client is reached only through
:class:`~aiokvo.tiers.mooncake.client.MooncakeClient` (never after close,
never from the loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from aiokvo.errors import ConfigError, TierChecksumError, TierError, TierUnavailableError
from aiokvo.handlers.pool import padded_row_stride
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.checksum import hash_each, xxh3
from aiokvo.tiers.index import Index
from aiokvo.tiers.mooncake.client import (
    MooncakeClient,
    StoreFactory,
    apply_env_defaults,
    default_store_factory,
    probe_master,
    route_address,
)
from aiokvo.tiers.mooncake.config import MooncakeTierConfig, integrity_key_bytes
from aiokvo.tiers.mooncake.format import (
    INVALID_PARAMS,
    TRAILER_BYTES,
    key_digest,
    object_name,
    open_trailers,
    outcome_of_code,
    seal_trailers,
)
from aiokvo.tiers.mooncake.probe import SetupProbe
from aiokvo.tiers.mooncake.rows import BlockRows, Buffers
from aiokvo.tiers.mooncake.spec import MOONCAKE_MEDIUM
from aiokvo.tiers.outcome import Outcome
from aiokvo.tiers.seen_index import SeenIndex
from aiokvo.tiers.store import Apply, BlockJob, StoreBinding, StoreCapabilities

if TYPE_CHECKING:
    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.tiers.mooncake.keyed import KeyedTrailers

__all__ = ["MooncakeStore", "MooncakeTierStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeTierStatistics(TierStatistics):
    """:class:`~aiokvo.tiers.TierStatistics` plus the Mooncake tier's own.

    ``used_blocks`` counts the blocks seen in the cluster (the index);
    ``capacity_blocks`` is 0 and ``evictions`` are the cluster's, unseen
    here. Misses by Mooncake's cause are in ``failure_causes``, also read as
    the properties below.
    """

    master: str = ""
    """The master's ``host:port``."""
    namespace: str = ""
    """``key_prefix/<layout fingerprint>``: where this layout's objects live."""
    replica_num: int = 1
    """Copies of each block."""
    negative_hits: int = 0
    """Lookups cut short by the negative cache."""
    negative_cached: int = 0
    """Keys in the negative cache now."""
    writing_blocks: int = 0
    """Blocks with a put in flight."""

    GAUGES: ClassVar[frozenset[str]] = TierStatistics.GAUGES | {
        "replica_num", "negative_cached", "writing_blocks",
    }  # fmt: skip

    @property
    def setups(self) -> int:
        """Times the client connected (``connects``)."""
        return self.connects

    @property
    def setup_failures(self) -> int:
        """Connection attempts that failed (``connect_failures``)."""
        return self.connect_failures

    @property
    def rpc_failures(self) -> int:
        """Transfers whose call failed as a whole (``store_failures``)."""
        return self.store_failures

    @property
    def not_found(self) -> int:
        """Reads of objects gone since the lookup (-704)."""
        return self.failure_causes.get("not_found", 0)

    @property
    def lease_expired(self) -> int:
        """Reads whose lease ran out (-707)."""
        return self.failure_causes.get("lease_expired", 0)

    @property
    def transfer_failed(self) -> int:
        """Blocks whose segment was unreachable (-800)."""
        return self.failure_causes.get("transfer_failed", 0)

    @property
    def size_mismatches(self) -> int:
        """Objects of another size than this layout's block."""
        return self.failure_causes.get("size_mismatch", 0)

    @property
    def bad_trailers(self) -> int:
        """Objects whose trailer is not this block's."""
        return self.failure_causes.get("bad_trailer", 0)

    @property
    def pool_full(self) -> int:
        """Puts refused because the cluster had no room (-200)."""
        return self.failure_causes.get("pool_full", 0)


class MooncakeStore:
    """The Mooncake tier's store; see the module.

    ``store_factory`` makes the Mooncake store object (tests pass a fake
    cluster's; with one, the master's TCP port is not probed before
    ``setup()``).
    """

    medium = MOONCAKE_MEDIUM
    statistics_type: type[TierStatistics] = MooncakeTierStatistics

    def __init__(
        self, config: MooncakeTierConfig, *, store_factory: StoreFactory | None = None
    ) -> None:
        self.config = config
        self.capabilities = StoreCapabilities(
            remote=True, probes=True, reconnects=True,
            lookup_timeout=config.lookup_timeout, connect_timeout=config.setup_timeout,
        )  # fmt: skip
        self._factory = store_factory
        real = store_factory is None
        self._probe = SetupProbe()
        self.client = MooncakeClient(
            store_factory or default_store_factory,
            replica_num=config.replica_num,
            preferred_segment=config.preferred_segment,
            probe=probe_master if real else None,
            setup_probe=self._probe if real else None,
        )
        self._healthy = True  # the cluster answered the last call
        self.namespace = ""
        self._keyed: KeyedTrailers | None = None
        if config.integrity_key is not None:
            from aiokvo.tiers.mooncake.keyed import KeyedTrailers

            self._keyed = KeyedTrailers(integrity_key_bytes(config.integrity_key))
        self._put_rows: BlockRows | None = None
        self._get_rows: BlockRows | None = None
        self._pools: dict[str, ThreadPoolExecutor] = {}

    @property
    def where(self) -> str:
        return f"{self.config.master_server_addr} {self.namespace or 'unbound'}"

    @property
    def hostname(self) -> str:
        """This client's segment name in the cluster, once connected."""
        return self.client.hostname

    def object_name(self, key: bytes) -> str:
        """The cluster object that holds ``key``'s block (after bind)."""
        if not self.namespace:
            raise ConfigError("the Mooncake tier is not bound to KV caches yet")
        return f"{self.namespace}/{key.hex()}"

    # ------------------------------------------------------------- binding
    def row_tail_bytes(self, kv_caches: CanonicalKVCaches, config: OffloadConfig) -> int:
        """Room for a trailer after every pool row (``row_trailers``), where every block
        is one canonical tensor (then one buffer per block) and the room costs at most
        1/64 of a row."""
        if not self.config.row_trailers:
            return 0
        groups = kv_caches.group_data_refs
        if any(len({r.tensor_idx for r in refs}) != 1 for refs in groups):
            return 0
        factor = config.block_size_factor
        for tensor in kv_caches.tensors:
            width = tensor.page_size_bytes * factor
            if padded_row_stride(width, TRAILER_BYTES) - width > width // 64:
                return 0
        return TRAILER_BYTES

    def bind(self, binding: StoreBinding) -> Index:
        if self._factory is None:
            _check_installed()
        config, fingerprint, pool = self.config, binding.fingerprint, binding.rows
        if not config.row_trailers and pool.row_tail_bytes:
            pool.row_tail_bytes = 0  # room granted but not wanted: trailers in an arena
        layout = fingerprint.digest()[:16]

        def rows() -> BlockRows:  # an arena per direction, unless trailers are in the rows
            in_row = pool.row_tail_bytes >= TRAILER_BYTES
            shape = (pool.num_blocks, TRAILER_BYTES)
            return BlockRows(pool, layout, None if in_row else np.zeros(shape, dtype=np.uint8))

        self._put_rows, self._get_rows = rows(), rows()
        name = fingerprint.name()
        if self._keyed is not None:  # keyed objects, and each key's, live apart
            name = f"{name}-k{self._keyed.key_id}"
        self.namespace = f"{config.key_prefix}/{name}"
        return SeenIndex(
            partial(object_name, config.key_prefix, name),
            medium=self.medium,
            max_tracked=config.max_tracked,
            negative_ttl=config.negative_ttl,
            index_ttl=config.index_ttl,
            sink=binding.sink,
        )

    # ----------------------------------------------------------- connecting
    def open(self) -> list[Any]:
        """Connect (``setup()``) and register the pool; raises TierUnavailableError."""
        put_rows, get_rows = self._put_rows, self._get_rows
        if put_rows is None or get_rows is None:
            raise ConfigError("bind the Mooncake tier before opening it")
        config = self.config
        apply_env_defaults(rpc_timeout=config.effective_rpc_timeout,
                           setup_retries=config.setup_retries)  # fmt: skip
        host = config.local_hostname or route_address(config.master_server_addr)
        spans = put_rows.spans() + get_rows.spans()[-1:]  # the pool once, both arenas
        self.client.connect(config.setup_settings(host), spans,
                            probe_timeout=config.lookup_timeout,
                            setup_timeout=config.setup_timeout)  # fmt: skip
        self._healthy = True
        logger.info("Mooncake tier: %s as %s (namespace %s)", config.master_server_addr,
                    self.client.hostname, self.namespace)  # fmt: skip
        return []

    def exists(self, places: list[Any]) -> list[int]:
        answers = self._healthy_if(self.client.exists, list(places))
        self._healthy = all(a in (0, 1) for a in answers)
        return answers

    def probe(self) -> bool:
        answers = self._healthy_if(self.client.exists, [f"{self.namespace}/probe"])
        self._healthy = len(answers) == 1 and answers[0] in (0, 1)
        return self._healthy

    def _healthy_if(self, call: Callable[[list[str]], list[int]], names: list[str]) -> list[int]:
        try:
            return call(names)
        except Exception:
            self._healthy = False
            raise

    def maintenance(self, index: Index) -> Callable[[], Apply] | None:
        return None

    def remove(self, places: list[Any]) -> None:
        try:
            self.client.remove(list(places))
        except Exception as exc:  # best effort: a later reader verifies again
            logger.debug("Mooncake tier: removing %d bad objects failed: %r", len(places), exc)

    def interrupt(self) -> None:
        """Kill a probing child in flight (a connection attempt then gives up)."""
        self._probe.cancel()

    def close(self) -> None:
        """Close the client; or, if the cluster stopped answering, leave it open unused:
        Mooncake's ``close()`` holds the GIL while it waits for a dead master."""
        self._probe.cancel()
        if self._healthy:
            self.client.close()
        else:
            self.client.abandon("the cluster did not answer the last call")
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()

    def statistics_extra(self) -> dict[str, Any]:
        config = self.config
        return {
            "master": config.master_server_addr,
            "namespace": self.namespace,
            "replica_num": config.replica_num,
        }

    # ------------------------------------------------------------- the calls
    def write(self, job: BlockJob) -> None:
        """Checksums and trailers chunk by chunk, each chunk's batch put on the helper
        thread while the next chunk is checksummed."""
        rows = self._put_rows
        assert rows is not None
        outcomes, groups, cpu_rows, names = job.outcomes, job.groups, job.rows, job.where
        staged: dict[int, Buffers] = {}
        broken: list[BaseException] = []
        checksums = [0] * len(job)
        key_hashes = [0] * len(job)

        keyed = self._keyed
        sealed_keyed = np.zeros((len(job), TRAILER_BYTES), dtype=np.uint8) if keyed else None

        def checksum(i: int) -> None:
            buffers = rows.buffers(groups[i], cpu_rows[i])
            if keyed is not None and sealed_keyed is not None:
                trailer = keyed.seal(rows.layout, key_digest(job.keys[i]), buffers,
                                     rows.payload[groups[i]])  # fmt: skip
                sealed_keyed[i] = np.frombuffer(trailer, dtype=np.uint8)
                return
            checksums[i] = xxh3(buffers)
            key_hashes[i] = key_digest(job.keys[i])

        def seal(lo: int, hi: int) -> None:
            self._each(checksum, lo, hi, "put")
            at, of = cpu_rows[lo:hi], groups[lo:hi]
            if sealed_keyed is not None:
                sealed = sealed_keyed[lo:hi]
            else:
                sealed = seal_trailers(
                    rows.layout, key_hashes[lo:hi], [rows.payload[g] for g in of],
                    checksums[lo:hi],
                )  # fmt: skip
            rows.write_trailers(of, at, sealed)
            staged[lo] = rows.pointer_lists(of, at)

        def put(lo: int, hi: int) -> None:
            codes = self._call(job, lo, hi, staged.pop(lo), broken, write=True)
            if codes is None:
                return
            for i, code in zip(range(lo, hi), codes, strict=True):
                if code == 0:
                    outcomes.ok(i)
                    continue
                outcome, cause = (
                    (Outcome.IO_ERROR, "error") if code == INVALID_PARAMS
                    else outcome_of_code(code)
                )  # fmt: skip
                outcomes.fail(i, outcome, _code_error("put", names[i], code, cause), cause)

        self._chunked(job, seal, put, "put")

    def read(self, job: BlockJob) -> None:
        """A batch get per chunk; each chunk's lengths, trailers and checksums verified on
        the helper thread while the next chunk is read."""
        rows = self._get_rows
        assert rows is not None
        fetched: dict[int, list[int]] = {}
        broken: list[BaseException] = []

        def get(lo: int, hi: int) -> None:
            buffers = rows.pointer_lists(job.groups[lo:hi], job.rows[lo:hi])
            codes = self._call(job, lo, hi, buffers, broken, write=False)
            if codes is not None:
                fetched[lo] = codes

        def verify(lo: int, hi: int) -> None:
            codes = fetched.pop(lo, None)
            if codes is not None:
                self._verify(job, lo, hi, codes)

        self._chunked(job, get, verify, "get")

    def _chunked(
        self, job: BlockJob, first: Callable[[int, int], object],
        second: Callable[[int, int], object], what: str,
    ) -> None:  # fmt: skip
        """``first`` then ``second`` for each chunk, the chunk's ``second`` on the helper
        thread while the next chunk's ``first`` runs here (one chunk: all here)."""
        if job.late():
            job.outcomes.fail_rest(Outcome.TIMEOUT, self._late(what))
            return
        chunks = self._chunks(job)
        pending: list[Future[object]] = []
        try:
            for lo, hi in chunks:
                first(lo, hi)
                if len(chunks) == 1:
                    second(lo, hi)
                else:
                    pending.append(self._pool(f"{what}-io").submit(second, lo, hi))
        finally:
            for future in pending:
                future.result()

    def _chunks(self, job: BlockJob) -> list[tuple[int, int]]:
        """Index ranges of about ``pipeline_bytes`` of payload each, in order."""
        rows, limit = self._get_rows, self.config.pipeline_bytes
        assert rows is not None
        if limit is None:
            return [(0, len(job))]
        chunks: list[tuple[int, int]] = []
        lo = total = 0
        for i, group in enumerate(job.groups):
            total += rows.payload[group]
            if total >= limit:
                chunks.append((lo, i + 1))
                lo, total = i + 1, 0
        if lo < len(job):
            chunks.append((lo, len(job)))
        return chunks

    def _call(
        self, job: BlockJob, lo: int, hi: int, buffers: Buffers, broken: list[BaseException],
        *, write: bool,
    ) -> list[int] | None:  # fmt: skip
        """One batch call for blocks ``lo:hi`` (``batch_put_from`` / ``batch_get_into``
        when each is one buffer, else the multi-buffer calls); None (the blocks marked)
        if it did not run or failed as a whole."""
        outcomes = job.outcomes
        what = "put" if write else "get"
        if broken:
            outcomes.fail_range(lo, hi, Outcome.IO_ERROR, broken[0], "rpc_failed")
            return None
        if job.late():
            outcomes.fail_range(lo, hi, Outcome.TIMEOUT, self._late(what))
            return None
        ptrs, sizes, single = buffers
        client = self.client
        if write:
            call: Callable[[list[str], Any, Any], list[int]] = (
                client.put_from if single else client.put
            )
        else:
            call = client.get_into if single else client.get
        try:
            codes = call(list(job.where[lo:hi]), ptrs, sizes)
            if len(codes) != hi - lo:
                raise TierError(f"Mooncake answered {len(codes)} codes for {hi - lo} objects")
        except TierUnavailableError as exc:
            outcomes.fail_range(lo, hi, Outcome.IO_ERROR, exc, "rpc_failed")
            broken.append(exc)
            self._healthy = False
            return None
        except Exception as exc:
            outcomes.fail_range(lo, hi, Outcome.IO_ERROR, exc, "error")
            broken.append(exc)
            return None
        failed = bool(codes) and all(
            c < 0 and outcome_of_code(c)[1] == "rpc_failed" for c in codes
        )
        self._healthy = not failed
        if failed:
            broken.append(TierUnavailableError(f"Mooncake answered {codes[0]} for every object"))
        return codes

    def _verify(self, job: BlockJob, lo: int, hi: int, codes: list[int]) -> None:
        """Length, trailer and checksum of blocks ``lo:hi`` (read with ``codes``). Payloads
        are hashed on ``checksum_threads`` threads, trailers all at once."""
        rows = self._get_rows
        assert rows is not None
        outcomes, groups, cpu_rows, names = job.outcomes, job.groups, job.rows, job.where
        payloads = [rows.payload[g] for g in groups[lo:hi]]
        whole = [code == n + TRAILER_BYTES for code, n in zip(codes, payloads, strict=True)]
        found = [0] * (hi - lo)
        key_hashes = [key_digest(k) for k in job.keys[lo:hi]]
        raw = rows.read_trailers(groups[lo:hi], cpu_rows[lo:hi])
        keyed = self._keyed
        vouched = [False] * (hi - lo)

        def checksum(i: int) -> None:
            j = i - lo
            if not whole[j]:
                return
            buffers = rows.buffers(groups[i], cpu_rows[i])
            if keyed is not None:
                vouched[j] = keyed.check(raw[j].tobytes(), rows.layout, key_hashes[j], buffers,
                                         payloads[j])  # fmt: skip
            else:
                found[j] = xxh3(buffers)

        self._each(checksum, lo, hi, "get")
        if keyed is not None:  # the tag covers trailer and payload: one verdict
            sealed, stored = np.asarray(vouched), np.asarray(found, dtype=np.uint64)
        else:
            sealed, stored = open_trailers(raw, rows.layout, key_hashes, payloads)
        for j, code in enumerate(codes):
            i, name = lo + j, names[lo + j]
            if code < 0:
                outcome, cause = outcome_of_code(code)
                outcomes.fail(i, outcome, _code_error("get", name, code, cause), cause)
            elif not whole[j]:
                outcomes.fail(
                    i, Outcome.CORRUPT,
                    TierError(f"Mooncake get of {name} read {code} bytes, the block has "
                              f"{payloads[j] + TRAILER_BYTES}"),
                    "size_mismatch",
                )  # fmt: skip
            elif not sealed[j]:
                outcomes.fail(
                    i, Outcome.CORRUPT,
                    TierChecksumError(f"Mooncake object {name} does not carry this block's "
                                      "trailer (another layout or key, torn, or not "
                                      "written with this deployment's key)"),
                    "bad_trailer" if keyed is None else "bad_mac",
                )  # fmt: skip
            elif found[j] != int(stored[j]):
                outcomes.fail(
                    i, Outcome.CORRUPT,
                    TierChecksumError(f"Mooncake object {name}: checksum {found[j]:#018x}, "
                                      f"its writer stored {int(stored[j]):#018x}"),
                    "checksum",
                )  # fmt: skip
            else:
                outcomes.ok(i)

    def _each(self, work: Callable[[int], None], lo: int, hi: int, what: str) -> None:
        threads = self.config.checksum_threads
        hash_each(work, lo, hi, threads, lambda: self._pool(f"{what}-hash", threads - 1))

    def _pool(self, role: str, threads: int = 1) -> ThreadPoolExecutor:
        pool = self._pools.get(role)
        if pool is None:
            name = f"aiokvo-mooncake-{role}"
            pool = self._pools[role] = ThreadPoolExecutor(threads, thread_name_prefix=name)
        return pool

    def _late(self, what: str) -> TierError:
        from aiokvo.errors import TierTimeoutError

        return TierTimeoutError(
            f"Mooncake {what} passed its deadline ({self.config.io_timeout} s) before its "
            "call started"
        )


def _code_error(what: str, name: str, code: int, cause: str) -> TierError:
    message = f"Mooncake {what} of {name} returned {code} ({cause})"
    if cause == "rpc_failed":
        return TierUnavailableError(message)
    return TierError(message)


def _check_installed() -> None:
    """A ConfigError now, at bind, if Mooncake cannot be imported (not at first use)."""
    import importlib

    from aiokvo.tiers.mooncake.client import INSTALL_HINT

    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:
        raise ConfigError(f"{INSTALL_HINT}; importing it failed: {exc}") from exc
