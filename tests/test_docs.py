"""The docs' claims about behaviour that tests can check: each claim next to the code."""

from __future__ import annotations

import re
from pathlib import Path

from aiokvo.keys import make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.runtime.poller import NotifyingSource
from aiokvo.runtime.sources import HostEvent
from aiokvo.specs import ReqContext

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _text(page: str) -> str:
    return re.sub(r"\s+", " ", (DOCS / page).read_text())


def test_async_md_says_what_host_event_does() -> None:
    assert isinstance(HostEvent(), NotifyingSource)
    text = _text("async.md")
    assert "`HostEvent` does not implement it" not in text
    assert "`HostEvent` implements it" in text


def test_events_md_says_the_take_events_record_is_unbounded() -> None:
    text = _text("events.md")
    assert "The record is not bounded" in text
    manager = CPUOffloadingManager(8, enable_events=True)
    for i in range(2000):  # stores and evictions, nobody taking events
        out = manager.prepare_store([make_offload_key(b"k%d" % i, 0)], ReqContext())
        assert out is not None
        manager.complete_store(out.reservation)
    events = list(manager.take_events())
    assert len(events) == 2000 + 1992  # every store and every eviction was kept


def _tier_keys_table(kind: str) -> dict[str, str]:
    """``key -> default`` from the table under config.md's ``#### `"<kind>"` `` heading."""
    page = (DOCS / "config.md").read_text()
    section = page.split(f'#### `"{kind}"`', 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, flags=re.M)
    return {key: default.strip() for key, default in rows}


def test_config_md_lists_every_tier_setting_with_its_default() -> None:
    import dataclasses

    from aiokvo.tiers import DiskTierConfig, MooncakeTierConfig

    for kind, cls in (("disk", DiskTierConfig), ("mooncake", MooncakeTierConfig)):
        documented = _tier_keys_table(kind)
        expected = {
            f.name: "(required)" if f.default is dataclasses.MISSING else f"`{f.default!r}`"
            for f in dataclasses.fields(cls)
        }
        assert documented == expected, kind


def test_config_md_tiers_example_builds_both_tiers() -> None:
    from aiokvo.config import OffloadConfig
    from aiokvo.tiers import DiskTierConfig, MooncakeTierConfig

    page = (DOCS / "config.md").read_text()
    code = page.split("### Tiers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(code, scope)  # the example is data only
    config = OffloadConfig.from_dict(
        scope["extra"], gpu_block_sizes=(16,), hash_block_size=16,  # type: ignore[arg-type]
        kv_bytes_per_block=4096,
    )  # fmt: skip
    disk, moon = config.tiers
    assert isinstance(disk, DiskTierConfig) and disk.capacity_bytes == 64 << 30
    assert isinstance(moon, MooncakeTierConfig) and moon.replica_num == 2
