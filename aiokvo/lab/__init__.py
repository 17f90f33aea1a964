"""The policy lab: replay request traces through the real manager (``aiokvo replay``).

* :mod:`aiokvo.lab.trace` reads traces (Mooncake FAST'25 JSONL);
* :mod:`aiokvo.lab.replay` drives a :class:`~aiokvo.manager.CPUOffloadingManager`
  (and tier indexes below it) with them, one policy and pool size at a time;
* :mod:`aiokvo.lab.belady` computes Belady's offline optimum for the same pool;
* :mod:`aiokvo.lab.record` records a running Offloader's requests as a trace;
* :mod:`aiokvo.lab.plot` draws hit rate against pool size (``aiokvo[lab]``).

Everything but the recorder and the plot is pure and synchronous, and imports
only the manager and the keys. See docs/policies.md.
"""

from aiokvo.lab.belady import BeladyResult, belady_hits
from aiokvo.lab.record import RecorderStatistics, TraceRecorder
from aiokvo.lab.replay import ReplayResult, TierModel, TierResult, capacity_blocks, replay
from aiokvo.lab.trace import Trace, parse_trace, read_trace

__all__ = [
    "BeladyResult",
    "RecorderStatistics",
    "ReplayResult",
    "TierModel",
    "TierResult",
    "Trace",
    "TraceRecorder",
    "belady_hits",
    "capacity_blocks",
    "parse_trace",
    "read_trace",
    "replay",
]
