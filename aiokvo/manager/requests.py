"""Per-request recency (``recency="request"``): what one request used, applied when it ends.

vLLM 0.32's scheduler never calls ``touch``. A manager instead records, per
request, the keys it loaded (``prepare_load``) and the keys it offered for
storing that were stored or already ready (``prepare_store``), and applies
them once, in prefix order, when the request finishes. That is cheaper
than a touch per lookup, and it lets a policy tell a request's own stores
(not a second use) from real reuse, which is what ARC's T1 -> T2 promotion
should count.

The record lives on the :class:`~aiokvo.specs.ReqContext` the caller passes
to every call of the request, so it goes away with the context; a record
made by another manager, or before :meth:`reset_cache`, is ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiokvo.keys import OffloadKey, get_offload_group_idx
from aiokvo.specs import ReqContext

__all__ = ["KeyPosition", "RequestAccess", "request_access"]

KeyPosition = Callable[[OffloadKey], "int | None"]
"""Where a key sits in its request (e.g. vLLM's ``ReqContext.get_offload_key_position``:
the token its chunk ends at), or None when unknown."""


class RequestAccess:
    """The keys one request used, by KV-cache group, in the order first seen."""

    __slots__ = ("generation", "groups", "inserted", "owner", "reused", "seen", "store_misses")

    def __init__(self, owner: object, generation: int) -> None:
        self.owner = owner
        self.generation = generation
        self.groups: dict[int, list[OffloadKey]] = {}
        self.seen: set[OffloadKey] = set()
        self.inserted: set[OffloadKey] = set()
        self.reused: set[OffloadKey] = set()
        self.store_misses: set[OffloadKey] = set()

    def record(self, keys: Iterable[OffloadKey], reused: Iterable[OffloadKey] = ()) -> None:
        """Note ``keys`` as used; ``reused`` ones count as reuse unless this request stored them."""
        seen, groups = self.seen, self.groups
        for key in keys:
            if key not in seen:
                seen.add(key)
                group = get_offload_group_idx(key)
                found = groups.get(group)
                if found is None:
                    groups[group] = [key]
                else:
                    found.append(key)
        inserted = self.inserted
        self.reused.update(key for key in reused if key not in inserted)

    def ordered(self, position: KeyPosition | None = None) -> list[OffloadKey]:
        """Every key used, head of the prefix first.

        Groups in index order, each in first-seen order, or sorted by
        ``position`` when it knows every key of the group; then, when
        ``position`` knows every key, all of them sorted by it (stably).
        This is vLLM 0.32's order (``order_request_keys``).
        """
        keys: list[OffloadKey] = []
        known: dict[OffloadKey, int] = {}
        for group in sorted(self.groups):
            members = self.groups[group]
            if position is not None:
                found = _positions(members, position)
                if len(found) == len(members):
                    members = sorted(members, key=found.__getitem__)
                known.update(found)
            keys += members
        if len(self.groups) > 1 and len(known) == len(keys):
            keys.sort(key=known.__getitem__)
        return keys


def _positions(keys: list[OffloadKey], position: KeyPosition) -> dict[OffloadKey, int]:
    found: dict[OffloadKey, int] = {}
    for key in keys:
        where = position(key)
        if where is not None:
            found[key] = where
    return found


def request_access(req_context: ReqContext, owner: object, generation: int) -> RequestAccess:
    """The record ``owner`` keeps on ``req_context``, made fresh when missing or stale."""
    access = req_context._access
    if (
        not isinstance(access, RequestAccess)
        or access.owner is not owner
        or access.generation != generation
    ):
        access = RequestAccess(owner, generation)
        req_context._access = access
    return access


def finish_access(
    req_context: ReqContext, owner: object, generation: int
) -> RequestAccess | None:
    """Take ``owner``'s current record off ``req_context`` (None if there is none)."""
    access = req_context._access
    if (
        not isinstance(access, RequestAccess)
        or access.owner is not owner
        or access.generation != generation
    ):
        return None
    req_context._access = None
    return access
