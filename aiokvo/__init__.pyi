# The public names of ``aiokvo``: the one list. ``__init__.py`` reads these
# imports and resolves each name lazily, on first use (PEP 562).
from aiokvo import errors as errors
from aiokvo.config import OffloadConfig as OffloadConfig
from aiokvo.events import EventSubscription as EventSubscription
from aiokvo.events import Lagged as Lagged
from aiokvo.factory import OffloadingSpecFactory as OffloadingSpecFactory
from aiokvo.handlers.base import CpuGpuHandlers as CpuGpuHandlers
from aiokvo.handlers.base import OffloadingHandler as OffloadingHandler
from aiokvo.handlers.base import SingleDirectionHandler as SingleDirectionHandler
from aiokvo.handlers.cuda.handler import CudaOffloadingHandler as CudaOffloadingHandler
from aiokvo.handlers.host.handler import HostOffloadingHandler as HostOffloadingHandler
from aiokvo.handlers.routes import make_cpu_gpu_handlers as make_cpu_gpu_handlers
from aiokvo.handlers.task import TransferTask as TransferTask
from aiokvo.handlers.worker import OffloadingWorker as OffloadingWorker
from aiokvo.keys import OffloadKey as OffloadKey
from aiokvo.keys import get_offload_block_hash as get_offload_block_hash
from aiokvo.keys import get_offload_group_idx as get_offload_group_idx
from aiokvo.keys import make_offload_key as make_offload_key
from aiokvo.layout import CanonicalKVCacheRef as CanonicalKVCacheRef
from aiokvo.layout import CanonicalKVCaches as CanonicalKVCaches
from aiokvo.layout import CanonicalKVCacheTensor as CanonicalKVCacheTensor
from aiokvo.manager.base import OffloadingManager as OffloadingManager
from aiokvo.manager.cpu import CPUOffloadingManager as CPUOffloadingManager
from aiokvo.manager.policies import ARCCachePolicy as ARCCachePolicy
from aiokvo.manager.policies import BlockStatus as BlockStatus
from aiokvo.manager.policies import CachePolicy as CachePolicy
from aiokvo.manager.policies import LRUCachePolicy as LRUCachePolicy
from aiokvo.manager.reuse import FilterReusedOffloadingManager as FilterReusedOffloadingManager
from aiokvo.memory.pinned import HostRegistration as HostRegistration
from aiokvo.memory.pinned import PinnedHostTensor as PinnedHostTensor
from aiokvo.memory.shared_region import SharedOffloadRegion as SharedOffloadRegion
from aiokvo.offloading_spec import CPUOffloadingSpec as CPUOffloadingSpec
from aiokvo.offloading_spec import OffloadingSpec as OffloadingSpec
from aiokvo.runtime.poller import EventPoller as EventPoller
from aiokvo.runtime.poller import PollerMode as PollerMode
from aiokvo.runtime.run import run as run
from aiokvo.specs import BlockIDsLoadStoreSpec as BlockIDsLoadStoreSpec
from aiokvo.specs import CPULoadStoreSpec as CPULoadStoreSpec
from aiokvo.specs import GPULoadStoreSpec as GPULoadStoreSpec
from aiokvo.specs import LoadStoreSpec as LoadStoreSpec
from aiokvo.specs import OffloadingEvent as OffloadingEvent
from aiokvo.specs import PrepareStoreOutput as PrepareStoreOutput
from aiokvo.specs import ReqContext as ReqContext
from aiokvo.specs import TransferResult as TransferResult
from aiokvo.specs import TransferSpec as TransferSpec
from aiokvo.specs import TransferType as TransferType

__version__: str
__all__: list[str]
