"""The vLLM versions this integration is tested against, checked at import.

vLLM's offloading interfaces changed shape between releases (0.32 merged
``abstract.py``, ``mediums.py`` and ``spec.py`` into ``kv_offload/base.py``
and replaced ``get_handlers`` by ``get_worker``), so an untested vLLM is
refused with a message rather than failing somewhere inside a step.
"""

from __future__ import annotations

import re

from aiokvo.errors import ConfigError

__all__ = ["SUPPORTED_VLLM", "check_vllm_version"]

SUPPORTED_VLLM = (">=0.32.0", "<0.33")
"""The range ``aiokvo[vllm]`` pins (pyproject.toml) and the tests run against."""

_LOWEST = (0, 32, 0)
_BELOW = (0, 33, 0)


def _release(version: str) -> tuple[int, int, int] | None:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    major, minor, micro = found.groups()
    return int(major), int(minor), int(micro or 0)


def check_vllm_version(version: str) -> None:
    """Raise :class:`~aiokvo.errors.ConfigError` unless ``version`` is supported."""
    release = _release(version)
    if release is None or not _LOWEST <= release < _BELOW:
        raise ConfigError(
            f"aiokvo.integrations.vllm supports vLLM {','.join(SUPPORTED_VLLM)}; "
            f"vLLM {version} is installed (pip install 'aiokvo[vllm]' installs a tested one)"
        )
