"""Which vLLM is installed, and what of its offloading interface it has.

vLLM changes its offloading plugin interface almost every release, so the
adapter asks for *features*, not version numbers, wherever it can: a
feature present in the installed vLLM is used, one absent is left out.
Versions are checked only at the edges: below 0.32 the interface has a
different shape (``kv_offload/base.py``, ``get_worker`` and ``LookupResult``
arrived in 0.32) and import is refused; 0.32 and 0.33 are tested (``make
test-vllm`` runs the suite against both); a later release is used with a
warning, since its interface has not been checked.

What 0.33 added, and how the adapter meets it (docs/vllm.md):

* ``OffloadingManager.lock``: vLLM's default (no lock) is inherited; the
  manager is only entered from the scheduler's thread.
* ``config_info()`` / ``config_info_keys()`` (``vllm:kv_offload_config_info``):
  filled with the same labels as vLLM's CPU spec.
* ``OffloadingEvent.metadata_only``: a store that failed releases its keys
  with a ``metadata_only`` removal, as vLLM 0.33's CPU manager does.
* ``ReqContext.kv_hints``: counted as ignored (the CPU pool acts on none yet).
* ``ReqContext.load_tier_filter``: filters secondary tiers; the CPU pool is
  the primary tier, which vLLM never filters.
* ``submit_load(..., expedited=...)``: accepted (every aiokvo load is
  submitted at once; an expedited one is then waited for by vLLM).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from aiokvo.errors import ConfigError

__all__ = [
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "check_vllm_version",
    "has_metadata_only_events",
]

logger = logging.getLogger(__name__)

SUPPORTED_VLLM = (">=0.32.0", "<0.34")
"""The range ``aiokvo[vllm]`` pins (pyproject.toml) and the tests run against."""

TESTED_VLLM = ("0.32", "0.33")
"""The releases ``make test-vllm`` runs the integration tests against."""

_LOWEST = (0, 32, 0)
_BELOW = (0, 34, 0)


def _release(version: str) -> tuple[int, int, int] | None:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    major, minor, micro = found.groups()
    return int(major), int(minor), int(micro or 0)


def check_vllm_version(version: str) -> None:
    """Raise :class:`~aiokvo.errors.ConfigError` for a vLLM older than 0.32 (or an
    unreadable version); log a warning for one newer than the tested releases."""
    release = _release(version)
    if release is None or release < _LOWEST:
        raise ConfigError(
            f"aiokvo.integrations.vllm needs vLLM >= 0.32 (its offloading interface); "
            f"vLLM {version} is installed (pip install 'aiokvo[vllm]' installs a tested one)"
        )
    if release >= _BELOW:
        logger.warning(
            "aiokvo.integrations.vllm is tested against vLLM %s; vLLM %s is installed, "
            "whose offloading interface has not been checked",
            " and ".join(TESTED_VLLM), version,
        )


def has_metadata_only_events(event_cls: Any) -> bool:
    """True when vLLM's ``OffloadingEvent`` has the ``metadata_only`` field (0.33+)."""
    return any(f.name == "metadata_only" for f in dataclasses.fields(event_cls))
