"""OffloadingSpec / CPUOffloadingSpec wiring and the lazy OffloadingSpecFactory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from aiokvo.config import OffloadConfig
from aiokvo.errors import ConfigError, SpecLoadError
from aiokvo.factory import OffloadingSpecFactory
from aiokvo.offloading_spec import CPUOffloadingSpec, OffloadingSpec
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

MIB = 1 << 20


def make_config(**overrides: Any) -> OffloadConfig:
    fields: dict[str, Any] = {
        "gpu_block_sizes": (16,),
        "hash_block_size": 16,
        "cpu_bytes_to_use": 64 * MIB,
        "kv_bytes_per_block": MIB,
    }
    fields.update(overrides)
    return OffloadConfig(**fields)


def mib_caches() -> Any:
    """KV caches holding the MIB bytes per block that ``make_config`` promises."""
    import torch

    from aiokvo.layout import CanonicalKVCaches

    return CanonicalKVCaches.from_engine(
        [torch.zeros((2, MIB // 2), dtype=torch.int8) for _ in "kv"]
    )


# -- fakes standing in for the manager and handler modules --------------------------


class FakeManager:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


class FakeReuse(FakeManager):
    def __init__(self, backing: FakeManager, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backing = backing

    def shutdown(self) -> None:
        super().shutdown()
        self.backing.shutdown()


@dataclass
class FakePair:
    kv_caches: object
    kwargs: dict[str, Any]
    gpu_to_cpu: object = field(default_factory=object)
    cpu_to_gpu: object = field(default_factory=object)
    closes: int = 0

    async def aclose(self) -> None:
        self.closes += 1


@pytest.fixture
def fake_core(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Replace the manager and handler-pair modules with recording fakes."""
    built: dict[str, list[Any]] = {"managers": [], "reuse": [], "pairs": []}

    def cpu_manager(**kwargs: Any) -> FakeManager:
        built["managers"].append(FakeManager(**kwargs))
        return built["managers"][-1]

    def reuse_manager(backing: FakeManager, **kwargs: Any) -> FakeReuse:
        built["reuse"].append(FakeReuse(backing, **kwargs))
        return built["reuse"][-1]

    def make_pair(kv_caches: object, **kwargs: Any) -> FakePair:
        built["pairs"].append(FakePair(kv_caches, kwargs))
        return built["pairs"][-1]

    for name, attr, value in (
        ("aiokvo.manager.cpu", "CPUOffloadingManager", cpu_manager),
        ("aiokvo.manager.reuse", "FilterReusedOffloadingManager", reuse_manager),
        ("aiokvo.handlers.routes", "make_cpu_gpu_handlers", make_pair),
    ):
        module = types.ModuleType(name)
        setattr(module, attr, value)
        monkeypatch.setitem(sys.modules, name, module)
    return built


# -- OffloadingSpec / CPUOffloadingSpec -----------------------------------------------


def test_spec_needs_an_offload_config() -> None:
    with pytest.raises(ConfigError, match=r"OffloadConfig, got \{'cpu_bytes_to_use': 1\}"):
        CPUOffloadingSpec({"cpu_bytes_to_use": 1})  # type: ignore[arg-type]


def test_offloading_spec_is_abstract() -> None:
    with pytest.raises(TypeError):
        OffloadingSpec(make_config())  # type: ignore[abstract]


def test_cpu_spec_sizes_the_pool_from_the_config() -> None:
    config = make_config(world_size=2, offloaded_block_size=32)
    spec = CPUOffloadingSpec(config)
    assert spec.block_size_factor == 2
    assert spec.num_blocks == config.num_cpu_blocks == 64 * MIB // (MIB * 2 * 2)


@pytest.mark.parametrize("threshold", [0, 1])
def test_get_manager_builds_the_cpu_manager_once(
    fake_core: dict[str, list[Any]], threshold: int
) -> None:
    config = make_config(eviction_policy="arc", enable_events=True, store_threshold=threshold)
    spec = CPUOffloadingSpec(config)
    manager = spec.get_manager()
    assert spec.get_manager() is manager
    assert fake_core["managers"] == [manager]
    assert fake_core["reuse"] == []
    assert manager.kwargs == {"num_blocks": 64, "cache_policy": "arc", "enable_events": True}


@pytest.mark.parametrize("threshold", [2, 5])
def test_get_manager_wraps_the_reuse_filter_from_threshold_two(
    fake_core: dict[str, list[Any]], threshold: int
) -> None:
    spec = CPUOffloadingSpec(make_config(store_threshold=threshold, max_tracker_size=99))
    manager = spec.get_manager()
    assert spec.get_manager() is manager
    assert fake_core["reuse"] == [manager]
    assert manager.backing is fake_core["managers"][0]
    assert manager.kwargs == {"store_threshold": threshold, "max_tracker_size": 99}


def test_get_handlers_yields_both_directions_built_once(fake_core: dict[str, list[Any]]) -> None:
    spec = CPUOffloadingSpec(make_config(offloaded_block_size=48))
    kv_caches = mib_caches()
    routes = list(spec.get_handlers(kv_caches))
    (pair,) = fake_core["pairs"]
    assert pair.kv_caches is kv_caches
    assert pair.kwargs == {"block_size_factor": 3, "num_cpu_blocks": 64 * MIB // (3 * MIB)}
    assert routes == [
        (GPULoadStoreSpec, CPULoadStoreSpec, pair.gpu_to_cpu),
        (CPULoadStoreSpec, GPULoadStoreSpec, pair.cpu_to_gpu),
    ]
    assert list(spec.get_handlers(kv_caches)) == routes
    assert len(fake_core["pairs"]) == 1


def test_get_handlers_raises_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("aiokvo.handlers.routes")

    def broken(kv_caches: object, **kwargs: Any) -> None:
        raise ConfigError("no tensors in kv_caches")

    module.make_cpu_gpu_handlers = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "aiokvo.handlers.routes", module)
    spec = CPUOffloadingSpec(make_config())
    with pytest.raises(ConfigError, match="no tensors"):
        spec.get_handlers(mib_caches())  # not only once iterated


async def test_aclose_closes_handlers_and_shuts_the_manager_down(
    fake_core: dict[str, list[Any]],
) -> None:
    async with CPUOffloadingSpec(make_config(store_threshold=2)) as spec:
        wrapped = spec.get_manager()
        list(spec.get_handlers(mib_caches()))
    (pair,) = fake_core["pairs"]
    (backing,) = fake_core["managers"]
    assert (pair.closes, wrapped.shutdowns, backing.shutdowns) == (1, 1, 1)
    await spec.aclose()  # idempotent
    assert (pair.closes, wrapped.shutdowns) == (1, 1)


async def test_aclose_of_an_unused_spec_is_a_no_op(fake_core: dict[str, list[Any]]) -> None:
    await CPUOffloadingSpec(make_config()).aclose()
    assert fake_core == {"managers": [], "reuse": [], "pairs": []}


# -- OffloadingSpecFactory ------------------------------------------------------------


@pytest.fixture(autouse=True)
def base_registry_unchanged() -> Iterator[None]:
    before = OffloadingSpecFactory.registered_specs()
    yield
    assert OffloadingSpecFactory.registered_specs() == before, "a test leaked a registration"


@pytest.fixture
def factory() -> type[OffloadingSpecFactory]:
    """A factory subclass with its own copy of the registry."""
    return type("IsolatedFactory", (OffloadingSpecFactory,), {})


@pytest.fixture
def spec_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An importable, not yet imported module with a few spec-like classes."""
    name = f"aiokvo_test_specs_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from aiokvo.offloading_spec import OffloadingSpec

            class LazySpec(OffloadingSpec):
                def get_manager(self):
                    raise NotImplementedError

                def get_handlers(self, kv_caches):
                    return iter(())

            class AbstractSpec(OffloadingSpec):
                pass

            class NotASpec:
                def __init__(self, config):
                    self.config = config

            def spec_function(config):
                return None
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_cpu_spec_is_preregistered() -> None:
    assert OffloadingSpecFactory.registered_specs()["CPUOffloadingSpec"] == (
        "aiokvo.offloading_spec",
        "CPUOffloadingSpec",
    )
    spec = OffloadingSpecFactory.create_spec(make_config())
    assert type(spec) is CPUOffloadingSpec
    assert spec.config == make_config()


def test_registration_is_lazy(factory: type[OffloadingSpecFactory], spec_module: str) -> None:
    factory.register_spec("Lazy", spec_module, "LazySpec")
    assert spec_module not in sys.modules
    config = make_config(spec_name="Lazy")
    spec = factory.create_spec(config)
    assert spec_module in sys.modules
    assert type(spec).__name__ == "LazySpec"
    assert type(spec).__module__ == spec_module
    assert spec.config is config


def test_registry_is_per_class(factory: type[OffloadingSpecFactory], spec_module: str) -> None:
    factory.register_spec("Lazy", spec_module, "LazySpec")
    assert "Lazy" in factory.registered_specs()
    assert "Lazy" not in OffloadingSpecFactory.registered_specs()
    with pytest.raises(SpecLoadError, match="'Lazy'"):
        OffloadingSpecFactory.create_spec(make_config(spec_name="Lazy"))


def test_register_and_unregister_on_the_base_class(spec_module: str) -> None:
    OffloadingSpecFactory.register_spec("LazyOnBase", spec_module, "LazySpec")
    try:
        spec = OffloadingSpecFactory.create_spec(make_config(spec_name="LazyOnBase"))
        assert type(spec).__name__ == "LazySpec"
    finally:
        OffloadingSpecFactory.unregister_spec("LazyOnBase")
    assert "LazyOnBase" not in OffloadingSpecFactory.registered_specs()


def test_registering_a_name_twice_fails(factory: type[OffloadingSpecFactory]) -> None:
    with pytest.raises(SpecLoadError, match=r"'CPUOffloadingSpec' is already registered"):
        factory.register_spec("CPUOffloadingSpec", "elsewhere", "Other")
    registered = factory.registered_specs()["CPUOffloadingSpec"]
    assert registered == ("aiokvo.offloading_spec", "CPUOffloadingSpec")


@pytest.mark.parametrize(
    ("args", "bad"),
    [
        (("", "m", "C"), "name"),
        (("n", "", "C"), "module_path"),
        (("n", "m", None), "class_name"),
    ],
)
def test_register_rejects_empty_arguments(
    factory: type[OffloadingSpecFactory], args: tuple[Any, ...], bad: str
) -> None:
    with pytest.raises(SpecLoadError, match=f"{bad} must be a non-empty string"):
        factory.register_spec(*args)


def test_unregister_unknown_name_fails(factory: type[OffloadingSpecFactory]) -> None:
    with pytest.raises(SpecLoadError, match="'Nope' is not registered"):
        factory.unregister_spec("Nope")


def test_unknown_name_falls_back_to_the_module_path(
    factory: type[OffloadingSpecFactory], spec_module: str
) -> None:
    spec = factory.create_spec(make_config(spec_name="LazySpec", spec_module_path=spec_module))
    assert type(spec).__name__ == "LazySpec"
    assert type(spec).__module__ == spec_module


def test_registry_wins_over_the_module_path(
    factory: type[OffloadingSpecFactory], spec_module: str
) -> None:
    config = make_config(spec_name="CPUOffloadingSpec", spec_module_path=spec_module)
    assert type(factory.create_spec(config)) is CPUOffloadingSpec
    assert spec_module not in sys.modules


def test_unknown_name_without_module_path_fails(factory: type[OffloadingSpecFactory]) -> None:
    with pytest.raises(SpecLoadError, match=r"unknown offloading spec 'GhostSpec'"):
        factory.create_spec(make_config(spec_name="GhostSpec"))


def test_missing_registered_module_fails(factory: type[OffloadingSpecFactory]) -> None:
    factory.register_spec("Broken", "aiokvo_no_such_module_xyz", "Spec")
    with pytest.raises(SpecLoadError, match=r"cannot import module 'aiokvo_no_such_module_xyz'"):
        factory.create_spec(make_config(spec_name="Broken"))


def test_missing_fallback_module_fails(factory: type[OffloadingSpecFactory]) -> None:
    config = make_config(spec_name="Spec", spec_module_path="aiokvo_no_such_module_xyz")
    with pytest.raises(SpecLoadError, match=r"'aiokvo_no_such_module_xyz' for offloading spec"):
        factory.create_spec(config)


@pytest.mark.parametrize(
    ("class_name", "message"),
    [
        ("MissingSpec", r"has no class 'MissingSpec'"),
        ("NotASpec", r"\.NotASpec is not an OffloadingSpec subclass"),
        ("spec_function", r"\.spec_function is not an OffloadingSpec subclass"),
        ("AbstractSpec", r"\.AbstractSpec is abstract"),
    ],
)
def test_bad_class_fails_naming_it(
    factory: type[OffloadingSpecFactory], spec_module: str, class_name: str, message: str
) -> None:
    factory.register_spec("Bad", spec_module, class_name)
    with pytest.raises(SpecLoadError, match=message):
        factory.create_spec(make_config(spec_name="Bad"))
    config = make_config(spec_name=class_name, spec_module_path=spec_module)
    with pytest.raises(SpecLoadError, match=message):
        factory.create_spec(config)


# -- with the real managers --------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "policy_cls"), [("lru", "LRUCachePolicy"), ("arc", "ARCCachePolicy")]
)
def test_real_cpu_manager_is_sized_by_the_config(policy: str, policy_cls: str) -> None:
    from aiokvo.manager.cpu import CPUOffloadingManager

    spec = CPUOffloadingSpec(make_config(eviction_policy=policy, world_size=2))
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert manager.num_blocks == 32
    assert type(manager.policy).__name__ == policy_cls


def test_real_reuse_filter_wraps_the_cpu_manager() -> None:
    from aiokvo.keys import make_offload_key
    from aiokvo.manager.cpu import CPUOffloadingManager
    from aiokvo.manager.reuse import FilterReusedOffloadingManager
    from aiokvo.specs import ReqContext

    spec = CPUOffloadingSpec(make_config(store_threshold=2, max_tracker_size=10))
    manager = spec.get_manager()
    assert isinstance(manager, FilterReusedOffloadingManager)
    assert isinstance(manager.backing, CPUOffloadingManager)
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 10)

    key = make_offload_key(b"reused-block", 0)
    ctx = ReqContext()
    assert manager.lookup(key, ctx) is False
    first = manager.prepare_store([key], ctx)
    assert first is not None and first.keys_to_store == []  # seen once: filtered out
    assert manager.lookup(key, ctx) is False
    second = manager.prepare_store([key], ctx)
    assert second is not None and second.keys_to_store == [key]


async def test_real_manager_events_reach_a_subscriber_through_the_spec() -> None:
    from aiokvo.keys import make_offload_key
    from aiokvo.specs import OffloadingEvent, ReqContext

    key = make_offload_key(b"block", 0)
    async with CPUOffloadingSpec(make_config(enable_events=True)) as spec:
        manager = spec.get_manager()
        events = manager.subscribe()
        out = manager.prepare_store([key], ReqContext())
        assert out is not None
        manager.complete_store(out.keys_to_store)
        assert list(manager.take_events()) == [OffloadingEvent([key], "CPU", removed=False)]
    assert events.closed, "closing the spec shut the manager down"
    assert [item async for item in events] == [OffloadingEvent([key], "CPU", removed=False)]


@pytest.mark.both_loops
async def test_real_handlers_round_trip_a_block_through_the_spec() -> None:
    import torch

    from aiokvo.handlers.worker import OffloadingWorker
    from aiokvo.keys import make_offload_key
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.specs import ReqContext

    layers = [torch.zeros((8, 2, 64), dtype=torch.int8) for _ in range(2)]  # 2 layers
    kv_caches = CanonicalKVCaches.from_block_tensors([layers])
    page = kv_caches.page_bytes_per_block
    config = make_config(cpu_bytes_to_use=4 * page, kv_bytes_per_block=page)
    assert config.num_cpu_blocks == 4
    payload = torch.arange(128, dtype=torch.int8).reshape(2, 64)
    layers[0][3] = payload
    layers[1][3] = -payload
    key = make_offload_key(b"prefix", 0)
    ctx = ReqContext()

    async with CPUOffloadingSpec(config) as spec, OffloadingWorker() as worker:
        for route in spec.get_handlers(kv_caches):
            worker.register_handler(*route)
        manager = spec.get_manager()

        out = manager.prepare_store([key], ctx)
        assert out is not None
        gpu_src = GPULoadStoreSpec([3], group_sizes=[1], block_indices=[0])
        stored = await worker.transfer_async(1, (gpu_src, out.store_spec))
        assert stored.success and stored.transfer_type == ("GPU", "CPU")
        manager.complete_store(out.keys_to_store)

        cpu_src = manager.prepare_load([key], ctx)
        gpu_dst = GPULoadStoreSpec([6], group_sizes=[1], block_indices=[0])
        loaded = await worker.transfer_async(2, (cpu_src, gpu_dst))
        manager.complete_load([key])
        assert loaded.success and loaded.transfer_type == ("CPU", "GPU")
    assert torch.equal(layers[0][6], payload)
    assert torch.equal(layers[1][6], -payload)


# -- the pool checked against the KV caches -------------------------------------------


def test_kv_bytes_per_block_is_checked_against_the_kv_caches(
    fake_core: dict[str, list[Any]],
) -> None:
    # The engine's figure is 32 KiB but its tensors hold 1 MiB per block: the
    # 2048-block pool sized for a 64 MiB budget would take 2 GiB.
    spec = CPUOffloadingSpec(make_config(kv_bytes_per_block=32 * 1024))
    with pytest.raises(ConfigError) as info:
        spec.get_handlers(mib_caches())
    message = str(info.value)
    assert "kv_bytes_per_block=32768" in message and f"hold {MIB} bytes" in message
    assert f"would take {2048 * MIB} bytes against cpu_bytes_to_use={64 * MIB}" in message
    assert fake_core["pairs"] == []
    with pytest.raises(ConfigError, match=r"kv_caches must be CanonicalKVCaches .*, got list"):
        spec.get_handlers([])


def test_a_budget_below_one_block_is_an_error_not_an_empty_pool(
    fake_core: dict[str, list[Any]],
) -> None:
    spec = CPUOffloadingSpec(
        make_config(cpu_bytes_to_use=3 * MIB, world_size=2, offloaded_block_size=32)
    )
    assert spec.num_blocks == 0
    needle = (
        f"cpu_bytes_to_use={3 * MIB} is below one offloaded block: kv_bytes_per_block={MIB} "
        f"x world_size=2 x block_size_factor=2 = {4 * MIB} bytes"
    )
    with pytest.raises(ConfigError) as info:
        spec.get_handlers(mib_caches())
    assert needle in str(info.value)
    with pytest.raises(ConfigError, match="is below one offloaded block"):
        spec.get_manager()
    assert fake_core == {"managers": [], "reuse": [], "pairs": []}


async def test_instance_id_makes_the_pool_one_shared_region(
    fake_core: dict[str, list[Any]], tmp_path: Path
) -> None:
    from aiokvo.memory.shared_region import SharedOffloadRegion

    iid = f"spec-{uuid.uuid4().hex[:10]}"
    config = make_config(world_size=4, rank=2, instance_id=iid, offloaded_block_size=32)
    async with CPUOffloadingSpec(config, region_options={"directory": tmp_path}) as spec:
        list(spec.get_handlers(mib_caches()))
        (pair,) = fake_core["pairs"]
        region = pair.kwargs["region"]
        assert isinstance(region, SharedOffloadRegion) and spec.region is region
        assert region.path == tmp_path / f"aiokvo_offload_{iid}.mmap"
        assert (region.num_blocks, region.num_workers, region.rank) == (8, 4, 2)
        assert region.page_bytes_per_rank == 2 * MIB  # kv_bytes_per_block x factor
        assert pair.kwargs["num_cpu_blocks"] == config.num_cpu_blocks == 8
    assert pair.closes == 1 and region.closed and spec.region is None
    assert list(tmp_path.iterdir()) == []


async def test_a_region_passed_in_handler_options_is_borrowed(
    fake_core: dict[str, list[Any]], tmp_path: Path
) -> None:
    from aiokvo.memory.shared_region import SharedOffloadRegion

    iid = f"spec-{uuid.uuid4().hex[:10]}"
    with SharedOffloadRegion(
        iid, num_blocks=64, num_workers=1, page_bytes_per_rank=MIB, rank=0, directory=tmp_path
    ) as mine:
        config = make_config(instance_id=iid)
        async with CPUOffloadingSpec(config, handler_options={"region": mine}) as spec:
            list(spec.get_handlers(mib_caches()))
            assert fake_core["pairs"][0].kwargs["region"] is mine and spec.region is None
        assert not mine.closed  # the caller opened it, the caller closes it


RANK_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    import numpy as np, torch
    from aiokvo.config import OffloadConfig
    from aiokvo.layout import CanonicalKVCaches
    from aiokvo.offloading_spec import CPUOffloadingSpec
    from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec

    iid, directory, backend = sys.argv[1], sys.argv[2], sys.argv[5]
    rank, factor = int(sys.argv[3]), int(sys.argv[4])
    GPU_BLOCKS, CPU_BLOCKS, WORLD = 16, 5, 2
    GPU_IDS = [1, 4, 7, 2, 9, 5, 11, 3, 0][: 3 * factor]
    CPU_IDS = [3, 0, 4]

    def layers(r):
        gen = torch.Generator().manual_seed(7 + r)
        return [torch.randn((GPU_BLOCKS, 2, 3, 8), generator=gen).to(torch.bfloat16),
                torch.randint(-128, 127, (GPU_BLOCKS, 10), dtype=torch.int8, generator=gen)]

    def expected_slice(r):
        caches = CanonicalKVCaches.from_engine(layers(r))
        out = np.zeros((CPU_BLOCKS, caches.page_bytes_per_block * factor), dtype=np.int8)
        offset = 0
        for t in caches.tensors:
            page = t.page_size_bytes
            for k, gpu in enumerate(GPU_IDS):
                row, j = CPU_IDS[k // factor], k % factor
                out[row, offset + j * page: offset + (j + 1) * page] = t.tensor[gpu].numpy()
            offset += page * factor
        return out

    def say(**fields):
        print(json.dumps(fields), flush=True)

    async def main():
        mine = layers(rank)
        caches = CanonicalKVCaches.from_engine(mine)
        page = caches.page_bytes_per_block
        config = OffloadConfig(
            gpu_block_sizes=(16,), hash_block_size=16, kv_bytes_per_block=page,
            cpu_bytes_to_use=CPU_BLOCKS * page * WORLD * factor + 99,
            offloaded_block_size=16 * factor, world_size=WORLD, rank=rank, instance_id=iid,
        )
        options = {"directory": directory, "timeout": 20}
        if backend == "host":
            spec = CPUOffloadingSpec(config, region_options=options)
            (_, _, store), (_, _, load) = spec.get_handlers(caches)
            region, close = spec.region, spec.aclose
        else:  # the CUDA backend on the fake driver; it pins the region
            from aiokvo.device.fake import FakeDriver
            from aiokvo.handlers.cuda.pair import make_cuda_handlers
            from aiokvo.memory.shared_region import SharedOffloadRegion
            fake = FakeDriver()
            region = SharedOffloadRegion(
                iid, num_blocks=config.num_cpu_blocks, num_workers=WORLD,
                page_bytes_per_rank=page * factor, rank=rank, **options)
            pair = make_cuda_handlers(caches, block_size_factor=factor,
                                      num_cpu_blocks=config.num_cpu_blocks, region=region,
                                      driver=fake)
            store, load = pair.gpu_to_cpu, pair.cpu_to_gpu
            async def close():
                await pair.aclose()
                region.close()
                fake.close()
        gpu = GPULoadStoreSpec(GPU_IDS, [len(GPU_IDS)], [0])
        stored = await store.transfer_async(1, (gpu, CPULoadStoreSpec(CPU_IDS)))
        say(stored=stored.success, creator=region.is_creator, generation=region.generation,
            pinned=region.is_pinned)
        sys.stdin.readline()  # every rank has stored

        width = page * factor
        def slices_ok():
            rows = region.rows().numpy()
            return [bool(np.array_equal(rows[:, r * width:(r + 1) * width], expected_slice(r)))
                    for r in range(WORLD)]
        before = slices_ok()
        for layer in mine:
            layer.zero_()
        loaded = await load.transfer_async(2, (CPULoadStoreSpec(CPU_IDS), gpu))
        fresh = layers(rank)
        reloaded = all(torch.equal(a[GPU_IDS], b[GPU_IDS]) for a, b in zip(mine, fresh))
        others_zero = all(not a[[b for b in range(GPU_BLOCKS) if b not in GPU_IDS]].any()
                          for a in mine)
        say(loaded=loaded.success, before=before, reloaded=reloaded, others_zero=others_zero)
        sys.stdin.readline()  # every rank has reloaded
        say(after=slices_ok())
        sys.stdin.readline()
        await close()
        say(closed=True)

    asyncio.run(main())
    """
)


@pytest.mark.system
@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("backend", ["host", "cuda"])
def test_two_ranks_in_two_processes_share_one_region_as_their_pool(
    tmp_path: Path, factor: int, backend: str
) -> None:
    iid = f"ranks-{uuid.uuid4().hex[:10]}"
    root = Path(__file__).resolve().parents[1]
    argv = [sys.executable, "-c", RANK_CHILD, iid, str(tmp_path), "", str(factor), backend]
    children = []
    for rank in range(2):
        argv[5] = str(rank)
        children.append(
            subprocess.Popen(
                list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root, text=True
            )
        )

    def step(message: str | None = None) -> list[dict[str, Any]]:
        replies = []
        for child in children:
            assert child.stdin is not None and child.stdout is not None
            if message is not None:
                child.stdin.write(message + "\n")
                child.stdin.flush()
            line = child.stdout.readline()
            assert line, f"rank {children.index(child)} died (exit {child.wait()})"
            replies.append(json.loads(line))
        return replies

    try:
        hello = step()
        assert [h["stored"] for h in hello] == [True, True]
        assert sorted(h["creator"] for h in hello) == [False, True]
        assert {h["generation"] for h in hello} == {1}, "both ranks mapped the same file"
        assert [h["pinned"] for h in hello] == [backend == "cuda"] * 2
        checked = step("go")
        for rank, reply in enumerate(checked):
            assert reply["loaded"] and reply["reloaded"] and reply["others_zero"], rank
            assert reply["before"] == [True, True], "each rank's bytes, and only those"
        final = step("go")
        assert [r["after"] for r in final] == [[True, True]] * 2, "a reload wrote no pool byte"
        assert step("close") == [{"closed": True}] * 2
        assert [child.wait(timeout=30) for child in children] == [0, 0]
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert list(tmp_path.iterdir()) == [], "the creator removed the region and its lock"
