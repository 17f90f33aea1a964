"""GPU requirements from markers, and the probe that never touches CUDA in-process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from aiokvo.testing.gpu import GIB, GpuInfo, GpuInventory, GpuRequirement, probe_gpus, requirement

TWO_16 = GpuInventory((GpuInfo(0, "A", 16 * GIB), GpuInfo(1, "B", 16 * GIB)))


@pytest.mark.parametrize(
    ("need", "inventory", "reason"),
    [
        (GpuRequirement(1), TWO_16, None),
        (GpuRequirement(2), TWO_16, None),
        (GpuRequirement(2, 16), TWO_16, None),
        (GpuRequirement(3), TWO_16, "needs 3 CUDA devices, found 2"),
        (GpuRequirement(1), GpuInventory(), "needs a CUDA device, found none"),
        (GpuRequirement(1), GpuInventory((), "no driver"),
         "needs a CUDA device, found none (no driver)"),
        (GpuRequirement(1, 24), TWO_16,
         "needs a CUDA device with >= 24 GiB, found 0 (largest 16.0 GiB)"),
        (GpuRequirement(2, 0.5), GpuInventory(),
         "needs 2 CUDA devices with >= 0.5 GiB, found none"),
    ],
)
def test_a_requirement_names_what_is_missing(
    need: GpuRequirement, inventory: GpuInventory, reason: str | None
) -> None:
    assert need.unmet(inventory) == reason


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (((), None, None), GpuRequirement(1)),
        (((3,), None, None), GpuRequirement(3)),
        ((None, (), None), GpuRequirement(2)),
        ((None, (4,), (40,)), GpuRequirement(4, 40.0)),
        ((None, None, (0.5,)), GpuRequirement(1, 0.5)),
        (((2,), (3,), None), GpuRequirement(3)),
    ],
)
def test_marker_arguments_become_a_requirement(
    args: tuple[tuple[object, ...] | None, ...], expected: GpuRequirement
) -> None:
    assert requirement(*args, "t.py::t") == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((0,), None, None), "t.py::t: @pytest.mark.gpu count must be an int >= 1, got 0"),
        (((True,), None, None), "gpu count must be an int >= 1, got True"),
        (((1, 2), None, None), "gpu takes at most one count"),
        ((None, ("2",), None), "multi_gpu count must be an int >= 1, got '2'"),
        ((None, None, ()), "min_gpu_memory takes one size in GiB"),
        ((None, None, (-1,)), "min_gpu_memory size must be a number of GiB > 0, got -1"),
    ],
)
def test_bad_marker_arguments_are_named(
    args: tuple[tuple[object, ...] | None, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        requirement(*args, "t.py::t")


@pytest.mark.system
def test_the_probe_agrees_with_the_cuda_runtime_in_a_child() -> None:
    inventory = probe_gpus()
    code = ("from aiokvo.device.driver import cuda_device_count; print(cuda_device_count())")
    count = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    assert len(inventory.devices) == count
    assert all(d.total_memory > 0 and d.name for d in inventory.devices)
    assert [d.index for d in inventory.devices] == list(range(count))
    if not count:
        assert inventory.note  # says why: no cuda-python, no driver, ...


@pytest.mark.system
def test_a_broken_interpreter_reads_as_no_gpu_with_the_reason() -> None:
    inventory = probe_gpus(python="/nonexistent/python")
    assert inventory.devices == ()
    assert inventory.note.startswith("GPU probe failed:")
