"""Offloading specs: what turns an :class:`OffloadConfig` into running parts.

A spec is the single owner of one offloading setup's manager (the control
plane, on the scheduler side) and its handlers (the data plane, on the worker
side). It builds each lazily and once, because the scheduler and the workers
ask for their halves at different times and may never ask for the other one.
Because it owns them, it also closes them: ``async with spec:`` or
``await spec.aclose()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from aiokvo._util import AsyncResource
from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError
from aiokvo.manager.base import OffloadingManager
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

if TYPE_CHECKING:
    import torch

    from aiokvo.handlers.base import CpuGpuHandlers
    from aiokvo.handlers.routes import HandlerRoute
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.memory.shared_region import SharedOffloadRegion

__all__ = ["CPUOffloadingSpec", "OffloadingSpec"]


class OffloadingSpec(AsyncResource, ABC):
    """Builds (once) and owns the manager and handlers of one offloading setup.

    Subclasses are constructed with a validated :class:`OffloadConfig` only,
    which is what lets :class:`~aiokvo.factory.OffloadingSpecFactory` load
    out-of-tree specs by name.
    """

    def __init__(self, config: OffloadConfig) -> None:
        if not isinstance(config, OffloadConfig):
            raise ConfigError(f"config must be an OffloadConfig, got {config!r}")
        self.config = config

    @property
    def block_size_factor(self) -> int:
        """GPU blocks per offloaded block."""
        return self.config.block_size_factor

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler-side manager; the same object on every call."""

    @abstractmethod
    def get_handlers(self, kv_caches: Any) -> Iterator[HandlerRoute]:
        """The worker-side handlers over ``kv_caches``, one route per direction."""

    async def aclose(self) -> None:
        """Release whatever the spec built. The base spec owns nothing."""
        return

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


class CPUOffloadingSpec(OffloadingSpec):
    """GPU <-> CPU offloading: a CPU block pool and a handler per direction.

    The pool holds ``config.num_cpu_blocks`` offloaded blocks. With
    ``config.instance_id`` set it is one
    :class:`~aiokvo.memory.shared_region.SharedOffloadRegion` per engine,
    named by the instance id and mapped by all ``config.world_size`` ranks
    (one row per block, ranks interleaved, this rank at ``config.rank``);
    the spec opens it with ``region_options`` (``directory``, ``timeout``,
    ``prefault``) and closes it. Otherwise every rank has a private pool.
    With ``store_threshold >= 2`` the manager is wrapped in a
    ``FilterReusedOffloadingManager`` so only blocks looked up that often are
    stored. ``handler_options`` go to the backend's handlers (for the host
    backend ``copy_threads``, ``poller_mode``, ``copy_fn``, ...; for CUDA
    ``engine``, ``kernel_below_bytes``, ...; for both ``region``, a region
    the caller opened and closes); vLLM's factory constructs specs from the
    config alone, so they are optional.
    """

    def __init__(
        self,
        config: OffloadConfig,
        *,
        handler_options: Mapping[str, Any] | None = None,
        region_options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config)
        self.handler_options: dict[str, Any] = dict(handler_options or {})
        self.region_options: dict[str, Any] = dict(region_options or {})
        self._manager: OffloadingManager | None = None
        self._handlers: CpuGpuHandlers | None = None
        self._region: SharedOffloadRegion | None = None

    @property
    def num_blocks(self) -> int:
        """Offloaded blocks in the CPU pool."""
        return self.config.num_cpu_blocks

    @property
    def cpu_tensors(self) -> tuple[torch.Tensor, ...]:
        """The CPU pool's tensors, one per canonical KV tensor, once handlers are built
        (empty before, and after closing)."""
        return () if self._handlers is None else self._handlers.cpu_tensors

    @property
    def cpu_row_tail_bytes(self) -> int:
        """Room after every pool row, outside :attr:`cpu_tensors` (``handler_options``'
        ``row_tail_bytes``, granted by private pools only), once handlers are built."""
        return 0 if self._handlers is None else self._handlers.row_tail_bytes

    @property
    def region(self) -> SharedOffloadRegion | None:
        """The shared region the spec opened as the pool, once handlers are built."""
        return self._region

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._check_budget()
            self._manager = self._build_manager()
        return self._manager

    def _build_manager(self) -> OffloadingManager:
        # Imported here so loading a spec by name stays cheap.
        from aiokvo.manager.cpu import CPUOffloadingManager

        config = self.config
        # The modes are passed only when chosen: the seed's calls stay as they were.
        modes: dict[str, Any] = {} if config.recency == "touch" else {"recency": config.recency}
        manager: OffloadingManager = CPUOffloadingManager(
            num_blocks=config.num_cpu_blocks,
            cache_policy=config.eviction_policy,
            enable_events=config.enable_events,
            **modes,
        )
        if config.store_threshold >= 2:
            from aiokvo.manager.reuse import FilterReusedOffloadingManager

            counting: dict[str, Any] = (
                {} if config.store_counting == "lookups" else {"counting": config.store_counting}
            )
            manager = FilterReusedOffloadingManager(
                manager,
                store_threshold=config.store_threshold,
                max_tracker_size=config.max_tracker_size,
                **counting,
            )
        return manager

    def _check_budget(self) -> None:
        """A budget below one offloaded block is an error, not an empty pool."""
        config = self.config
        if config.kv_bytes_per_block and config.num_cpu_blocks == 0:
            raise ConfigError(
                f"cpu_bytes_to_use={config.cpu_bytes_to_use} is below one offloaded block: "
                f"kv_bytes_per_block={config.kv_bytes_per_block} x world_size="
                f"{config.world_size} x block_size_factor={config.block_size_factor} = "
                f"{config.kv_bytes_per_offloaded_block} bytes"
            )

    def _check_kv_caches(self, kv_caches: object) -> CanonicalKVCaches:
        """The KV caches, checked against the config that sized the pool."""
        from aiokvo.layout import CanonicalKVCaches

        if not isinstance(kv_caches, CanonicalKVCaches):
            raise ConfigError(
                "kv_caches must be CanonicalKVCaches (see CanonicalKVCaches.from_engine), "
                f"got {type(kv_caches).__name__}"
            )
        config = self.config
        actual = kv_caches.page_bytes_per_block
        if actual != config.kv_bytes_per_block:
            pool = config.num_cpu_blocks * actual * config.block_size_factor * config.world_size
            raise ConfigError(
                f"kv_bytes_per_block={config.kv_bytes_per_block} but the KV caches hold "
                f"{actual} bytes per GPU block on this rank ({len(kv_caches.tensors)} tensors); "
                f"a pool of num_cpu_blocks={config.num_cpu_blocks} would take {pool} bytes "
                f"against cpu_bytes_to_use={config.cpu_bytes_to_use}"
            )
        self._check_budget()
        return kv_caches

    def get_handlers(self, kv_caches: Any) -> Iterator[HandlerRoute]:
        """``(GPU, CPU, store handler)`` then ``(CPU, GPU, load handler)``.

        The handlers (and the CPU pool behind them) are built on the first
        call, which raises at once if they cannot be: ``kv_caches`` must be
        :class:`~aiokvo.layout.CanonicalKVCaches` holding
        ``config.kv_bytes_per_block`` bytes per block (the figure the pool was
        sized with), and the budget must fit one offloaded block. With
        ``config.instance_id`` this call opens the shared region, which may
        wait up to its ``timeout`` for a peer rank that is creating it. Later
        calls return the same handlers whatever ``kv_caches`` they are given,
        as vLLM does.
        """
        if self._handlers is None:
            checked = self._check_kv_caches(kv_caches)
            # Lazy: importing the data plane pulls in torch and, maybe, CUDA.
            from aiokvo.handlers.routes import make_cpu_gpu_handlers

            options = dict(self.handler_options)
            region = None
            if self.config.instance_id is not None and "region" not in options:
                region = options["region"] = self._open_region()
            try:
                self._handlers = make_cpu_gpu_handlers(
                    checked,
                    block_size_factor=self.config.block_size_factor,
                    num_cpu_blocks=self.config.num_cpu_blocks,
                    **options,
                )
            except BaseException:
                if region is not None:
                    region.close()
                raise
            self._region = region
        handlers = self._handlers
        routes: list[HandlerRoute] = [
            (GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu),
            (CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu),
        ]
        return iter(routes)

    def _open_region(self) -> SharedOffloadRegion:
        from aiokvo.memory.shared_region import SharedOffloadRegion

        config = self.config
        assert config.instance_id is not None
        return SharedOffloadRegion(
            config.instance_id,
            num_blocks=config.num_cpu_blocks,
            num_workers=config.world_size,
            page_bytes_per_rank=config.kv_bytes_per_block * config.block_size_factor,
            rank=config.rank,
            **self.region_options,
        )

    async def aclose(self) -> None:
        """Close the handlers (draining their copies), then the region the spec
        opened, then shut the manager down.

        Idempotent; a later ``get_*`` call builds fresh parts.
        """
        handlers, self._handlers = self._handlers, None
        region, self._region = self._region, None
        manager, self._manager = self._manager, None
        try:
            if handlers is not None:
                await handlers.aclose()
        finally:
            try:
                if region is not None:
                    region.close()
            finally:
                if manager is not None:
                    manager.shutdown()
