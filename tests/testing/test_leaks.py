"""drain() and assert_no_leaks(), against a real manager, handlers and the fake driver."""

from __future__ import annotations

import threading

import pytest

from aiokvo.device.fake import FakeDriver
from aiokvo.errors import ConfigError
from aiokvo.handlers.routes import make_cpu_gpu_handlers
from aiokvo.keys import make_offload_key
from aiokvo.manager.cpu import CPUOffloadingManager
from aiokvo.memory.pinned import PinnedHostTensor
from aiokvo.specs import CPULoadStoreSpec, GPULoadStoreSpec, ReqContext
from aiokvo.testing import assert_no_leaks, drain, leaked_threads, make_kv_caches

CTX = ReqContext()
KEYS = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]


def test_a_clean_manager_passes() -> None:
    manager = CPUOffloadingManager(8)
    out = manager.prepare_store(KEYS, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.prepare_load(KEYS[:2], CTX)
    manager.complete_load(KEYS[:2])
    assert_no_leaks(manager, KEYS, num_blocks=8)


def test_pins_reservations_and_lost_blocks_are_all_reported() -> None:
    manager = CPUOffloadingManager(8)
    out = manager.prepare_store(KEYS, CTX)
    assert out is not None
    manager.complete_store(KEYS[:3])  # KEYS[3] is still being written
    manager.prepare_load(KEYS[:1], CTX)
    manager.prepare_load(KEYS[:1], CTX)
    with pytest.raises(AssertionError) as caught:
        assert_no_leaks(manager, KEYS, num_blocks=9)
    message = str(caught.value)
    assert "1 keys still pinned by loads" in message and "2 pins" in message
    assert "1 keys still reserved by stores that never completed" in message
    assert "OffloadKey(" in message and repr(KEYS[3]) not in message  # keys shown briefly
    assert "blocks leaked: 4 cached + 4 free != 9 blocks" in message


def test_a_running_aiokvo_thread_is_a_leak_until_it_ends() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="aiokvo-test-leak", daemon=True)
    thread.start()
    try:
        with pytest.raises(AssertionError, match="threads still running: aiokvo-test-leak"):
            assert_no_leaks(thread_wait=0.05)
        assert_no_leaks(ignore_threads=[thread], thread_wait=0.05)
        assert leaked_threads(wait=0.05) == [thread]
    finally:
        stop.set()
        thread.join()
    assert_no_leaks(thread_wait=0.05)


def test_the_fake_driver_reports_what_is_still_alive() -> None:
    driver = FakeDriver()
    try:
        pinned = PinnedHostTensor(2, 64, driver=driver)
        stream = driver.stream_create()
        with pytest.raises(AssertionError) as caught:
            assert_no_leaks(driver=driver, threads=False, thread_wait=0)
        assert "fake driver: 1 streams still alive" in str(caught.value)
        assert "host memory still registered" in str(caught.value)
        driver.stream_destroy(stream)
        pinned.close()
        assert_no_leaks(driver=driver, threads=False)
    finally:
        driver.close()


async def test_drain_waits_for_tasks_and_handlers() -> None:
    kv = make_kv_caches(layers=1, blocks=4, kv_heads=1, head_dim=8)
    async with make_cpu_gpu_handlers(kv.canonical, block_size_factor=1,
                                     num_cpu_blocks=4) as pair:
        tasks = [pair.gpu_to_cpu.transfer_async(i, (GPULoadStoreSpec([i], [1], [0]),
                                                    CPULoadStoreSpec([i])))
                 for i in range(3)]
        results = await drain(*tasks, pair.gpu_to_cpu)
        assert [r.job_id for r in results] == [0, 1, 2] and all(r.success for r in results)
        assert pair.gpu_to_cpu.in_flight == 0
    assert_no_leaks()


async def test_drain_names_what_never_finished() -> None:
    import asyncio

    never: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    with pytest.raises(AssertionError, match=r"1 transfers still in flight after 0\.01 s"):
        await drain(never, timeout=0.01)
    assert not never.done()  # drain cancels nothing
    with pytest.raises(ConfigError, match="drain takes transfer tasks and handlers, got 3"):
        await drain(3)
