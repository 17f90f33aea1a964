"""The async runtime: completion sources, the per-loop event poller, and ``run``."""

from aiokvo.runtime.poller import (
    DEFAULT_POLLER_MODE,
    POLLER_MODE_ENV,
    CompletionCallback,
    EventPoller,
    NotifyingSource,
    PollerMode,
    PollerStatistics,
    resolve_poller_mode,
)
from aiokvo.runtime.pump import LoopDriver, LoopDriverMode, LoopThread, PumpedLoop, make_loop_driver
from aiokvo.runtime.run import loop_factory, run
from aiokvo.runtime.sources import AssistableSource, CompletionSource, HostEvent

__all__ = [
    "DEFAULT_POLLER_MODE",
    "AssistableSource",
    "POLLER_MODE_ENV",
    "CompletionCallback",
    "CompletionSource",
    "EventPoller",
    "HostEvent",
    "LoopDriver",
    "LoopDriverMode",
    "LoopThread",
    "NotifyingSource",
    "PollerMode",
    "PollerStatistics",
    "PumpedLoop",
    "loop_factory",
    "make_loop_driver",
    "resolve_poller_mode",
    "run",
]
