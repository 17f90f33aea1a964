"""Every field of the statistics and config records is documented where it is declared.

The exporter takes a field's help text from :func:`aiokvo._util.field_docs`
(the string literal right under the annotation), so a field without one
would be exported with its bare name as help.
"""

from __future__ import annotations

import dataclasses

import pytest

from aiokvo._util import field_docs
from aiokvo.config import OffloadConfig
from aiokvo.events import SubscriptionStatistics
from aiokvo.handlers.stats import HandlerStatistics, WorkerStatistics
from aiokvo.handlers.sync import SyncWorkerStatistics
from aiokvo.manager.stats import ManagerStatistics
from aiokvo.offloader.results import OffloaderStatistics
from aiokvo.runtime.poller import PollerStatistics
from aiokvo.telemetry.prometheus import OffloadMetricsStatistics
from aiokvo.tiers.base import TierStatistics
from aiokvo.tiers.breaker import BreakerStatistics
from aiokvo.tiers.disk.config import DiskTierConfig
from aiokvo.tiers.disk.store import DiskTierStatistics
from aiokvo.tiers.mooncake.config import MooncakeTierConfig
from aiokvo.tiers.mooncake.store import MooncakeTierStatistics
from aiokvo.tiers.settings import TierSettings

RECORDS = (
    PollerStatistics,
    HandlerStatistics,
    WorkerStatistics,
    SyncWorkerStatistics,
    ManagerStatistics,
    BreakerStatistics,
    SubscriptionStatistics,
    OffloadMetricsStatistics,
    OffloadConfig,
    TierStatistics,
    DiskTierStatistics,
    MooncakeTierStatistics,
    OffloaderStatistics,
    TierSettings,
    DiskTierConfig,
    MooncakeTierConfig,
)


@pytest.mark.parametrize("record", RECORDS, ids=lambda cls: cls.__name__)
def test_every_field_has_a_doc_under_it(record: type) -> None:
    docs = field_docs(record)  # a base class's fields are documented in the base
    undocumented = [f.name for f in dataclasses.fields(record) if not docs.get(f.name)]
    assert undocumented == [], f"{record.__name__} fields without a doc line: {undocumented}"
