"""Offloaders opened for one test and checked for leaks when it ends (the ``offloader`` fixtures).

A scheduler under test usually needs an Offloader over engine-shaped KV
caches and, afterwards, the certainty that it left nothing behind: no lease
still pinning blocks, no store whose reservation never completed, no block
lost from the pool. :class:`OffloaderFactory` gives both: it opens
Offloaders, and on :meth:`~OffloaderFactory.aclose` waits for their copies,
checks each through :func:`~aiokvo.testing.assert_no_leaks`, closes it and
only then reports, so one failing check never leaves an Offloader open.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aiokvo._util import check_int
from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError
from aiokvo.offloader import Offloader
from aiokvo.testing.kv import KVCaches, make_kv_caches
from aiokvo.testing.leaks import offloader_leaks
from aiokvo.tiers.base import Tier

__all__ = ["OffloaderFactory", "offload_config"]

DEFAULT_CPU_BLOCKS = 32


def offload_config(
    kv: KVCaches, *, cpu_blocks: int = DEFAULT_CPU_BLOCKS, **options: Any
) -> OffloadConfig:
    """An :class:`~aiokvo.OffloadConfig` whose CPU pool holds ``cpu_blocks`` of ``kv``'s blocks.

    The geometry (block size, bytes per block) comes from ``kv``; ``options``
    are any other ``OffloadConfig`` fields (``eviction_policy``, ``tiers``, ...).
    """
    if not isinstance(kv, KVCaches):
        raise ConfigError(f"kv must be a KVCaches (the kv_caches fixture's), got {kv!r}")
    cpu_blocks = check_int("cpu_blocks", cpu_blocks, minimum=1)
    page = kv.canonical.page_bytes_per_block
    return OffloadConfig(
        gpu_block_sizes=(kv.block_size,),
        hash_block_size=kv.block_size,
        kv_bytes_per_block=page,
        cpu_bytes_to_use=cpu_blocks * page,
        **options,
    )


class OffloaderFactory:
    """``await make_offloader(kv=None, *, cpu_blocks=32, ...)``: an open :class:`~aiokvo.Offloader`.

    Each Offloader made is closed by :meth:`aclose` (the fixture calls it when
    the test ends) after its copies have finished and it has been checked for
    leaks; every problem of every Offloader is reported in one
    ``AssertionError``. An Offloader the test closed itself is only checked
    for what its close could not undo.
    """

    def __init__(self) -> None:
        self._made: list[Offloader] = []

    async def __call__(
        self,
        kv: KVCaches | None = None,
        *,
        cpu_blocks: int = DEFAULT_CPU_BLOCKS,
        config: OffloadConfig | None = None,
        tiers: Sequence[Tier] | None = None,
        handler_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Offloader:
        """Open an Offloader over ``kv`` (default: ``make_kv_caches()``'s 2 x 64 blocks).

        ``config`` wins over ``cpu_blocks`` and ``options`` (which go to
        :func:`offload_config`); ``tiers`` and ``handler_options`` go to the
        Offloader.
        """
        if kv is None:
            kv = make_kv_caches()
        if config is None:
            config = offload_config(kv, cpu_blocks=cpu_blocks, **options)
        elif options:
            raise ConfigError(f"pass config or OffloadConfig options, not both: {sorted(options)}")
        offloader = Offloader(config, kv.canonical, tiers=tiers, handler_options=handler_options)
        self._made.append(offloader)
        await offloader.open()
        return offloader

    @property
    def made(self) -> tuple[Offloader, ...]:
        """The Offloaders made so far, in order."""
        return tuple(self._made)

    async def aclose(self) -> None:
        """Let each Offloader's copies finish, check it for leaks, close it; then report."""
        problems: list[str] = []
        for number, offloader in enumerate(self._made):
            try:
                if not offloader.closed:
                    await offloader.drain()
                problems += [f"Offloader {number}: {p}" for p in offloader_leaks(offloader)]
            finally:
                await offloader.aclose()
        self._made.clear()
        if problems:
            raise AssertionError("aiokvo resources leaked:\n  " + "\n  ".join(problems))
