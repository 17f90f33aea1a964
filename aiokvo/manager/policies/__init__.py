"""Cache policies: which cached block the CPU manager drops next.

Choose one by name (``"lru"``, ``"arc"``), pass a :class:`CachePolicy`
subclass, or name an out-of-tree one as ``"package.module:ClassName"``.
"""

from aiokvo.manager.policies.arc import ARCCachePolicy
from aiokvo.manager.policies.base import WRITING, BlockStatus, CachePolicy, Evicted
from aiokvo.manager.policies.lru import LRUCachePolicy
from aiokvo.manager.policies.registry import BUILTIN_POLICIES, resolve_policy

__all__ = [
    "ARCCachePolicy",
    "BUILTIN_POLICIES",
    "WRITING",
    "BlockStatus",
    "CachePolicy",
    "Evicted",
    "LRUCachePolicy",
    "resolve_policy",
]
