"""``PrefixLease``: a ready prefix pinned now, loaded later.

Some schedulers (vLLM's is one) decide what to load inside a synchronous
scheduling step and start the copy afterwards. :meth:`Offloader.pin_prefix
<aiokvo.Offloader.pin_prefix>` looks the prefix up and pins it in one
synchronous call, so nothing can evict it in between; the lease then holds
the pins until :meth:`PrefixLease.load_into` has copied the blocks, or until
:meth:`PrefixLease.release` gives them back unused.
"""

from __future__ import annotations

from typing import Protocol

from aiokvo._util import AsyncResource
from aiokvo.errors import LeaseError
from aiokvo.keys import OffloadKey
from aiokvo.offloader.blocks import GpuBlockIds, GpuGeometry
from aiokvo.offloader.inflight import InFlight
from aiokvo.specs import GPULoadStoreSpec, LoadStoreSpec, TransferResult

__all__ = ["LeaseOwner", "PrefixLease"]


class LeaseOwner(Protocol):
    """What a lease needs from its :class:`~aiokvo.Offloader` (which implements it)."""

    _geometry: GpuGeometry

    def _check_open(self, what: str) -> None: ...

    def _start_load(
        self,
        keys: list[OffloadKey],
        src: LoadStoreSpec,
        dst: GPULoadStoreSpec,
        lease: PrefixLease | None,
    ) -> InFlight: ...

    async def _wait(self, copy: InFlight) -> TransferResult: ...

    def _release_lease(self, lease: PrefixLease) -> None: ...

_PINNED, _LOADING, _RELEASED = "pinned", "loading", "released"


class PrefixLease(AsyncResource):
    """Pins on the first :attr:`count` keys of a lookup, until loaded or released.

    :attr:`keys` are the pinned keys and :attr:`src_spec` says where they are
    in the CPU pool. ``await lease.load_into(gpu_block_ids)`` copies them
    into those GPU blocks and releases the pins when the copy has finished;
    :meth:`release` gives them back without loading (idempotent, and a no-op
    while a load is running: that load releases them). ``async with lease:``
    releases on the way out. A lease is used at most once.
    """

    __slots__ = ("_offloader", "_state", "keys", "src_spec")

    def __init__(
        self, offloader: LeaseOwner, keys: list[OffloadKey], src_spec: LoadStoreSpec
    ) -> None:
        self._offloader = offloader
        self.keys: tuple[OffloadKey, ...] = tuple(keys)
        self.src_spec = src_spec
        self._state = _PINNED  # for a miss (no keys) that pins nothing

    @property
    def count(self) -> int:
        """How many leading keys were ready and are pinned (0 for a miss)."""
        return len(self.keys)

    @property
    def released(self) -> bool:
        """True once the pins are given back (after a load, or by :meth:`release`)."""
        return self._state == _RELEASED

    async def load_into(self, gpu_block_ids: GpuBlockIds) -> int:
        """Copy the pinned blocks into ``gpu_block_ids``; :attr:`count` on success, else 0.

        ``gpu_block_ids`` takes the forms of :meth:`Offloader.load_prefix
        <aiokvo.Offloader.load_prefix>`, for exactly :attr:`count` keys.
        Cancelling the caller cancels the wait, not the copy; the pins are
        released when the copy ends either way. Raises
        :class:`~aiokvo.errors.LeaseError` if the lease was released or already
        loaded, and bad ``gpu_block_ids`` raise before anything changes.
        """
        offloader = self._offloader
        if self._state != _PINNED:
            raise LeaseError(f"this lease of {self.count} keys is {self._state}; it loads once")
        offloader._check_open("load_into")
        blocks = offloader._geometry.resolve(
            self.count, gpu_block_ids, "load_into", distinct=True
        )
        if not self.keys:
            self._state = _RELEASED
            return 0
        self._state = _LOADING  # a failed submission releases the pins and says so (_loaded)
        copy = offloader._start_load(list(self.keys), self.src_spec, blocks.all(), self)
        result = await offloader._wait(copy)
        return self.count if result.success else 0

    def release(self) -> None:
        """Give the pins back now if no load holds them; idempotent."""
        if self._state == _PINNED:
            self._state = _RELEASED
            self._offloader._release_lease(self)

    def _loaded(self) -> None:
        """The load's copy ended (or never started) and its pins were released."""
        self._state = _RELEASED

    async def aclose(self) -> None:
        """:meth:`release` (for ``async with``)."""
        self.release()

    async def __aenter__(self) -> PrefixLease:
        return self

    def __repr__(self) -> str:
        return f"<PrefixLease count={self.count} {self._state}>"

