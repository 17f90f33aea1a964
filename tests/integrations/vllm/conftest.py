"""The vLLM integration's tests: they run in the vLLM venv (``make test-vllm``).

That venv has vLLM's CPU build at the pinned version; the dev venv has no
vLLM, so there these tests are not collected (with a warning saying how to
run them). With ``AIOKVO_REQUIRE_VLLM=1`` (set by ``make test-vllm``, so in
CI) a missing or unsupported vLLM is an error, never a skip.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _vllm_problem() -> str | None:
    try:
        import vllm
    except ImportError as exc:
        return f"vLLM is not installed in {sys.executable} ({exc})"
    from aiokvo.integrations.vllm._compat import check_vllm_version

    try:
        check_vllm_version(vllm.__version__)
    except Exception as exc:
        return str(exc)
    return None


_PROBLEM = _vllm_problem()
if _PROBLEM is not None:
    if os.environ.get("AIOKVO_REQUIRE_VLLM") == "1":
        raise RuntimeError(
            f"the vLLM integration tests need the vLLM venv: {_PROBLEM}. "
            "Build it with `make .vllm-venv` (scripts/vllm_venv.sh), which needs PyPI."
        )
    collect_ignore_glob = ["*.py"]
    warnings.warn(
        f"tests/integrations/vllm not collected: {_PROBLEM}; run `make test-vllm`",
        pytest.PytestWarning,
        stacklevel=1,
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integrations.vllm.harness import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_opt"))


@pytest.fixture
def harness_factory(tiny_model: Path) -> Iterator[object]:
    from tests.integrations.vllm.harness import Harness, Options

    made: list[Harness] = []

    def make(**options: object) -> Harness:
        h = Harness(Options(**options), tiny_model)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
