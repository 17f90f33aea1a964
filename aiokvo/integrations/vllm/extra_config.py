"""Every ``kv_connector_extra_config`` key, checked at once, in the process that reads it.

vLLM hands the spec its ``kv_connector_extra_config`` as the user wrote it
(JSON on the command line: byte counts as strings, booleans as strings). Read
lazily, a bad value surfaced late and raw: ``store_threshold="two"`` as a
``ValueError`` from ``int()``, a misspelt handler option as a ``TypeError``
only when a worker process built its handlers, ``offload_prompt_only="false"``
silently true (vLLM's ``bool()``), a negative ``store_threshold`` silently 0.
Only spellings vLLM and aiokvo both read as meant are accepted. :func:`check_extra_config`
checks them all up front (the spec calls it before anything else, in the
scheduler process; the metric definitions call it in the front end) and
raises :class:`~aiokvo.errors.ConfigError` naming the key and the value.

Pure: it imports neither vLLM nor torch, so it is tested without vLLM.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, get_args

from aiokvo._util import check_choice, check_int
from aiokvo.config import MAX_COUNT, UnknownConfigKeyWarning, machine_memory
from aiokvo.errors import ConfigError

if TYPE_CHECKING:
    from aiokvo.tiers.registry import TierConfig

__all__ = ["AIOKVO_KEYS", "HANDLER_OPTIONS", "VLLM_KEYS", "check_extra_config", "tier_configs"]

AIOKVO_KEYS = frozenset(
    {
        "aiokvo_loop", "aiokvo_retries", "aiokvo_on_load_failure", "aiokvo_handler_options",
        "aiokvo_retention_fraction", "aiokvo_tiers",
    }
)  # fmt: skip
"""aiokvo's own keys (docs/vllm.md)."""

VLLM_KEYS = frozenset(
    {
        "spec_name", "spec_module_path", "cpu_bytes_to_use", "eviction_policy",
        "store_threshold", "max_tracker_size", "blocks_per_chunk", "block_size",
        "offload_prompt_only", "self_describing_kv_events", "canonical_layout",
        "cache_policy_module_path",
    }
)  # fmt: skip
"""The keys vLLM 0.32's connector, factory and CPU spec read (and aiokvo's spec maps)."""

MAX_RETRIES = 100


def _integer(key: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """An int the way vLLM's ``int(value)`` reads it, minus its surprises: ints, integral
    floats (``8e9``) and numeric strings; never a bool, a fraction or a non-number."""
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        bound = f"{minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(
            f"kv_connector_extra_config[{key!r}] must be an integer {bound}, got {value!r}"
        )
    return number


def _boolean(key: str, value: object) -> bool:
    """A real bool: vLLM reads these with ``bool(value)``, so ``"false"`` would be True."""
    if isinstance(value, bool):
        return value
    raise ConfigError(f"kv_connector_extra_config[{key!r}] must be true or false (a JSON "
                      f"boolean; vLLM reads {value!r} as {bool(value)}), got {value!r}")


def _text(key: str, value: object) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a non-empty string, "
                      f"got {value!r}")


def _policy(key: str, value: object) -> str:
    from aiokvo.manager.policies.registry import resolve_policy

    name = _text(key, value)
    try:
        resolve_policy(name)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
    return name


# -- handler options --------------------------------------------------------------------


def _poller_mode(value: object) -> object:
    from aiokvo.runtime.poller import PollerMode

    if value is None:
        return value
    return check_choice("poller_mode", value, get_args(PollerMode))


def _engine(value: object) -> object:
    return check_choice("engine", value, ("auto", "dma", "kernel"))


def _seconds_or_none(name: str) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0
        ):  # fmt: skip
            raise ConfigError(f"{name} must be None or seconds >= 0, got {value!r}")
        return value

    return check


def _int_option(name: str, minimum: int, *, none: bool = False) -> Callable[[object], object]:
    def check(value: object) -> object:
        if none and value is None:
            return value
        return check_int(name, value, minimum=minimum)

    return check


def _bool_option(name: str) -> Callable[[object], object]:
    def check(value: object) -> object:
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}")
        return value

    return check


def _callable_or_none(name: str, *, int_ok: bool = False) -> Callable[[object], object]:
    def check(value: object) -> object:
        if value is None or callable(value):
            return value
        if int_ok and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        kind = "a function, a stream handle (int >= 0)" if int_ok else "a function"
        raise ConfigError(f"{name} must be {kind} or None, got {value!r}")

    return check


HANDLER_OPTIONS: Mapping[str, Callable[[object], object]] = {
    # both backends
    "poller_mode": _poller_mode,
    "max_buffered": _int_option("max_buffered", 0, none=True),
    # host backend
    "copy_threads": _int_option("copy_threads", 1),
    "copy_fn": _callable_or_none("copy_fn"),
    "inline_after": _seconds_or_none("inline_after"),
    "split_min_bytes": _int_option("split_min_bytes", 0),
    "inline_below_bytes": _int_option("inline_below_bytes", 0),
    # CUDA backend
    "engine": _engine,
    "kernel_below_bytes": _int_option("kernel_below_bytes", 0),
    "timing": _bool_option("timing"),
    "producer_stream": _callable_or_none("producer_stream", int_ok=True),
    "coalesce_copies": _bool_option("coalesce_copies"),
    "max_chunk": _int_option("max_chunk", 1),
}
"""Each option ``aiokvo_handler_options`` may hold, and its check: the keyword arguments of
the host and CUDA handlers (and of the CUDA pair) that the spec does not set itself."""

SPEC_SET_OPTIONS = frozenset(
    {"block_size_factor", "num_cpu_blocks", "region", "row_tail_bytes", "driver",
     "dispatcher", "gpu_to_cpu"}
)  # fmt: skip
"""Handler arguments the spec sets from the config: not options."""


def _handler_options(value: object) -> dict[str, Any]:
    key = "aiokvo_handler_options"
    if not isinstance(value, Mapping):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a mapping of handler "
                          f"options, got {value!r}")
    options = dict(value)
    for name, option in options.items():
        check = HANDLER_OPTIONS.get(name)
        if check is None:
            why = ("set by the spec from the config" if name in SPEC_SET_OPTIONS
                   else f"not a handler option; known: {', '.join(sorted(HANDLER_OPTIONS))}")
            raise ConfigError(
                f"kv_connector_extra_config[{key!r}][{name!r}] = {option!r}: {why}"
            )
        try:
            check(option)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config[{key!r}]: {exc}") from None
    return options


# -- the whole mapping ------------------------------------------------------------------


def check_extra_config(extra: object, *, strict: bool = False) -> dict[str, Any]:
    """Check every key of vLLM's ``kv_connector_extra_config`` for aiokvo's spec.

    Returns the mapping with its values read (``"8589934592"`` as an int).
    Raises :class:`~aiokvo.errors.ConfigError` naming the first bad key and
    its value: a missing or non-positive ``cpu_bytes_to_use`` (or one past
    this machine's memory), an integer that is not one (or out of range), a
    boolean that is not one, an unknown eviction policy, an unknown
    ``aiokvo_*`` key or handler option, ``canonical_layout`` and
    ``cache_policy_module_path`` (vLLM features aiokvo's spec does not take).
    Keys neither vLLM nor aiokvo reads are left alone with an
    :class:`~aiokvo.config.UnknownConfigKeyWarning` (vLLM ignores them); with
    ``strict`` they are errors too.
    """
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, got {extra!r}")
    checked: dict[str, Any] = dict(extra)
    unknown_aiokvo = sorted(k for k in extra if isinstance(k, str) and k.startswith("aiokvo_")
                            and k not in AIOKVO_KEYS)
    if unknown_aiokvo:
        given = ", ".join(f"{k}={extra[k]!r}" for k in unknown_aiokvo)
        raise ConfigError(f"unknown aiokvo keys {unknown_aiokvo} in kv_connector_extra_config "
                          f"({given}); known: {sorted(AIOKVO_KEYS)}")
    unknown = sorted(str(k) for k in extra if k not in AIOKVO_KEYS | VLLM_KEYS)
    if unknown:
        message = (f"kv_connector_extra_config keys {unknown} are read by neither vLLM's "
                   f"offloading connector nor aiokvo (a typo?); known: "
                   f"{', '.join(sorted(AIOKVO_KEYS | VLLM_KEYS))}")
        if strict:
            raise ConfigError(message)
        warnings.warn(message, UnknownConfigKeyWarning, stacklevel=2)
    if extra.get("canonical_layout"):
        raise ConfigError(f"kv_connector_extra_config['canonical_layout'] is not supported by "
                          f"aiokvo's spec; remove it (got {extra['canonical_layout']!r})")
    if extra.get("cache_policy_module_path") is not None:
        raise ConfigError(
            f"kv_connector_extra_config['cache_policy_module_path'] names a vLLM CachePolicy "
            f"({extra['cache_policy_module_path']!r}); with aiokvo give an aiokvo policy as "
            f"eviction_policy='package.module:ClassName'"
        )
    if extra.get("cpu_bytes_to_use") is None:
        raise ConfigError("kv_connector_extra_config['cpu_bytes_to_use'] must be given "
                          "(the CPU pool's size in bytes)")
    memory = machine_memory()
    checked["cpu_bytes_to_use"] = _integer("cpu_bytes_to_use", extra["cpu_bytes_to_use"], 1,
                                           memory)
    for key, minimum, maximum in (
        ("store_threshold", 0, MAX_COUNT), ("max_tracker_size", 1, MAX_COUNT),
        ("blocks_per_chunk", 1, 1 << 20), ("block_size", 1, 1 << 24),
        ("aiokvo_retries", 0, MAX_RETRIES),
    ):
        if extra.get(key) is not None:
            checked[key] = _integer(key, extra[key], minimum, maximum)
    for key in ("offload_prompt_only", "self_describing_kv_events"):
        if extra.get(key) is not None:
            checked[key] = _boolean(key, extra[key])
    for key in ("spec_name", "spec_module_path"):
        if key in extra:
            checked[key] = _text(key, extra[key])
    if extra.get("eviction_policy") is not None:
        checked["eviction_policy"] = _policy("eviction_policy", extra["eviction_policy"])
    for key, choices in (("aiokvo_loop", ("auto", "pump", "thread")),
                         ("aiokvo_on_load_failure", ("report", "raise"))):
        if key in extra:
            try:
                checked[key] = check_choice(key, extra[key], choices)
            except ConfigError as exc:
                raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    if "aiokvo_handler_options" in extra:
        checked["aiokvo_handler_options"] = _handler_options(extra["aiokvo_handler_options"])
    if extra.get("aiokvo_retention_fraction") is not None:
        checked["aiokvo_retention_fraction"] = _fraction(
            "aiokvo_retention_fraction", extra["aiokvo_retention_fraction"]
        )
    if extra.get("aiokvo_tiers") is not None:
        tier_configs(extra["aiokvo_tiers"], model_id="(the served model)")
    return checked


def tier_configs(value: object, *, model_id: str) -> tuple[TierConfig, ...]:
    """``aiokvo_tiers`` read as ``OffloadConfig.from_dict`` reads ``"tiers"``: a list
    of mappings, each with a ``"kind"`` (``"disk"``, ``"mooncake"``) and that tier's
    keywords. A tier without ``model_id`` takes ``model_id`` (the spec passes the
    served model's name). Each kind at most once (a tier per medium)."""
    key = "kv_connector_extra_config['aiokvo_tiers']"
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise ConfigError(f"{key} must be a list of tier settings (each a mapping with a "
                          f"'kind'), got {value!r}")
    from aiokvo.tiers.registry import tier_config_from_dict  # only when tiers are asked for

    configs: list[TierConfig] = []
    for i, settings in enumerate(value):
        if isinstance(settings, Mapping) and "model_id" not in settings:
            settings = {**settings, "model_id": model_id}
        try:
            configs.append(tier_config_from_dict(settings))
        except ConfigError as exc:
            raise ConfigError(f"{key}[{i}]: {exc}") from None
    kinds = [c.kind for c in configs]
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"{key} names a tier kind twice ({kinds}); each medium once")
    return tuple(configs)


def _fraction(key: str, value: object) -> float:
    """A share in [0, 1], also as a numeric string (JSON configs)."""
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not 0.0 <= number <= 1.0:
        raise ConfigError(
            f"kv_connector_extra_config['{key}'] must be a number in [0, 1], got {value!r}"
        )
    return number
