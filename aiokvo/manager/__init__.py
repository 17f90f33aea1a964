"""The pure core: offloading managers and their cache policies (no asyncio, no CUDA)."""

from aiokvo.manager.base import OffloadingManager, StoreRefusal
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.manager.policies import (
    ARCCachePolicy,
    BlockStatus,
    CachePolicy,
    LRUCachePolicy,
    resolve_policy,
)
from aiokvo.manager.reuse import FilterReusedOffloadingManager
from aiokvo.manager.sink import EventSink, OverflowPolicy
from aiokvo.manager.stats import ManagerStatistics

__all__ = [
    "ARCCachePolicy",
    "BlockStatus",
    "CPUOffloadingManager",
    "CachePolicy",
    "EventSink",
    "FilterReusedOffloadingManager",
    "LRUCachePolicy",
    "ManagerStatistics",
    "OffloadingManager",
    "OverflowPolicy",
    "StoreRefusal",
    "resolve_policy",
]
