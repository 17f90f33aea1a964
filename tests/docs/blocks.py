"""Every fenced ``python`` block of README.md and docs/*.md, and the glue that runs it.

A block is found by its page and first line (:func:`blocks`). Its :class:`Glue`,
written below next to the others, says how it runs: a whole program as written
(``script``), a fragment placed into a program at ``{block}`` (``script``
with a template), a pytest module or conftest run in a fresh temporary
project (``pytest``), or a program that needs vLLM (``vllm``, run by the vLLM
venv's tests). Every block has glue and every glue has a block, so a new
block cannot go untested and a removed one leaves no dead glue.

Templates and replacements may use run-time tokens: ``{tmp}`` (a fresh
owner-only directory), ``{port0}``/``{port1}`` (free loopback ports) and
``{mooncake_master}`` (a throwaway loopback Mooncake cluster's master). A
block that names a remote address (the docs' ``10.0.0.5:50051`` master) or a
wildcard bind (``tcp://*:5557``) gets a loopback one: tests never send
traffic beyond loopback (:func:`foreign_addresses` checks every program).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

Kind = Literal["script", "pytest", "vllm"]


@dataclass(frozen=True)
class Block:
    page: str  # "README.md", "docs/tiers.md"
    line: int  # where its fence opens
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0]

    @property
    def name(self) -> str:
        stem = self.page.replace("/", "_").replace(".md", "")
        return f"{stem}_{self.line}"


@dataclass(frozen=True)
class Glue:
    kind: Kind = "script"
    template: str = "{block}"
    """The program (or test module) with ``{block}`` where the block goes (indented as
    that line is)."""
    replace: dict[str, str] = field(default_factory=dict)
    """Substitutions in the block (remote addresses, paths outside the test)."""
    files: dict[str, str] = field(default_factory=dict)
    """``pytest``: other files of the temporary project (``conftest.py``, ``pytest.ini``,
    a module the block imports); ``{block}`` may appear in them instead."""
    as_file: str = "test_doc.py"
    """``pytest``: the name the composed template is written under."""
    expect: dict[str, int] | None = None
    """``pytest``: the outcomes; None means "every test passed or was skipped"."""
    stdout: str = ""
    """``script``: a line the program must print."""
    needs: tuple[str, ...] = ()
    """``"mooncake"``: a loopback cluster (``{mooncake_master}``)."""


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            line = text[: match.start()].count("\n") + 1
            found.append(Block(str(page.relative_to(ROOT)), line, match.group(1)))
    return found


def compose(template: str, block: str) -> str:
    """``template`` with ``block`` at its ``{block}`` line, indented as that line."""
    out = []
    for line in textwrap.dedent(template).strip("\n").splitlines():
        if line.strip() == "{block}":
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + b if b.strip() else "" for b in block.rstrip("\n").splitlines())
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def program(block: Block, glue: Glue, tokens: dict[str, str]) -> str:
    code = block.code
    for old, new in glue.replace.items():
        assert old in code, f"{block.page}:{block.line}: {old!r} is not in the block"
        code = code.replace(old, new)
    return fill(compose(glue.template, code), tokens)


def fill(text: str, tokens: dict[str, str]) -> str:
    for name, value in tokens.items():
        text = text.replace("{" + name + "}", value)
    return text


_IPV4 = re.compile(r"(?<![\d.])(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?![\d.])")


def foreign_addresses(code: str) -> list[str]:
    """Addresses in ``code`` other than loopback: IPv4s, wildcard binds, named hosts in URLs."""
    found = [m.group(0) for m in _IPV4.finditer(code) if m.group(1) != "127"]
    found += re.findall(r"tcp://\*[^\"' ]*", code)
    found += [h for h in re.findall(r"(?:https?|tcp)://([A-Za-z][\w.-]*)", code)
              if h != "localhost"]
    return found


def glue_of(block: Block) -> list[tuple[str, str]]:
    """The glue keys (page, marker) whose marker is in ``block``."""
    return [k for k in GLUE if k[0] == block.page and k[1] in block.code]


# -- the glue, one entry per block -----------------------------------------------------
#
# Programs are checked with mypy --strict as they are run, glue included.

KV = """
    layers = [torch.randn(64, 16, 256).to(torch.bfloat16) for _ in range(2)]
    kv = CanonicalKVCaches.from_engine(layers)
    config = OffloadConfig(
        gpu_block_sizes=(16,), hash_block_size=16,
        kv_bytes_per_block=kv.page_bytes_per_block,
        cpu_bytes_to_use=256 * kv.page_bytes_per_block,
    )
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
"""

KV_IMPORTS = """
import asyncio
import os

import torch

import aiokvo
from aiokvo import CanonicalKVCaches, OffloadConfig, Offloader, make_offload_key
"""


def d(*parts: str) -> str:
    """Parts of a body, each dedented on its own, one after the other."""
    return "\n".join(textwrap.dedent(part).strip("\n") for part in parts)


def _async(body_before: str, body_after: str = "", imports: str = "") -> str:
    """A program running ``async def main()``: ``body_before``, the block (or the block
    where ``body_before`` has its ``{block}`` line), then ``body_after``."""
    before = textwrap.dedent(body_before).strip("\n")
    if "{block}" not in before:
        before += "\n{block}"
    body = before + "\n" + textwrap.dedent(body_after).strip("\n")
    return "\n".join([
        textwrap.dedent(KV_IMPORTS).strip("\n"),
        textwrap.dedent(imports).strip("\n"),
        "",
        "",
        "async def main() -> None:",
        textwrap.indent(body, "    "),
        "",
        "",
        "aiokvo.run(main())",
        "",
    ])


FAKE_DRIVER = """
from aiokvo.device import driver as _driver
from aiokvo.device.fake import FakeDriver

# No GPU in the test: the fake driver stands in for the real one (docs/testing.md).
fake_driver = FakeDriver()
_driver._drivers[0] = fake_driver  # type: ignore[assignment]
"""

MY_PROJECT = '''
"""The user's code under test, in the docs' pytest examples."""

from aiokvo import Offloader, OffloadKey, make_offload_key


async def my_scheduler_step(off: Offloader, keys: list[OffloadKey] | None = None) -> None:
    """Offload GPU blocks 0..3 under ``keys`` (default: four keys of its own)."""
    if keys is None:
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
    result = await off.store(keys, [0, 1, 2, 3])
    assert result.ok, result
'''

LOOP_REPORT = """
import asyncio

async def test_loop() -> None:
    print("LOOP", type(asyncio.get_running_loop()).__module__)
"""

GLUE: dict[tuple[str, str], Glue] = {
    # -- README.md ---------------------------------------------------------------------
    ("README.md", "aiokvo.run(main())  # uvloop where installed"): Glue(
        stdout="stored 4, reloaded 4 blocks",
    ),
    ("README.md", "async with Offloader(config, kv, tiers=tiers) as off:"): Glue(
        template=_async(KV, """
            assert any(os.scandir("{tmp}/aiokvo"))  # the tier made its layout directory
        """),
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo"},
    ),
    ("README.md", "MooncakeTier(\"10.0.0.5:50051\""): Glue(
        template=_async(KV, """
            async with Offloader(config, kv, tiers=tiers) as off:
                assert (await off.store(keys, [0, 1, 2, 3])).ok
            written = sum(t.blocks_written for t in off.statistics().tiers)
            assert written == 8  # 4 blocks, to each tier
        """),
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo", "10.0.0.5:50051": "{mooncake_master}"},
        needs=("mooncake",),
    ),
    ("README.md", "start_metrics_server(off, 9400)"): Glue(
        template=_async(KV),
        replace={"9400": "{port0}"},
    ),
    ("README.md", "KVEventPublisher(manager, \"tcp://*:5557\""): Glue(
        template=_async("manager = CPUOffloadingManager(16)",
                        imports="from aiokvo.manager.cpu import CPUOffloadingManager"),
        replace={"tcp://*:5557": "tcp://127.0.0.1:0", "tcp://*:5558": "tcp://127.0.0.1:0"},
    ),
    ("README.md", "async def test_my_scheduler("): Glue(
        kind="pytest", files={"my_project.py": MY_PROJECT},
    ),
    # -- docs/async.md -------------------------------------------------------------------
    ("docs/async.md", "def _submit("):
    Glue(template='''
        """A backend implements these two: the same signatures as the base class's."""
        import inspect
        from typing import Protocol

        from aiokvo.handlers.base import SingleDirectionHandler, Submission
        from aiokvo.specs import TransferSpec


        class MyBackend(Protocol):
            {block}


        for name in ("_submit", "_close_backend"):
            mine, base = getattr(MyBackend, name), getattr(SingleDirectionHandler, name)
            assert inspect.signature(mine, eval_str=True) == inspect.signature(
                base, eval_str=True
            ), name
            assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(base), name
        assert "_submit" in SingleDirectionHandler.__abstractmethods__
        assert not inspect.signature(MyBackend._close_backend).parameters.keys() - {"self"}
        _ = TransferSpec, Submission
    '''),
    # -- docs/config.md ------------------------------------------------------------------
    ("docs/config.md", "config = OffloadConfig.from_dict("): Glue(template='''
        from types import SimpleNamespace

        from aiokvo import OffloadConfig

        kv_transfer_config = SimpleNamespace(
            kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30, "eviction_policy": "arc"}
        )
        per_rank_bytes, tp_size, kv_events_enabled = 1 << 20, 2, True
        {block}
        assert (config.num_cpu_blocks, config.eviction_policy) == (512, "arc")
        assert config.enable_events and config.world_size == 2
    '''),
    ("docs/config.md", "extra = {"): Glue(
        template='''
            from aiokvo import OffloadConfig
            from aiokvo.tiers import DiskTierConfig, MooncakeTierConfig

            {block}
            config = OffloadConfig.from_dict(
                extra, gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=4096
            )
            disk, moon = config.tiers
            assert isinstance(disk, DiskTierConfig) and disk.capacity_bytes == 64 << 30
            assert isinstance(moon, MooncakeTierConfig) and moon.replica_num == 2
        ''',
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo", "10.0.0.5:50051": "127.0.0.1:{port0}"},
    ),
    # -- docs/cuda.md --------------------------------------------------------------------
    ("docs/cuda.md", "make_cuda_handlers(caches"): Glue(
        template=_async("""
            layers8 = [torch.randn(8, 16, 64) for _ in range(2)]
            caches = CanonicalKVCaches.from_engine(layers8)
            job_id = 1
            gpu_spec = GPULoadStoreSpec([0, 1], [2], [0])
            cpu_spec = CPULoadStoreSpec([5, 6])
        """, """
            assert result.success, result
            fake_driver.close()
        """, imports="from aiokvo import CPULoadStoreSpec, GPULoadStoreSpec\n" + FAKE_DRIVER),
    ),
    # -- docs/events.md ------------------------------------------------------------------
    ("docs/events.md", "manager.subscribe(maxsize=256)"): Glue(
        template=_async("""
            manager = CPUOffloadingManager(4)
            seen: list[OffloadingEvent] = []

            def resync() -> None:
                seen.clear()

            def apply(item: OffloadingEvent) -> None:
                seen.append(item)

            async def produce() -> None:
                await asyncio.sleep(0)  # the subscriber is iterating now
                for i in range(6):
                    out = manager.prepare_store([make_offload_key(bytes([i]) * 8, 0)], ReqContext())
                    assert out is not None
                    manager.complete_store(out.reservation)
                manager.shutdown()  # closes every subscription: the loop below ends

            producer = asyncio.ensure_future(produce())
        """, """
            await producer
            assert [e.removed for e in seen] == [False] * 4 + [True, False, True, False]
        """, imports="""
            from aiokvo import ReqContext
            from aiokvo.events import Lagged
            from aiokvo.manager.cpu import CPUOffloadingManager
            from aiokvo.specs import OffloadingEvent
        """),
    ),
    # -- docs/layout-and-plans.md --------------------------------------------------------
    ("docs/layout-and-plans.md", "as_block_rows(tensor)"): Glue(template='''
        import torch

        from aiokvo.layout import CanonicalKVCaches, as_block_rows

        layers = [torch.zeros(2, 8, 16, 64) for _ in range(2)]  # either layout reads these
        group0_layers, group1_layers = layers, [torch.zeros(8, 4, 64)]
        t0, t1, t2 = (torch.zeros(8, 256) for _ in range(3))
        tensor = torch.zeros(8, 2, 16, 64)
        {block}
        assert CanonicalKVCaches.from_engine([group0_layers, group1_layers]).num_groups == 2
    '''),
    # -- docs/manager.md -----------------------------------------------------------------
    ("docs/manager.md", "FilterReusedOffloadingManager(manager, store_threshold=2)"): Glue(
        template='''
            {block}
            assert isinstance(manager, FilterReusedOffloadingManager)
            assert manager.statistics().num_blocks == 10_000
        ''',
    ),
    ("docs/manager.md", "manager.complete_store(out.reservation, success=result.success)"): Glue(
        template=_async(d(KV, """
            ctx = ReqContext()
            job_id = 1
            gpu_spec = GPULoadStoreSpec([0, 1, 2, 3], [4], [0])
            spec = CPUOffloadingSpec(config)
            manager = spec.get_manager()
            worker = OffloadingWorker(max_buffered=0)
            for route in spec.get_handlers(kv):
                worker.register_handler(*route)
        """), """
            assert result.success and manager.lookup_prefix(keys, ctx) == 4
            await worker.aclose()
            await spec.aclose()
        """, imports="""
            from aiokvo import CPUOffloadingSpec, GPULoadStoreSpec, OffloadingWorker, ReqContext
        """),
    ),
    # -- docs/memory.md ------------------------------------------------------------------
    ("docs/memory.md", "SharedOffloadRegion("): Glue(
        template=d(FAKE_DRIVER, '''
            import os

            engine_id = f"aiokvo-doc-{os.getpid()}"
            num_cpu_blocks, world_size, rank = 16, 1, 0
            layer_page_bytes = [4096, 4096]
            {block}
            assert len(views) == 2 and views[0].shape == (16, 4096)
            fake_driver.close()
        '''),
    ),
    # -- docs/offloader.md ---------------------------------------------------------------
    ("docs/offloader.md", "lease = off.pin_prefix(keys)"): Glue(
        template=_async(d(KV, """
            kv_caches, gpu_block_ids = kv, [0, 1, 2, 3]
        """), """
            assert n == 0 and result.stored == tuple(keys)  # nothing to load before the store
            assert lease is not None and lease.count == 4 and lease.released  # closed: released
        """),
    ),
    ("docs/offloader.md", "class ByHand:"): Glue(stdout="by hand: stored and reloaded 3 blocks"),
    # -- docs/telemetry.md ---------------------------------------------------------------
    ("docs/telemetry.md", "topic=\"kv@pod-a@llama\""): Glue(
        template=_async("manager = CPUOffloadingManager(16)", """
            assert publisher.statistics().pub_mode == "bind"
        """, imports="from aiokvo.manager.cpu import CPUOffloadingManager"),
        replace={"tcp://*:5557": "tcp://127.0.0.1:0", "tcp://*:5558": "tcp://127.0.0.1:0"},
    ),
    ("docs/telemetry.md", "publisher.describe(keys, ctx, only=out.keys_to_store)"): Glue(
        template=_async("""
            manager = CPUOffloadingManager(16)
            keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
            hits = manager.lookup_prefix(keys, ReqContext()) or 0
            request = SimpleNamespace(all_token_ids=list(range(64)), lora_name=None)
            async with KVEventPublisher(manager, "tcp://127.0.0.1:0") as publisher:
                {block}
                assert publisher.statistics().described_keys == 4
        """, imports="""
            from types import SimpleNamespace

            from aiokvo import ReqContext
            from aiokvo.manager.cpu import CPUOffloadingManager
            from aiokvo.specs import BlockMetadata
            from aiokvo.telemetry.kv_events import KVEventPublisher
        """),
    ),
    ("docs/telemetry.md", "OffloadMetrics(off, registry)"): Glue(
        template=_async(d(KV, """
            registry = CollectorRegistry()
        """), """
            assert "aiokvo_pool_capacity_blocks" in {m.name for m in registry.collect()}
            await metrics.aclose()
        """, imports="from prometheus_client import CollectorRegistry"),
        replace={"9400": "{port0}"},
    ),
    # -- docs/testing.md -----------------------------------------------------------------
    ("docs/testing.md", "test_my_scheduler_reuses_a_prefix"): Glue(
        kind="pytest", files={"my_project.py": MY_PROJECT}, expect={"passed": 1},
    ),
    ("docs/testing.md", "test_my_scheduler_reloads_a_shared_prefix"): Glue(
        kind="pytest", expect={"passed": 1},
    ),
    ("docs/testing.md", "def test_store_on_the_gpu("): Glue(kind="pytest"),
    ("docs/testing.md", "def pytest_aiokvo_gpus("): Glue(
        kind="pytest",
        template='''
            import pytest


            @pytest.mark.aiokvo_gpu
            @pytest.mark.aiokvo_min_gpu_memory(100)
            def test_on_the_h200() -> None:
                pass  # runs: the conftest says there is a 141 GiB device
        ''',
        files={"conftest.py": "{block}"},
        expect={"passed": 1},
    ),
    ("docs/testing.md", "def test_two_replicas_share_blocks("): Glue(
        kind="pytest", expect={"passed": 1}, needs=("mooncake",),
    ),
    ("docs/offloader.md", "n = await off.prefetch(keys, deadline=0.5)"): Glue(
        template=_async(d(KV, """
            async with Offloader(config, kv, tiers=[FaultyTier(capacity_blocks=64)]) as off:
                assert (await off.store(keys, [0, 1, 2, 3])).ok
                await off.drain()
                {block}
                assert n == 4 and off.statistics().control.demoted_blocks == 4
        """), imports="from aiokvo.testing import FaultyTier"),
    ),
    # -- docs/policies.md ----------------------------------------------------------------
    ("docs/policies.md", "async with TraceRecorder(\"traffic.jsonl\""): Glue(
        template=_async(d(KV, """
            os.chdir("{tmp}")
            async with Offloader(config, kv) as offloader:
                {block}
        """), """
            lines = open("{tmp}/traffic.jsonl").read().splitlines()
            assert len(lines) == 1, lines  # the one request served in the block
        """),
        replace={"    ...                                 # serve traffic":
                 "    await offloader.load_prefix(keys, [0, 1, 2, 3])  # serve traffic"},
    ),
    # -- docs/tiers.md -------------------------------------------------------------------
    ("docs/tiers.md", "tiers=[tier]) as off:"): Glue(
        template=_async(d(KV, """
            kv_caches, gpu_blocks = kv, [0, 1, 2, 3]
        """), """
            assert n == 0 and off.statistics().tiers[0].blocks_written == 4
        """),
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo"},
    ),
    ("docs/tiers.md", "MooncakeTier(\"10.0.0.5:50051\""): Glue(
        template=_async(d(KV, """
            kv_caches = kv
        """), """
            assert not off.statistics().tiers[0].blocks_written  # the block stored nothing
        """),
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo", "10.0.0.5:50051": "{mooncake_master}"},
        needs=("mooncake",),
    ),
    ("docs/vllm.md", "KVTransferConfig("): Glue(
        kind="vllm",
        template='''
            from aiokvo.integrations.vllm.extra_config import check_extra_config

            {block}
            check_extra_config(kv_transfer_config.kv_connector_extra_config)
        ''',
    ),
    ("docs/vllm.md", '"aiokvo_tiers": ['): Glue(
        kind="vllm",
        template='''
            from aiokvo.integrations.vllm.extra_config import check_extra_config, tier_configs
            from aiokvo.tiers import DiskTierConfig

            {block}
            check_extra_config(kv_connector_extra_config)
            (tier,) = tier_configs(kv_connector_extra_config["aiokvo_tiers"], model_id="m")
            assert isinstance(tier, DiskTierConfig) and tier.model_id == "m"
        ''',
        replace={"/var/cache/aiokvo": "{tmp}/aiokvo"},
    ),
}
