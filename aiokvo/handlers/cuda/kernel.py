"""The SM copy kernel: CUDA C, compiled at run time with NVRTC, once per device and arch.

DMA engines pay a fixed cost per copy, so for small pages (a few KiB)
a batched ``cudaMemcpy`` reaches only a fraction of the link's bandwidth.
This kernel instead lets thread blocks copy pages through *mapped* pinned
host memory: each block takes one descriptor ``(src, dst, nbytes)`` at a
time and its threads move 16-byte vectors, several loads in flight each,
with a byte loop for any unaligned head/tail. Pointers in the descriptor
table are device-visible addresses (host memory must be pinned and mapped;
under UVA those equal the host addresses), and the table itself lives in
mapped pinned host memory, read once per descriptor per block.
"""

from __future__ import annotations

import threading
import weakref

from aiokvo.device.driver import CudaDriver

__all__ = [
    "COPY_KERNEL_NAME",
    "COPY_KERNEL_SOURCE",
    "DESCRIPTOR_WORDS",
    "get_copy_kernel",
]

COPY_KERNEL_NAME = "aiokvo_copy_pages"
DESCRIPTOR_WORDS = 3
"""Each descriptor is three uint64 words: source address, destination address, bytes."""

COPY_KERNEL_SOURCE = r"""
extern "C" __global__ void aiokvo_copy_pages(const unsigned long long* __restrict__ table,
                                             unsigned long long count)
{
    __shared__ unsigned long long desc[3];
    const unsigned long long step = blockDim.x;
    for (unsigned long long i = blockIdx.x; i < count; i += gridDim.x) {
        if (threadIdx.x < 3) {
            desc[threadIdx.x] = table[3 * i + threadIdx.x];
        }
        __syncthreads();
        const unsigned long long src = desc[0];
        const unsigned long long dst = desc[1];
        const unsigned long long nbytes = desc[2];
        __syncthreads();  /* everyone has read desc before it is overwritten */

        unsigned long long head = 0;
        if (((src ^ dst) & 15ull) == 0) {
            /* Same alignment: bytes up to a 16-byte boundary, then vectors. */
            head = (16ull - (src & 15ull)) & 15ull;
            if (head > nbytes) {
                head = nbytes;
            }
            const uint4* __restrict__ vsrc = reinterpret_cast<const uint4*>(src + head);
            uint4* __restrict__ vdst = reinterpret_cast<uint4*>(dst + head);
            const unsigned long long nvec = (nbytes - head) >> 4;
            unsigned long long j = threadIdx.x;
            for (; j + 3 * step < nvec; j += 4 * step) {
                const uint4 a = vsrc[j];
                const uint4 b = vsrc[j + step];
                const uint4 c = vsrc[j + 2 * step];
                const uint4 d = vsrc[j + 3 * step];
                vdst[j] = a;
                vdst[j + step] = b;
                vdst[j + 2 * step] = c;
                vdst[j + 3 * step] = d;
            }
            for (; j < nvec; j += step) {
                vdst[j] = vsrc[j];
            }
            const unsigned long long tail = head + (nvec << 4);
            const char* bsrc = reinterpret_cast<const char*>(src);
            char* bdst = reinterpret_cast<char*>(dst);
            for (unsigned long long k = threadIdx.x; k < head; k += step) {
                bdst[k] = bsrc[k];
            }
            for (unsigned long long k = tail + threadIdx.x; k < nbytes; k += step) {
                bdst[k] = bsrc[k];
            }
        } else {
            const char* bsrc = reinterpret_cast<const char*>(src);
            char* bdst = reinterpret_cast<char*>(dst);
            for (unsigned long long k = threadIdx.x; k < nbytes; k += step) {
                bdst[k] = bsrc[k];
            }
        }
    }
}
"""

_cache: weakref.WeakKeyDictionary[CudaDriver, dict[str, object]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def get_copy_kernel(driver: CudaDriver) -> object:
    """The copy kernel for ``driver``'s device, compiled on first use and cached.

    Raises :class:`~aiokvo.errors.CudaError` if NVRTC is missing or the
    compile fails; a failed compile is not cached, so a later call retries.
    """
    arch = driver.device_arch()
    with _lock:
        per_driver = _cache.setdefault(driver, {})
        kernel = per_driver.get(arch)
        if kernel is None:
            kernel = driver.compile_kernel(COPY_KERNEL_SOURCE, COPY_KERNEL_NAME, arch)
            per_driver[arch] = kernel
    return kernel
