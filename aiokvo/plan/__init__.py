"""Pure copy planning: which bytes move where for one transfer, checked before anything moves.

No I/O and no asyncio: a plan is index math over tensor geometry
(:class:`RowSpace`). :class:`TransferPlanner` plans transfers between the KV
caches and an offload pool; handlers keep one and render each plan as
pointers (DMA) or row copies (host gathers).
"""

from aiokvo.plan.gpu import TransferPlanner
from aiokvo.plan.rows import Int64Array, RowSpace, TensorLike, compute_sub_block_ptrs
from aiokvo.plan.transfer import PointerPlan, RowCopy, TransferPlan

__all__ = [
    "Int64Array",
    "PointerPlan",
    "RowCopy",
    "RowSpace",
    "TensorLike",
    "TransferPlan",
    "TransferPlanner",
    "compute_sub_block_ptrs",
]
