"""vLLM 0.33's orchestrator hints (``ReqContext.kv_hints``), read into aiokvo's calls.

vLLM carries a ``KvHintsEnvelope`` of versioned actions on each request and
leaves each action's schema to whoever executes it. This module is that
schema for aiokvo: which ``action_type`` / ``action_version`` pairs it
accepts, what their ``payload`` must hold, and the cache-control call each
becomes (docs/vllm.md "Orchestrator hints"). It imports no vLLM and never
raises on a hint: a hint is advice, so a bad one is counted and reported,
never an exception in the engine.

================  =========================================  ======================
``action_type``   ``payload`` (version ``"1"`` or ``"1.0"``)  aiokvo call
================  =========================================  ======================
``kv.retain``     ``priority`` (int, default 0),              ``retain`` of the
                  ``ttl_s`` (number > 0, at most a day)       request's blocks when
                                                              it finishes
``kv.prefetch``   ``deadline_ms`` (number >= 0, optional)     ``prefetch``
``kv.fetch``      Dynamo's ``kv.fetch@1.0``: as kv.prefetch   ``prefetch``
``kv.demote``     (nothing)                                   ``demote``
``kv.durable``    ``tier`` (medium, optional),                ``durable``
                  ``timeout_ms`` (number >= 0, optional)
================  =========================================  ======================

Unknown payload fields are refused (a typo must not pass silently).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ACTIONS",
    "Demote",
    "Durable",
    "Hint",
    "Prefetch",
    "Refused",
    "Retain",
    "read_action",
]

MAX_TTL_S = 86_400.0
"""The longest retention a hint may ask for: a day (a soft hint, not storage)."""

VERSIONS = frozenset({"1", "1.0"})


@dataclass(frozen=True, slots=True)
class Retain:
    """Retain the request's blocks softly when it finishes (a pause for a tool call)."""

    priority: int = 0
    ttl: float = 60.0


@dataclass(frozen=True, slots=True)
class Prefetch:
    """Promote the request's prefix from below the CPU pool before it is scheduled."""

    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Demote:
    """Commit the request's blocks below the CPU pool and free them there."""


@dataclass(frozen=True, slots=True)
class Durable:
    """Commit the request's blocks in a tier (default the lowest)."""

    tier: str | None = None
    timeout: float | None = None


Hint = Retain | Prefetch | Demote | Durable


@dataclass(frozen=True, slots=True)
class Refused:
    """An action not taken: ``reason`` is ``"unknown_type"``, ``"unknown_version"`` or
    ``"bad_payload"``; ``detail`` says what was wrong (for the one log line)."""

    action_type: str
    reason: str
    detail: str


def _number(payload: Mapping[str, Any], name: str, *, low: float, high: float) -> float | None:
    value = payload.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _retain(payload: Mapping[str, Any]) -> Retain:
    priority = payload.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int, got {priority!r}")
    if not -(1 << 31) <= priority < (1 << 31):
        raise ValueError(f"priority must fit in 32 bits, got {priority!r}")
    ttl = _number(payload, "ttl_s", low=0.0, high=MAX_TTL_S)
    if ttl is None or ttl <= 0:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_TTL_S:g}], got "
                         f"{payload.get('ttl_s')!r}")  # fmt: skip
    return Retain(priority, ttl)


def _prefetch(payload: Mapping[str, Any]) -> Prefetch:
    ms = _number(payload, "deadline_ms", low=0.0, high=MAX_TTL_S * 1000)
    return Prefetch(None if ms is None else ms / 1000)


def _demote(payload: Mapping[str, Any]) -> Demote:
    return Demote()


def _durable(payload: Mapping[str, Any]) -> Durable:
    tier = payload.get("tier")
    if tier is not None and (not isinstance(tier, str) or not tier):
        raise ValueError(f"tier must be a tier's medium (a name), got {tier!r}")
    ms = _number(payload, "timeout_ms", low=0.0, high=MAX_TTL_S * 1000)
    return Durable(tier, None if ms is None else ms / 1000)


ACTIONS: Mapping[str, tuple[frozenset[str], Any]] = {
    "kv.retain": (frozenset({"priority", "ttl_s"}), _retain),
    "kv.prefetch": (frozenset({"deadline_ms"}), _prefetch),
    "kv.fetch": (frozenset({"deadline_ms"}), _prefetch),
    "kv.demote": (frozenset(), _demote),
    "kv.durable": (frozenset({"tier", "timeout_ms"}), _durable),
}
"""Each accepted ``action_type``: its payload's fields and its reader."""


def read_action(action: object) -> Hint | Refused:
    """One ``KvHintAction`` (any object with ``action_type``, ``action_version`` and
    ``payload``) as a :data:`Hint`, or why it is not one. Never raises."""
    kind = getattr(action, "action_type", None)
    name = kind if isinstance(kind, str) else repr(kind)
    entry = ACTIONS.get(name)
    if entry is None:
        return Refused(name, "unknown_type", f"aiokvo acts on {sorted(ACTIONS)}")
    version = getattr(action, "action_version", None)
    if version not in VERSIONS:
        return Refused(name, "unknown_version", f"version {version!r}, not one of "
                       f"{sorted(VERSIONS)}")  # fmt: skip
    payload = getattr(action, "payload", None)
    if not isinstance(payload, Mapping):
        return Refused(name, "bad_payload", f"payload must be a mapping, got {payload!r}")
    fields, reader = entry
    extra = sorted(str(k) for k in payload if k not in fields)
    if extra:
        return Refused(name, "bad_payload", f"unknown payload fields {extra}; "
                       f"known: {sorted(fields)}")  # fmt: skip
    try:
        hint: Hint = reader(payload)
    except ValueError as exc:
        return Refused(name, "bad_payload", str(exc))
    return hint
