"""``AiokvoOffloadingSpec``: what vLLM's OffloadingConnector loads by name.

vLLM's factory imports ``spec_module_path``, takes ``spec_name`` from it,
checks that it subclasses vLLM's own ``OffloadingSpec`` and constructs it
with the ``OffloadingConfig`` alone, once per connector: in one process with
``world_size == 1`` there is a scheduler-role instance (asked only for
``get_manager``) and a worker-role one (asked only for ``get_worker``).

The spec maps vLLM's config onto an aiokvo :class:`~aiokvo.config.OffloadConfig`
with vLLM 0.32's rules (``recency="request"``, ``store_counting="offers"``)
and a pool of exactly as many chunks as vLLM's own CPU spec would make,
then lets an aiokvo :class:`~aiokvo.offloading_spec.CPUOffloadingSpec` build
the manager and the handlers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.base import OffloadingSpec as VllmOffloadingSpec

from aiokvo._util import check_choice, check_int
from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError
from aiokvo.integrations.vllm.extra_config import AIOKVO_KEYS, check_extra_config, tier_configs
from aiokvo.integrations.vllm.failures import FailureLog, StoreFailures, failure_log_path
from aiokvo.integrations.vllm.manager import AiokvoOffloadingManager
from aiokvo.integrations.vllm.metrics import (
    CONFIG_INFO_KEYS,
    metric_definitions,
    store_threshold,
)
from aiokvo.integrations.vllm.worker import AiokvoOffloadingWorker, LoadFailurePolicy
from aiokvo.manager.retention import Retention
from aiokvo.offloading_spec import CPUOffloadingSpec

if TYPE_CHECKING:
    from aiokvo.integrations.vllm.tiering import SchedulerTiers
    from aiokvo.runtime.pump import LoopDriverMode
    from aiokvo.tiers.registry import TierConfig

__all__ = ["CHUNK_ALIGNMENT", "AIOKVO_KEYS", "AiokvoOffloadingSpec", "offload_config"]

CHUNK_ALIGNMENT = 4096
"""vLLM's CPU spec rounds each chunk's bytes up to a page (``mmap.PAGESIZE``)
when it sizes the pool; the same rounding gives the same number of chunks."""




def _config_int(extra: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An integer from the extra config the way vLLM reads it (``int(value)``)."""
    value = extra.get(key, default)
    if value is None:
        raise ConfigError(f"{key} must be specified in kv_connector_extra_config")
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be an integer, got {value!r}") from None


def offload_config(config: Any, *, shared_pool: bool = False) -> OffloadConfig:
    """aiokvo's config for vLLM's ``OffloadingConfig`` (0.32), with 0.32's rules.

    The pool holds ``cpu_bytes_to_use // round_up(worker_kv_bytes_per_block *
    world_size * blocks_per_chunk, 4096)`` chunks, vLLM's own count. It is a
    shared region named by the engine id when ``world_size > 1`` or
    ``shared_pool`` (tiers: the manager's process reads and writes it too).
    """
    extra = config.extra_config
    if config.canonical_layout:
        raise ConfigError(
            "canonical_layout is not supported by aiokvo's spec; remove it from "
            "kv_connector_extra_config"
        )
    cpu_bytes = _config_int(extra, "cpu_bytes_to_use")
    if cpu_bytes <= 0:
        raise ConfigError(f"cpu_bytes_to_use must be > 0, got {cpu_bytes}")
    per_block = check_int("worker_kv_bytes_per_block", config.worker_kv_bytes_per_block, minimum=0)
    parallel = config.parallel
    world = max(1, int(parallel.world_size))
    shared = world > 1 or shared_pool
    per_chunk_bytes = 0
    blocks_per_chunk = int(config.cache.blocks_per_chunk)
    sizes = tuple(int(g.tokens_per_block) for g in config.groups)
    if not sizes:
        sizes = (int(config.cache.tokens_per_hash) * blocks_per_chunk,)
    if per_block:
        per_chunk = per_block * world * blocks_per_chunk
        num_chunks = cpu_bytes // (-(-per_chunk // CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT)
        # aiokvo's pool is cpu_bytes_to_use // per_chunk blocks: give it exactly vLLM's count.
        per_chunk_bytes = num_chunks * per_chunk
    offloaded: int | None = None
    if blocks_per_chunk > 1:
        if len(set(sizes)) != 1:
            raise ConfigError(
                f"blocks_per_chunk={blocks_per_chunk} needs every offloaded KV group to have "
                f"one block size; got tokens_per_block {sizes}"
            )
        offloaded = sizes[0] * blocks_per_chunk
    return OffloadConfig(
        gpu_block_sizes=sizes,
        hash_block_size=int(config.cache.tokens_per_hash),
        cpu_bytes_to_use=per_chunk_bytes or cpu_bytes,
        kv_bytes_per_block=per_block,
        offloaded_block_size=offloaded,
        eviction_policy=str(extra.get("eviction_policy", "lru")),
        store_threshold=max(0, store_threshold(extra)),
        max_tracker_size=_config_int(extra, "max_tracker_size", 64_000),
        recency="request",
        store_counting="offers",
        enable_events=bool(config.enable_kv_cache_events),
        world_size=world,
        rank=int(parallel.rank) if world > 1 else 0,
        instance_id=str(config.engine_id) if shared else None,
        retention_fraction=float(extra.get("aiokvo_retention_fraction", 0.25)),
    )


class AiokvoOffloadingSpec(VllmOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``OffloadingSpec`` for aiokvo; see the module docstring and docs/vllm.md.

    ``inner_spec_class`` is the aiokvo spec that builds the manager and the
    handlers from :attr:`aiokvo_config` (a subclass may change the data plane).
    """

    inner_spec_class: type[CPUOffloadingSpec] = CPUOffloadingSpec

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions(check_extra_config(extra_config))  # the front end's check

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels: those of vLLM's CPU spec."""
        return CONFIG_INFO_KEYS

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        extra = check_extra_config(config.extra_config)  # every key, before anything else
        unknown = sorted(k for k in extra if k.startswith("aiokvo_") and k not in AIOKVO_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown aiokvo keys {unknown} in kv_connector_extra_config; "
                f"known: {sorted(AIOKVO_KEYS)}"
            )
        if extra.get("cache_policy_module_path") is not None:
            raise ConfigError(
                "cache_policy_module_path names a vLLM CachePolicy; with aiokvo give an "
                "aiokvo policy as eviction_policy='package.module:ClassName'"
            )
        model = getattr(config, "model", None)
        self.tier_configs: tuple[TierConfig, ...] = ()
        if extra.get("aiokvo_tiers") is not None:
            self.tier_configs = tier_configs(
                extra["aiokvo_tiers"], model_id=str(getattr(model, "name", "") or "vllm-model")
            )
        self._kv_dtype = str(getattr(model, "dtype", "") or "") or None
        self.aiokvo_config = offload_config(config, shared_pool=bool(self.tier_configs))
        self.loop_mode: LoopDriverMode = check_choice(
            "aiokvo_loop", extra.get("aiokvo_loop", "auto"), ("auto", "pump", "thread")
        )
        self.retries = check_int("aiokvo_retries", extra.get("aiokvo_retries", 2), minimum=0)
        self.on_load_failure: LoadFailurePolicy = check_choice(
            "aiokvo_on_load_failure", extra.get("aiokvo_on_load_failure", "report"),
            ("report", "raise"),
        )
        options = extra.get("aiokvo_handler_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"aiokvo_handler_options must be a mapping, got {options!r}")
        self.handler_options: dict[str, Any] = dict(options)
        self._engine_id = str(config.engine_id)
        parallel = config.parallel
        self._world = max(1, int(parallel.world_size))
        self._rank = int(parallel.rank) if self._world > 1 else 0
        self._manager: AiokvoOffloadingManager | None = None
        self._worker: AiokvoOffloadingWorker | None = None

    @property
    def num_chunks(self) -> int:
        """CPU chunks in the pool (vLLM's name for offloaded blocks)."""
        return self.aiokvo_config.num_cpu_blocks

    def config_info(self) -> dict[str, Any]:
        """The values of :meth:`config_info_keys`, computed as vLLM 0.33's CPU spec does."""
        config = self.config
        chunks = self.num_chunks
        bpc = int(config.cache.blocks_per_chunk)
        per_chunk = int(config.worker_kv_bytes_per_block) * self._world * bpc
        per_chunk = -(-per_chunk // CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT
        max_len = int(getattr(config.model, "max_model_len", 0) or 0)
        tokens: int | str = "None"
        if max_len > 0 and config.groups:
            per_request = 0
            for group in config.groups:
                need = -(-max_len // (int(group.tokens_per_block) * bpc))
                window = getattr(group, "sliding_window_size_in_chunks", None)
                per_request += need if window is None else min(need, int(window))
            tokens = chunks * max_len // per_request
        return {
            "cpu_num_chunks": chunks,
            "cpu_blocks_per_chunk": bpc,
            "cpu_kv_cache_size_bytes": chunks * per_chunk,
            "cpu_kv_cache_size_tokens": tokens,
        }

    def failure_log(self) -> FailureLog:
        """This worker rank's end of the store-failure path (:mod:`~.failures`)."""
        from aiokvo.memory.shared_region import default_directory

        path = failure_log_path(default_directory(), self._engine_id, self._rank)
        return FailureLog(path, max(1, self.num_chunks))

    def _store_failures(self) -> StoreFailures:
        from aiokvo.memory.shared_region import default_directory

        directory = default_directory()
        logs: list[FailureLog] = []
        try:
            for rank in range(self._world):
                path = failure_log_path(directory, self._engine_id, rank)
                logs.append(FailureLog(path, max(1, self.num_chunks), owner=True))
        except BaseException:
            for log in logs:
                log.close()
            raise
        return StoreFailures(logs)

    def get_manager(self) -> AiokvoOffloadingManager:
        if self._manager is None:
            config = self.aiokvo_config
            inner = self.inner_spec_class(config)
            budget = int(config.num_cpu_blocks * config.retention_fraction)
            manager = inner.get_manager()
            failures = self._store_failures()
            tiers = None
            try:
                if self.tier_configs:
                    tiers = self._open_tiers(manager)
                self._manager = AiokvoOffloadingManager(
                    manager,
                    failures,
                    config_info=self.config_info(),
                    enable_events=config.enable_events,
                    retention=Retention(budget) if budget else None,
                    tiers=tiers,
                )
            except BaseException:
                if tiers is not None:
                    tiers.close()
                failures.close()
                raise
        return self._manager

    def _open_tiers(self, manager: Any) -> SchedulerTiers:
        from aiokvo.integrations.vllm.tiering import open_scheduler_tiers
        from aiokvo.manager.cpu import CPUOffloadingManager

        core = getattr(manager, "backing", manager)
        assert isinstance(core, CPUOffloadingManager), core
        config = self.aiokvo_config
        assert config.instance_id is not None  # offload_config(shared_pool=True)
        # Without vLLM's dtype, a tier without its own dtype refuses to bind (ConfigError).
        return open_scheduler_tiers(
            self.tier_configs, config, core, instance_id=config.instance_id, dtype=self._kv_dtype
        )

    def get_worker(self, kv_caches: Any) -> AiokvoOffloadingWorker:
        if self._worker is None:
            from aiokvo.integrations.vllm.runner import build_worker

            self._worker = build_worker(self, kv_caches)
        return self._worker
