"""vLLM's OffloadingConnector on aiokvo, from one config line.

.. code-block:: python

    kv_transfer_config = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "AiokvoOffloadingSpec",
            "spec_module_path": "aiokvo.integrations.vllm",
            "cpu_bytes_to_use": 8 << 30,
        },
    )

Supported vLLM: :data:`SUPPORTED_VLLM` (``pip install 'aiokvo[vllm]'``); see
docs/vllm.md for the keys, the differences from vLLM's native offload and
how it is tested. Importing this module imports vLLM (the spec must subclass
vLLM's own ``OffloadingSpec``) but no data plane.
"""

from __future__ import annotations

import vllm

from aiokvo.integrations.vllm._compat import SUPPORTED_VLLM, TESTED_VLLM, check_vllm_version

check_vllm_version(vllm.__version__)

from aiokvo.integrations.vllm.manager import AiokvoOffloadingManager  # noqa: E402
from aiokvo.integrations.vllm.spec import AIOKVO_KEYS, AiokvoOffloadingSpec  # noqa: E402
from aiokvo.integrations.vllm.worker import AiokvoOffloadingWorker, VllmWorkerStatistics  # noqa: E402

__all__ = [
    "AIOKVO_KEYS",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "AiokvoOffloadingManager",
    "AiokvoOffloadingSpec",
    "AiokvoOffloadingWorker",
    "VllmWorkerStatistics",
]
