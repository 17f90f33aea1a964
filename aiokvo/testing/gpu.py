"""What GPUs a test session has, found without touching CUDA in the test process.

Deciding whether to skip a GPU test must not initialise CUDA in the pytest
process: ``cudaGetDeviceCount`` (and so ``torch.cuda.device_count()``) calls
``cuInit``, after which CUDA fails in every ``fork()``-ed child (the reason
PyTorch has ``PYTORCH_NVML_BASED_CUDA_CHECK``), and suites that fork
workers would break only because a marker was evaluated. So the probe runs
in a short-lived child interpreter (once per session, and only when a
collected test carries a GPU marker): it asks the CUDA runtime through
cuda-python, as :func:`aiokvo.device.driver.cuda_device_count` does, for the
device count and each device's name and total memory.

Why not NVML (``cuda.bindings.nvml``, also context-free)? It lists every GPU
in the machine, ignoring ``CUDA_VISIBLE_DEVICES`` and MIG slicing, so under
a job scheduler it would count devices the tests cannot use. The child sees
exactly the devices the tests will see. Total memory (not free memory) is
what ``min_gpu_memory`` compares: free memory needs a context and changes
while the suite runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GIB", "GpuInfo", "GpuInventory", "GpuRequirement", "probe_gpus"]

GIB = 1 << 30
PROBE_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One visible CUDA device."""

    index: int
    name: str
    total_memory: int  # bytes

    @property
    def total_gib(self) -> float:
        return self.total_memory / GIB


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """The devices a session can use; ``note`` says why there are none, if it knows."""

    devices: tuple[GpuInfo, ...] = ()
    note: str = ""


@dataclass(frozen=True, slots=True)
class GpuRequirement:
    """What a test's markers ask for: ``count`` devices with ``min_gib`` GiB each."""

    count: int = 1
    min_gib: float = 0.0

    def unmet(self, inventory: GpuInventory) -> str | None:
        """None when ``inventory`` satisfies this; else the skip reason."""
        fitting = [d for d in inventory.devices if d.total_memory >= self.min_gib * GIB]
        if len(fitting) >= self.count:
            return None
        devices = "a CUDA device" if self.count == 1 else f"{self.count} CUDA devices"
        if self.min_gib:
            largest = max((d.total_gib for d in inventory.devices), default=0.0)
            found = (f"found {len(fitting)} (largest {largest:.1f} GiB)"
                     if inventory.devices else "found none")
            reason = f"needs {devices} with >= {self.min_gib:g} GiB, {found}"
        else:
            have = len(inventory.devices)
            reason = f"needs {devices}, found {have if have else 'none'}"
        return f"{reason} ({inventory.note})" if inventory.note else reason


_PROBE = r"""
import json
try:
    from cuda.bindings import runtime
except ImportError:
    print(json.dumps({"devices": [], "note": "cuda-python is not installed"}))
    raise SystemExit(0)
err, count = runtime.cudaGetDeviceCount()
if int(err) != 0:
    print(json.dumps({"devices": [], "note": f"cudaGetDeviceCount: {err!r}"}))
    raise SystemExit(0)
devices = []
for index in range(int(count)):
    err, prop = runtime.cudaGetDeviceProperties(index)
    if int(err) != 0:
        continue
    name = prop.name
    if isinstance(name, bytes):
        name = name.split(b"\0", 1)[0].decode(errors="replace")
    devices.append({"index": index, "name": str(name), "total_memory": int(prop.totalGlobalMem)})
print(json.dumps({"devices": devices, "note": ""}))
"""


def probe_gpus(python: str | None = None, timeout: float = PROBE_TIMEOUT) -> GpuInventory:
    """The CUDA devices visible to a child interpreter (never raises)."""
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", _PROBE],
            capture_output=True, text=True, timeout=timeout, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return GpuInventory((), f"GPU probe failed: {exc}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return GpuInventory((), f"GPU probe failed: {tail}")
    try:
        data = json.loads(lines[-1])
        devices = tuple(GpuInfo(int(d["index"]), str(d["name"]), int(d["total_memory"]))
                        for d in data["devices"])
        return GpuInventory(devices, str(data.get("note", "")))
    except (ValueError, KeyError, TypeError) as exc:
        return GpuInventory((), f"GPU probe printed something unexpected: {exc}")


def requirement(
    gpu: Sequence[object] | None, multi_gpu: Sequence[object] | None,
    min_gpu_memory: Sequence[object] | None, where: str,
    names: tuple[str, str, str] = ("gpu", "multi_gpu", "min_gpu_memory"),
) -> GpuRequirement:
    """The requirement of a test's ``gpu``/``multi_gpu``/``min_gpu_memory`` marker args.

    ``names`` are the markers' names as the test wrote them (for messages).
    Raises ``ValueError`` naming ``where`` and the bad argument.
    """
    count = 1
    for name, args, default in ((names[0], gpu, 1), (names[1], multi_gpu, 2)):
        if args is None:
            continue
        if len(args) > 1:
            raise ValueError(f"{where}: @pytest.mark.{name} takes at most one count, got {args!r}")
        value = args[0] if args else default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: @pytest.mark.{name} count must be an int >= 1, "
                             f"got {value!r}")
        count = max(count, value)
    min_gib = 0.0
    if min_gpu_memory is not None:
        if len(min_gpu_memory) != 1:
            raise ValueError(f"{where}: @pytest.mark.{names[2]} takes one size in GiB, "
                             f"got {min_gpu_memory!r}")
        value = min_gpu_memory[0]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: @pytest.mark.{names[2]} size must be a number of "
                             f"GiB > 0, got {value!r}")
        min_gib = float(value)
    return GpuRequirement(count, min_gib)
