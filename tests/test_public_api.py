"""The public surface: DESIGN.md's names, the pure core's imports, and the README's quick start."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import aiokvo

ROOT = Path(__file__).resolve().parent.parent

DESIGN_NAMES = [
    "OffloadKey", "make_offload_key", "get_offload_block_hash", "get_offload_group_idx",
    "ReqContext", "LoadStoreSpec", "BlockIDsLoadStoreSpec", "GPULoadStoreSpec",
    "CPULoadStoreSpec", "PrepareStoreOutput", "OffloadingEvent", "TransferSpec",
    "TransferResult", "OffloadingManager", "CPUOffloadingManager",
    "FilterReusedOffloadingManager", "CachePolicy", "LRUCachePolicy", "ARCCachePolicy",
    "BlockStatus", "EventSubscription", "OffloadingHandler", "OffloadingWorker",
    "OffloadConfig", "OffloadingSpec", "OffloadingSpecFactory", "CPUOffloadingSpec", "run",
]


@pytest.mark.parametrize("name", DESIGN_NAMES)
def test_design_contract_names_import_from_the_package(name: str) -> None:
    assert name in aiokvo.__all__
    assert getattr(aiokvo, name) is not None


def test_every_exported_name_resolves() -> None:
    missing = [name for name in aiokvo.__all__ if not hasattr(aiokvo, name)]
    assert missing == []


def test_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        aiokvo.no_such_name  # noqa: B018


def test_subpackages_export_their_parts() -> None:
    import aiokvo.errors
    import aiokvo.handlers
    import aiokvo.manager

    assert aiokvo.manager.CPUOffloadingManager is aiokvo.CPUOffloadingManager
    assert aiokvo.handlers.OffloadingWorker is aiokvo.OffloadingWorker
    assert issubclass(aiokvo.errors.CudaError, aiokvo.errors.AiokvoError)


@pytest.mark.system
def test_the_core_imports_neither_asyncio_torch_nor_cuda() -> None:
    code = (
        "import sys, aiokvo.manager, aiokvo.keys, aiokvo.specs\n"
        "m = aiokvo.manager.CPUOffloadingManager(4, 'arc')\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] in ('asyncio', 'torch', 'cuda'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == ""


@pytest.mark.system
def test_readme_quick_start_runs_as_written() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python code block"
    out = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "reloaded 4 blocks" in out.stdout


def test_the_tiers_names_resolve_and_the_tier_factories_make_tiers(tmp_path: Path) -> None:
    import aiokvo.testing
    import aiokvo.tiers
    import aiokvo.tiers.disk
    import aiokvo.tiers.mooncake
    from aiokvo.errors import ConfigError
    from aiokvo.tiers import DiskTier, MooncakeTier, Tier

    for module in (aiokvo.tiers, aiokvo.tiers.disk, aiokvo.tiers.mooncake, aiokvo.testing):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], module.__name__
    disk = DiskTier(tmp_path / "disk", capacity_bytes=1 << 20, model_id="m")
    mooncake = MooncakeTier("127.0.0.1:50051", model_id="m")
    assert isinstance(disk, Tier) and isinstance(mooncake, Tier)
    assert (disk.medium, mooncake.medium) == ("DISK", "MOONCAKE")
    assert not (tmp_path / "disk").exists()  # nothing on disk before it is bound
    with pytest.raises(ConfigError, match="capacity_byte"):
        DiskTier(tmp_path, capacity_byte=1 << 20, model_id="m")
    with pytest.raises(ConfigError, match="replicas"):
        MooncakeTier("127.0.0.1:50051", model_id="m", replicas=2)
