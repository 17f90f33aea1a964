"""Building the worker side: KV caches, handlers, the loop driver and the facade.

Kept apart from :mod:`~aiokvo.integrations.vllm.spec` so that importing the
spec (vLLM's front end does, for ``build_metric_definitions``) pulls in no
data plane.
"""

from __future__ import annotations

from typing import Any, Protocol

from aiokvo.config import OffloadConfig
from aiokvo.handlers.sync import SyncOffloadingWorker
from aiokvo.handlers.worker import OffloadingWorker
from aiokvo.integrations.vllm.convert import caches_from_vllm
from aiokvo.integrations.vllm.failures import FailureLog
from aiokvo.integrations.vllm.worker import AiokvoOffloadingWorker, LoadFailurePolicy
from aiokvo.offloading_spec import CPUOffloadingSpec
from aiokvo.runtime.pump import LoopDriverMode, make_loop_driver

__all__ = ["WorkerSettings", "build_worker"]


class WorkerSettings(Protocol):
    """What the worker side reads from the spec (``AiokvoOffloadingSpec`` has it).

    A protocol rather than the spec class so that this module, which the spec
    imports lazily, never imports the spec back.
    """

    loop_mode: LoopDriverMode
    handler_options: dict[str, Any]
    inner_spec_class: type[CPUOffloadingSpec]
    aiokvo_config: OffloadConfig
    retries: int
    on_load_failure: LoadFailurePolicy

    def failure_log(self) -> FailureLog: ...


def build_worker(spec: WorkerSettings, vllm_kv_caches: Any) -> AiokvoOffloadingWorker:
    """The worker for ``spec`` over vLLM's ``CanonicalKVCaches``.

    With a loop on its own thread (``aiokvo_loop="thread"``, or ``"auto"``
    where vLLM's thread already runs a loop) and CUDA caches, the caller's
    compute stream is read on vLLM's thread before each submission and
    handed to the CUDA handlers, which would otherwise wait for the loop
    thread's stream.
    """
    kv_caches = caches_from_vllm(vllm_kv_caches)
    driver = make_loop_driver(spec.loop_mode)
    options = dict(spec.handler_options)
    before_submit = None
    if kv_caches.is_cuda and not driver.runs_on_caller_thread and "producer_stream" not in options:
        import torch

        captured = [0]

        def capture() -> None:
            captured[0] = int(torch.cuda.current_stream().cuda_stream)

        before_submit = capture
        options["producer_stream"] = lambda: captured[0]
    inner = spec.inner_spec_class(spec.aiokvo_config, handler_options=options)
    try:
        worker = OffloadingWorker()
        routes = list(inner.get_handlers(kv_caches))
        for route in routes:
            worker.register_handler(*route)
    except BaseException:
        driver.run(inner.aclose())
        driver.close()
        raise
    sync = SyncOffloadingWorker(worker, driver, retries=spec.retries, before_submit=before_submit)

    def close() -> None:
        try:
            sync.close()
            driver.run(inner.aclose())
        finally:
            driver.close()

    return AiokvoOffloadingWorker(
        sync,
        failure_log=spec.failure_log(),
        close=close,
        on_load_failure=spec.on_load_failure,
        cpu_pool=getattr(routes[0][2], "cpu_tensors", None),
    )

