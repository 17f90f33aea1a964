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
    from aiokvo.handlers.base import CpuGpuHandlers
    from aiokvo.handlers.routes import HandlerRoute

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
    ``store_threshold >= 2`` the manager is wrapped in a
    ``FilterReusedOffloadingManager`` so only blocks looked up that often are
    stored. ``handler_options`` go to the backend's handlers (for the host
    backend ``copy_threads``, ``poller_mode``, ``copy_fn``, ...; for CUDA
    ``engine``, ``kernel_below_bytes``, ...); vLLM's factory constructs specs
    from the config alone, so they are optional.
    """

    def __init__(
        self, config: OffloadConfig, *, handler_options: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(config)
        self.handler_options: dict[str, Any] = dict(handler_options or {})
        self._manager: OffloadingManager | None = None
        self._handlers: CpuGpuHandlers | None = None

    @property
    def num_blocks(self) -> int:
        """Offloaded blocks in the CPU pool."""
        return self.config.num_cpu_blocks

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _build_manager(self) -> OffloadingManager:
        # Imported here so loading a spec by name stays cheap.
        from aiokvo.manager.cpu import CPUOffloadingManager

        config = self.config
        manager: OffloadingManager = CPUOffloadingManager(
            num_blocks=config.num_cpu_blocks,
            cache_policy=config.eviction_policy,
            enable_events=config.enable_events,
        )
        if config.store_threshold >= 2:
            from aiokvo.manager.reuse import FilterReusedOffloadingManager

            manager = FilterReusedOffloadingManager(
                manager,
                store_threshold=config.store_threshold,
                max_tracker_size=config.max_tracker_size,
            )
        return manager

    def get_handlers(self, kv_caches: Any) -> Iterator[HandlerRoute]:
        """``(GPU, CPU, store handler)`` then ``(CPU, GPU, load handler)``.

        The handlers (and the CPU tensors behind them) are built on the first
        call, which raises at once if they cannot be; later calls return the
        same handlers whatever ``kv_caches`` they are given, as vLLM does.
        """
        if self._handlers is None:
            # Lazy: importing the data plane pulls in torch and, maybe, CUDA.
            from aiokvo.handlers.routes import make_cpu_gpu_handlers

            self._handlers = make_cpu_gpu_handlers(
                kv_caches,
                block_size_factor=self.config.block_size_factor,
                num_cpu_blocks=self.config.num_cpu_blocks,
                **self.handler_options,
            )
        handlers = self._handlers
        routes: list[HandlerRoute] = [
            (GPULoadStoreSpec, CPULoadStoreSpec, handlers.gpu_to_cpu),
            (CPULoadStoreSpec, GPULoadStoreSpec, handlers.cpu_to_gpu),
        ]
        return iter(routes)

    async def aclose(self) -> None:
        """Close the handlers (draining their copies), then shut the manager down.

        Idempotent; a later ``get_*`` call builds fresh parts.
        """
        handlers, self._handlers = self._handlers, None
        manager, self._manager = self._manager, None
        try:
            if handlers is not None:
                await handlers.aclose()
        finally:
            if manager is not None:
                manager.shutdown()
