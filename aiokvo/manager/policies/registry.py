"""Resolve a cache policy from a name, a class, or a module path.

Built-in names are ``"lru"`` and ``"arc"`` (vLLM's two), and aiokvo's own
``"slru"``, ``"sieve"``, ``"s3fifo"`` and ``"chain"`` (docs/policies.md says
when to pick which). Anything else is treated as
``"package.module:ClassName"`` (or ``"package.module.ClassName"``) so an
out-of-tree policy can be plugged in from configuration alone.
"""

from __future__ import annotations

import importlib

from aiokvo.errors import UnknownPolicyError
from aiokvo.manager.policies.arc import ARCCachePolicy
from aiokvo.manager.policies.base import CachePolicy
from aiokvo.manager.policies.chain import ChainCachePolicy
from aiokvo.manager.policies.lru import LRUCachePolicy
from aiokvo.manager.policies.s3fifo import S3FIFOCachePolicy
from aiokvo.manager.policies.sieve import SIEVECachePolicy
from aiokvo.manager.policies.slru import SLRUCachePolicy

__all__ = ["BUILTIN_POLICIES", "resolve_policy"]

BUILTIN_POLICIES: dict[str, type[CachePolicy]] = {
    "lru": LRUCachePolicy,
    "arc": ARCCachePolicy,
    "slru": SLRUCachePolicy,
    "sieve": SIEVECachePolicy,
    "s3fifo": S3FIFOCachePolicy,
    "chain": ChainCachePolicy,
}


def resolve_policy(policy: str | type[CachePolicy]) -> type[CachePolicy]:
    """The :class:`CachePolicy` subclass that ``policy`` names."""
    if isinstance(policy, type):
        if issubclass(policy, CachePolicy):
            return policy
        raise UnknownPolicyError(f"cache policy {policy!r} is not a CachePolicy subclass")
    if not isinstance(policy, str):
        raise UnknownPolicyError(f"cache policy must be a name or a class, got {policy!r}")
    builtin = BUILTIN_POLICIES.get(policy)
    if builtin is not None:
        return builtin
    return _import_policy(policy)


def _import_policy(path: str) -> type[CachePolicy]:
    module_name, sep, class_name = path.partition(":")
    if not sep:
        module_name, _, class_name = path.rpartition(".")
    if not module_name or not class_name:
        raise UnknownPolicyError(
            f"unknown cache policy {path!r}: expected one of "
            f"{sorted(BUILTIN_POLICIES)} or 'package.module:ClassName'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownPolicyError(
            f"unknown cache policy {path!r}: cannot import module {module_name!r} ({exc})"
        ) from exc
    found = getattr(module, class_name, None)
    if not (isinstance(found, type) and issubclass(found, CachePolicy)):
        raise UnknownPolicyError(
            f"unknown cache policy {path!r}: {module_name!r} has no CachePolicy "
            f"subclass named {class_name!r}"
        )
    return found
