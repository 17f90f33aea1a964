"""Cache policies: which cached block the CPU manager drops next.

Choose one by name (``"lru"``, ``"arc"``, ``"slru"``, ``"sieve"``,
``"s3fifo"``, ``"chain"``), pass a :class:`CachePolicy`
subclass, or name an out-of-tree one as ``"package.module:ClassName"``.
"""

from aiokvo.manager.policies.arc import ARCCachePolicy
from aiokvo.manager.policies.base import WRITING, BlockStatus, CachePolicy, Evicted
from aiokvo.manager.policies.chain import ChainCachePolicy
from aiokvo.manager.policies.lru import LRUCachePolicy
from aiokvo.manager.policies.registry import BUILTIN_POLICIES, resolve_policy
from aiokvo.manager.policies.s3fifo import S3FIFOCachePolicy
from aiokvo.manager.policies.sieve import SIEVECachePolicy
from aiokvo.manager.policies.slru import SLRUCachePolicy

__all__ = [
    "ARCCachePolicy",
    "BUILTIN_POLICIES",
    "WRITING",
    "BlockStatus",
    "CachePolicy",
    "ChainCachePolicy",
    "Evicted",
    "LRUCachePolicy",
    "S3FIFOCachePolicy",
    "SIEVECachePolicy",
    "SLRUCachePolicy",
    "resolve_policy",
]
