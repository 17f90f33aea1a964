"""The Mooncake tier's I/O routes: ``(CPU, MOONCAKE)`` puts and ``(MOONCAKE, CPU)`` gets.

Each direction is a :class:`~aiokvo.handlers.base.SingleDirectionHandler`
(FIFO, awaitable :class:`~aiokvo.handlers.TransferTask`\\ s, statistics) whose
calls run on its own :class:`~aiokvo.handlers.host.dispatch.DispatchThread`:
Mooncake's batch calls block and release the GIL, and promotions (which a
load waits for) never queue behind write-through. The loop only checks,
builds nothing heavier than the names, and enqueues; it never runs a call.

A transfer is one batch call with, per block, the pool row of each canonical
tensor its group uses, straight from or into the CPU pool's pages
(registered once; no staging copy), and its 64-byte trailer
(:mod:`~aiokvo.tiers.mooncake.format`). Where the pool gave the tier room
after every row, the trailer sits right after the row of the block's last
tensor, so a one-tensor block is one buffer and the call is
``batch_put_from`` / ``batch_get_into`` (Mooncake's TCP transport pays per
buffer); otherwise it sits in a registered arena (one slot per CPU block, one
arena per direction) and the call is ``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers``. A put computes each block's xxh3
checksum before its call, a get verifies length, trailer and checksum of
every block after it, on ``checksum_threads`` threads together. With
``pipeline_bytes``, a larger transfer is split into calls of about that
size, and a helper thread runs one chunk's call (put) or verification (get)
while the handler's thread works on the next. Every block's outcome goes in
the spec's :class:`~aiokvo.tiers.mooncake.spec.BlockReport`; a transfer with
any failed block fails with the first error (its good blocks are still
good). A chunk whose call fails as a whole stops the transfer: the chunks
after it are not tried.

Deadlines: a transfer has ``io_timeout`` seconds from submission; one whose
call has not started by then is not started (``TIMEOUT``), and a timer on
the loop tells the tier when a transfer is overdue even while its call is
stuck in Mooncake, so the breaker can act. The transfer itself ends only when
the call returns: until then Mooncake may still be reading or writing those
CPU blocks, so they stay pinned or reserved.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np
import torch

from aiokvo._util import check_int
from aiokvo.errors import (
    TierChecksumError,
    TierError,
    TierTimeoutError,
    TierUnavailableError,
    TransferSpecError,
)
from aiokvo.handlers.base import Submission
from aiokvo.handlers.host.dispatch import DispatchThread
from aiokvo.handlers.task import DEFAULT_MAX_BUFFERED
from aiokvo.keys import OffloadKey, get_offload_group_idx
from aiokvo.plan.rows import check_ids_in_range
from aiokvo.runtime.poller import PollerMode
from aiokvo.specs import CPULoadStoreSpec, TransferSpec
from aiokvo.tiers.fingerprint import LayoutFingerprint
from aiokvo.tiers.io import TierIOHandler
from aiokvo.tiers.mooncake.client import MooncakeClient
from aiokvo.tiers.mooncake.format import (
    INVALID_PARAMS,
    TRAILER_BYTES,
    key_digest,
    open_trailers,
    payload_checksum,
    seal_trailers,
    status_of_code,
)
from aiokvo.tiers.mooncake.spec import BlockStatus, MooncakeLoadStoreSpec

__all__ = ["BlockRows", "Buffers", "MooncakeTierHandler"]

Overdue = Callable[[MooncakeLoadStoreSpec], None]


Buffers = tuple[list[int] | list[list[int]], list[int] | list[list[int]], bool]
"""Pointers and sizes of a call's objects, and whether each is one buffer (flat lists
for ``batch_put_from`` / ``batch_get_into``) or several (lists of lists)."""


class BlockRows:
    """Where each block's bytes are in the CPU pool, for pointer lists and checksums.

    ``cpu_tensors[i]`` is the pool of canonical tensor ``i``
    (``(num_cpu_blocks, row bytes)`` int8, rows contiguous, any row stride).
    With ``row_tail_bytes`` (room after every row that is this tier's) a
    block's trailer lives right after the row of the last tensor its group
    uses, so a one-tensor block goes out and in as one buffer; otherwise in
    ``trailers``, a ``(num_cpu_blocks, 64)`` uint8 arena (one more buffer).
    """

    def __init__(
        self,
        cpu_tensors: Sequence[torch.Tensor],
        fingerprint: LayoutFingerprint,
        trailers: np.ndarray | None,
        *,
        row_tail_bytes: int = 0,
    ) -> None:
        if not cpu_tensors:
            raise TransferSpecError("a Mooncake tier needs the CPU pool's tensors")
        self.num_blocks = n = min(int(t.shape[0]) for t in cpu_tensors)
        self._views = [t.numpy().view(np.uint8) for t in cpu_tensors]  # the pool: no copy
        self._base = [int(t.data_ptr()) for t in cpu_tensors]
        self._stride = [int(t.stride(0)) * t.element_size() for t in cpu_tensors]
        self._width = [int(t.shape[1]) * t.element_size() for t in cpu_tensors]
        if tuple(self._width) != fingerprint.tensor_row_bytes:
            raise TransferSpecError(
                f"the CPU pool's rows are {self._width} bytes, the layout's "
                f"{list(fingerprint.tensor_row_bytes)}"
            )
        groups = range(len(fingerprint.group_refs))
        self.group_tensors = [fingerprint.group_tensors(g) for g in groups]
        self.payload = [fingerprint.payload_bytes(g) for g in groups]
        self.layout = fingerprint.digest()[:16]
        self.in_row = row_tail_bytes >= TRAILER_BYTES
        self._tail = TRAILER_BYTES if self.in_row else 0
        count = len(self.group_tensors)
        self._arena_span: tuple[int, int] | None = None
        if self.in_row:
            # The room after each row of each group's last tensor, as (n, 64) views
            # (torch checks they lie inside the pool's memory).
            self._arena = [self._room(cpu_tensors[t[-1]], n) for t in self.group_tensors]
            self._trailer_base = [0] * count  # unused: a trailer extends its row's buffer
            self.single = [len(t) == 1 for t in self.group_tensors]
            return
        shape = (n, TRAILER_BYTES)
        if trailers is None or trailers.shape != shape or trailers.dtype != np.uint8:
            raise TransferSpecError(f"the trailer arena must be {shape} uint8")
        self._arena = [trailers] * count
        self._trailer_base = [int(trailers.ctypes.data)] * count
        self.single = [False] * count
        self._arena_span = (int(trailers.ctypes.data), trailers.nbytes)

    def _room(self, tensor: torch.Tensor, n: int) -> np.ndarray:
        width = int(tensor.shape[1]) * tensor.element_size()
        stride = int(tensor.stride(0)) * tensor.element_size()
        if n > 1 and stride - width < TRAILER_BYTES:
            raise TransferSpecError(
                f"CPU pool rows of {width} bytes at stride {stride} have no room for a "
                f"{TRAILER_BYTES}-byte trailer"
            )
        try:
            room = torch.as_strided(
                tensor, (n, TRAILER_BYTES), (int(tensor.stride(0)), 1),
                tensor.storage_offset() + int(tensor.shape[1]),
            )  # fmt: skip
        except RuntimeError as exc:
            raise TransferSpecError(f"the CPU pool has no room after its rows: {exc}") from exc
        return room.numpy().view(np.uint8)

    def spans(self) -> list[tuple[int, int]]:
        """``(address, length)`` of every tensor's rows (with their trailers' room) and
        of the arena: what to register."""
        n = self.num_blocks
        spans = [
            (base, stride * (n - 1) + width + self._tail)
            for base, stride, width in zip(self._base, self._stride, self._width, strict=True)
            if n
        ]
        if self._arena_span is not None:
            spans.append(self._arena_span)
        return spans

    def group_of(self, key: OffloadKey) -> int:
        group = get_offload_group_idx(key)
        if group >= len(self.payload):
            raise TransferSpecError(
                f"key {key.hex()} is of KV group {group}; the layout has {len(self.payload)}"
            )
        return group

    def object_bytes(self, key: OffloadKey) -> int:
        """Bytes of ``key``'s object: payload and trailer."""
        return self.payload[get_offload_group_idx(key)] + TRAILER_BYTES

    def buffers(self, group: int, row: int) -> list[np.ndarray]:
        """The block's payload (its rows, never the trailer room) as views."""
        views = self._views
        return [views[t][row] for t in self.group_tensors[group]]

    def write_trailers(self, groups: Sequence[int], rows: Sequence[int], raw: np.ndarray) -> None:
        """Store the ``(k, 64)`` trailers ``raw`` of blocks at ``rows``."""
        if not groups:
            return
        if all(g == groups[0] for g in groups):
            self._arena[groups[0]][list(rows)] = raw
            return
        for j, (group, row) in enumerate(zip(groups, rows, strict=True)):
            self._arena[group][row] = raw[j]

    def read_trailers(self, groups: Sequence[int], rows: Sequence[int]) -> np.ndarray:
        """The ``(k, 64)`` trailers of blocks at ``rows`` (a copy)."""
        if groups and all(g == groups[0] for g in groups):
            return self._arena[groups[0]][list(rows)]
        out = np.empty((len(rows), TRAILER_BYTES), dtype=np.uint8)
        for j, (group, row) in enumerate(zip(groups, rows, strict=True)):
            out[j] = self._arena[group][row]
        return out

    def pointers(self, group: int, row: int) -> tuple[list[int], list[int]]:
        """The block's buffers as ``(pointers, sizes)``, trailer last (a one-tensor
        block with its trailer in the row's room: one buffer)."""
        base, stride, width = self._base, self._stride, self._width
        tensors = self.group_tensors[group]
        ptrs = [base[t] + row * stride[t] for t in tensors]
        sizes = [width[t] for t in tensors]
        if self.in_row:
            sizes[-1] += TRAILER_BYTES
        else:
            ptrs.append(self._trailer_base[group] + row * TRAILER_BYTES)
            sizes.append(TRAILER_BYTES)
        return ptrs, sizes

    def pointer_lists(self, groups: Sequence[int], rows: Sequence[int]) -> Buffers:
        """The buffers of many blocks (one numpy pass when they share a group); flat
        lists when every block is one buffer."""
        if not groups or any(g != groups[0] for g in groups):
            pairs = [self.pointers(g, r) for g, r in zip(groups, rows, strict=True)]
            if pairs and all(len(p) == 1 for p, _ in pairs):
                return [p[0] for p, _ in pairs], [z[0] for _, z in pairs], True
            return [p for p, _ in pairs], [z for _, z in pairs], False
        group = groups[0]
        tensors = self.group_tensors[group]
        at = np.asarray(rows, dtype=np.int64)
        if self.single[group]:
            (t,) = tensors
            ptrs = self._base[t] + at * self._stride[t]
            return ptrs.tolist(), [self._width[t] + TRAILER_BYTES] * len(rows), True
        columns = [self._base[t] + at * self._stride[t] for t in tensors]
        sizes = [self._width[t] for t in tensors]
        if self.in_row:
            sizes[-1] += TRAILER_BYTES
        else:
            columns.append(self._trailer_base[group] + at * TRAILER_BYTES)
            sizes.append(TRAILER_BYTES)
        return np.stack(columns, axis=1).tolist(), [sizes] * len(rows), False


class MooncakeTierHandler(TierIOHandler[MooncakeLoadStoreSpec]):
    """One direction between the CPU pool and the cluster; see the module.

    ``on_overdue`` is called on the loop when a transfer passes its
    deadline; ``dispatcher`` runs the calls (default: a thread of its own).
    A transfer of more than ``pipeline_bytes`` is split into batch calls of
    about that many bytes, pipelined with their checksums on a helper thread
    (None: one call per transfer); ``checksum_threads`` threads compute or
    verify a call's checksums together.
    """

    def __init__(
        self,
        rows: BlockRows,
        client: MooncakeClient,
        *,
        to_cluster: bool,
        io_timeout: float,
        on_overdue: Overdue,
        pipeline_bytes: int | None = None,
        checksum_threads: int = 2,
        dispatcher: DispatchThread | None = None,
        poller_mode: PollerMode | None = None,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
    ) -> None:
        super().__init__(
            ("CPU", "MOONCAKE") if to_cluster else ("MOONCAKE", "CPU"),
            thread_name="aiokvo-mooncake-put" if to_cluster else "aiokvo-mooncake-get",
            io_timeout=io_timeout,
            on_overdue=on_overdue,
            dispatcher=dispatcher,
            poller_mode=poller_mode,
            max_buffered=max_buffered,
        )
        self.to_cluster = to_cluster
        self._rows = rows
        self._client = client
        if pipeline_bytes is not None:
            pipeline_bytes = check_int("pipeline_bytes", pipeline_bytes, minimum=1)
        self.pipeline_bytes = pipeline_bytes
        self.checksum_threads = check_int("checksum_threads", checksum_threads, minimum=1)
        self._pipeline: ThreadPoolExecutor | None = None
        self._hashers: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ submit
    def _submit(self, job_id: int, spec: TransferSpec) -> Submission:
        src, dst = self._check_route(spec)
        cpu, remote = (src, dst) if self.to_cluster else (dst, src)
        if not isinstance(cpu, CPULoadStoreSpec) or not isinstance(remote, MooncakeLoadStoreSpec):
            raise TransferSpecError(
                "a Mooncake transfer pairs a CPULoadStoreSpec with a MooncakeLoadStoreSpec, "
                f"got {spec!r}"
            )
        n = len(remote)
        if len(cpu) != n:
            raise TransferSpecError(f"{n} Mooncake blocks need {n} CPU blocks, got {len(cpu)}")
        rows = self._rows
        check_ids_in_range(cpu.block_ids, rows.num_blocks, "CPU block id", "Mooncake transfer")
        block_rows = cpu.block_ids.tolist()
        if len(set(block_rows)) != n:
            raise TransferSpecError(f"a Mooncake transfer names a CPU block twice: {block_rows}")
        groups = [rows.group_of(key) for key in remote.keys]
        total = sum(rows.payload[g] for g in groups)
        deadline = time.monotonic() + self.io_timeout
        job = self._put if self.to_cluster else self._get
        return self._dispatch_job(partial(job, remote, groups, block_rows, deadline), remote, total)

    # --------------------------------------------------------------- the calls
    def _chunks(self, groups: list[int]) -> list[tuple[int, int]]:
        """Index ranges of about ``pipeline_bytes`` of payload each, in order."""
        payload, limit = self._rows.payload, self.pipeline_bytes
        if limit is None:
            return [(0, len(groups))]
        chunks: list[tuple[int, int]] = []
        lo = total = 0
        for i, group in enumerate(groups):
            total += payload[group]
            if total >= limit:
                chunks.append((lo, i + 1))
                lo, total = i + 1, 0
        if lo < len(groups):
            chunks.append((lo, len(groups)))
        return chunks

    def _each(self, work: Callable[[int], None], lo: int, hi: int) -> None:
        """``work(i)`` for every block of ``lo:hi``, split over ``checksum_threads``
        threads (this one and the hashers: xxh3 releases the GIL)."""
        threads = min(self.checksum_threads, hi - lo)
        if threads <= 1:
            for i in range(lo, hi):
                work(i)
            return
        if self._hashers is None:
            name = "aiokvo-mooncake-hash"
            self._hashers = ThreadPoolExecutor(self.checksum_threads - 1, thread_name_prefix=name)
        bounds = [lo + (hi - lo) * t // threads for t in range(threads + 1)]

        def part(a: int, b: int) -> None:
            for i in range(a, b):
                work(i)

        others = [
            self._hashers.submit(part, bounds[t], bounds[t + 1]) for t in range(1, threads)
        ]
        try:
            part(bounds[0], bounds[1])
        finally:
            for future in others:
                future.result()

    def _helper(self) -> ThreadPoolExecutor:
        if self._pipeline is None:
            name = "aiokvo-mooncake-put-io" if self.to_cluster else "aiokvo-mooncake-verify"
            self._pipeline = ThreadPoolExecutor(1, thread_name_prefix=name)
        return self._pipeline

    def _run(
        self, remote: MooncakeLoadStoreSpec, deadline: float, first: Callable[[int, int], object],
        second: Callable[[int, int], object], groups: list[int],
    ) -> tuple[()]:  # fmt: skip
        """``first`` then ``second`` for each chunk, the chunk's ``second`` on the helper
        thread while the next chunk's ``first`` runs here (one chunk: all here)."""
        report = remote.report
        if time.monotonic() > deadline:
            report.fail_range(0, len(remote), BlockStatus.TIMEOUT, self._late())
            raise report.error  # type: ignore[misc]
        chunks = self._chunks(groups)
        pending: list[Future[object]] = []
        try:
            for lo, hi in chunks:
                first(lo, hi)
                if len(chunks) == 1:
                    second(lo, hi)
                else:
                    pending.append(self._helper().submit(second, lo, hi))
        finally:
            for future in pending:
                future.result()
        if report.error is not None:
            raise report.error
        return ()

    def _late(self) -> TierTimeoutError:
        return TierTimeoutError(
            f"Mooncake {'put' if self.to_cluster else 'get'} passed its deadline "
            f"({self.io_timeout} s) before its call started"
        )

    def _call(
        self,
        remote: MooncakeLoadStoreSpec,
        lo: int,
        hi: int,
        buffers: Buffers,
        deadline: float,
        broken: list[BaseException],
    ) -> list[int] | None:
        """One batch call for blocks ``lo:hi`` (``batch_put_from`` / ``batch_get_into``
        when each is one buffer, else the multi-buffer calls); None (the blocks marked)
        if it did not run or failed as a whole. After such a failure (``broken``),
        later chunks of the transfer are not tried: the cluster just failed."""
        report = remote.report
        if broken:
            report.fail_range(lo, hi, BlockStatus.RPC_FAILED, broken[0])
            return None
        if time.monotonic() > deadline:
            report.fail_range(lo, hi, BlockStatus.TIMEOUT, self._late())
            return None
        ptrs, sizes, single = buffers
        client = self._client
        if self.to_cluster:
            call: Callable[[list[str], Any, Any], list[int]] = (
                client.put_from if single else client.put
            )
        else:
            call = client.get_into if single else client.get
        try:
            codes = call(list(remote.names[lo:hi]), ptrs, sizes)
            if len(codes) != hi - lo:
                raise TierError(f"Mooncake answered {len(codes)} codes for {hi - lo} objects")
        except TierUnavailableError as exc:
            report.fail_range(lo, hi, BlockStatus.RPC_FAILED, exc)
            broken.append(exc)
            return None
        except Exception as exc:
            report.fail_range(lo, hi, BlockStatus.ERROR, exc)
            broken.append(exc)
            return None
        report.codes[lo:hi] = codes
        if codes and all(c < 0 and status_of_code(c) is BlockStatus.RPC_FAILED for c in codes):
            broken.append(TierUnavailableError(f"Mooncake answered {codes[0]} for every object"))
        return codes

    def _put(
        self, remote: MooncakeLoadStoreSpec, groups: list[int], block_rows: list[int],
        deadline: float,
    ) -> tuple[()]:  # fmt: skip
        """On the put thread: checksums and trailers chunk by chunk, each chunk's batch
        put on the helper thread while the next chunk is checksummed."""
        report, rows = remote.report, self._rows
        layout = rows.layout
        staged: dict[int, Buffers] = {}
        broken: list[BaseException] = []

        checksums = [0] * len(remote)
        key_hashes = [0] * len(remote)

        def checksum(i: int) -> None:
            checksums[i] = payload_checksum(rows.buffers(groups[i], block_rows[i]))
            key_hashes[i] = key_digest(remote.keys[i])

        def seal(lo: int, hi: int) -> None:
            self._each(checksum, lo, hi)
            at, of = block_rows[lo:hi], groups[lo:hi]
            sealed = seal_trailers(
                layout, key_hashes[lo:hi], [rows.payload[g] for g in of], checksums[lo:hi]
            )
            rows.write_trailers(of, at, sealed)
            staged[lo] = rows.pointer_lists(of, at)

        def put(lo: int, hi: int) -> None:
            codes = self._call(remote, lo, hi, staged.pop(lo), deadline, broken)
            if codes is None:
                return
            for i, code in zip(range(lo, hi), codes, strict=True):
                if code == 0:
                    report.status[i] = BlockStatus.OK
                    continue
                status = BlockStatus.ERROR if code == INVALID_PARAMS else status_of_code(code)
                report.fail(i, status, _code_error("put", remote.names[i], code, status))

        return self._run(remote, deadline, seal, put, groups)

    def _get(
        self, remote: MooncakeLoadStoreSpec, groups: list[int], block_rows: list[int],
        deadline: float,
    ) -> tuple[()]:  # fmt: skip
        """On the get thread: a batch get per chunk; each chunk's lengths, trailers and
        checksums are verified on the helper thread while the next chunk is read."""
        rows = self._rows
        fetched: dict[int, list[int]] = {}
        broken: list[BaseException] = []

        def get(lo: int, hi: int) -> None:
            buffers = rows.pointer_lists(groups[lo:hi], block_rows[lo:hi])
            codes = self._call(remote, lo, hi, buffers, deadline, broken)
            if codes is not None:
                fetched[lo] = codes

        def verify(lo: int, hi: int) -> None:
            codes = fetched.pop(lo, None)
            if codes is not None:
                self._verify(remote, lo, hi, codes, groups, block_rows)

        return self._run(remote, deadline, get, verify, groups)

    def _verify(
        self, remote: MooncakeLoadStoreSpec, lo: int, hi: int, codes: list[int],
        groups: list[int], block_rows: list[int],
    ) -> None:  # fmt: skip
        """Length, trailer and checksum of blocks ``lo:hi`` (read with ``codes``): their
        statuses. Payloads are hashed on ``checksum_threads`` threads, trailers at once."""
        report, rows = remote.report, self._rows
        payloads = [rows.payload[g] for g in groups[lo:hi]]
        whole = [code == n + TRAILER_BYTES for code, n in zip(codes, payloads, strict=True)]
        found = [0] * (hi - lo)
        key_hashes = [key_digest(k) for k in remote.keys[lo:hi]]

        def checksum(i: int) -> None:
            if whole[i - lo]:
                found[i - lo] = payload_checksum(rows.buffers(groups[i], block_rows[i]))

        self._each(checksum, lo, hi)
        raw = rows.read_trailers(groups[lo:hi], block_rows[lo:hi])
        sealed, stored = open_trailers(raw, rows.layout, key_hashes, payloads)
        for j, code in enumerate(codes):
            i, name = lo + j, remote.names[lo + j]
            if code < 0:
                status = status_of_code(code)
                report.fail(i, status, _code_error("get", name, code, status))
            elif not whole[j]:
                report.fail(
                    i, BlockStatus.SIZE_MISMATCH,
                    TierError(f"Mooncake get of {name} read {code} bytes, the block has "
                              f"{payloads[j] + TRAILER_BYTES}"),
                )  # fmt: skip
            elif not sealed[j]:
                report.fail(
                    i, BlockStatus.BAD_TRAILER,
                    TierChecksumError(f"Mooncake object {name} does not carry this block's "
                                      "trailer (another layout or key, or torn)"),
                )  # fmt: skip
            elif found[j] != int(stored[j]):
                report.fail(
                    i, BlockStatus.CHECKSUM,
                    TierChecksumError(f"Mooncake object {name}: checksum {found[j]:#018x}, "
                                      f"its writer stored {int(stored[j]):#018x}"),
                )  # fmt: skip
            else:
                report.status[i] = BlockStatus.OK

    async def _close_backend(self) -> None:
        self._shutdown_dispatcher()
        for pool in (self._pipeline, self._hashers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pipeline = self._hashers = None


def _code_error(what: str, name: str, code: int, status: BlockStatus) -> TierError:
    message = f"Mooncake {what} of {name} returned {code} ({status.name})"
    if status is BlockStatus.RPC_FAILED:
        return TierUnavailableError(message)
    return TierError(message)
