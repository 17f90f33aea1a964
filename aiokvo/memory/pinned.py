"""Page-locked ("pinned") host memory for DMA and the copy kernel.

:class:`HostRegistration` pins memory someone else allocated (an mmap'd
shared region, a plain tensor) with ``cudaHostRegister``. It registers in
chunks of at most 64 GiB, because single registrations beyond that fail or
stall on some drivers; it is lazy (nothing happens until :meth:`register`),
idempotent, and undone by :meth:`unregister` or its context manager. Pages
are registered *portable* (usable from every context) and *mapped* (so the
copy kernel can read them), which also faults in and locks every page.

:class:`PinnedHostTensor` is the single-process pool: a CPU tensor that
owns its registration.
"""

from __future__ import annotations

import contextlib
import warnings
from types import TracebackType
from typing import TYPE_CHECKING, Self

from aiokvo._util import check_int
from aiokvo.errors import ConfigError, CudaError

if TYPE_CHECKING:
    import torch

    from aiokvo.device.driver import CudaDriver

__all__ = ["DEFAULT_MAX_CHUNK", "HostRegistration", "PinnedHostTensor"]

DEFAULT_MAX_CHUNK = 64 << 30
"""Largest single ``cudaHostRegister`` call (64 GiB)."""


class HostRegistration:
    """``cudaHostRegister`` of ``[ptr, ptr + nbytes)`` in chunks; see the module docstring.

    ``driver`` defaults to the real CUDA driver, loaded on :meth:`register`
    (so constructing one never needs a GPU).
    """

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        *,
        driver: CudaDriver | None = None,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> None:
        ptr = check_int("ptr", ptr, minimum=1)
        nbytes = check_int("nbytes", nbytes, minimum=1)
        max_chunk = check_int("max_chunk", max_chunk, minimum=1)
        self.ptr = ptr
        self.nbytes = nbytes
        self.max_chunk = max_chunk
        self._driver = driver
        self._registered: list[int] = []  # chunk base addresses, in order

    @property
    def chunks(self) -> list[tuple[int, int]]:
        """``(address, size)`` of each chunk a full registration makes."""
        end = self.ptr + self.nbytes
        return [
            (start, min(self.max_chunk, end - start))
            for start in range(self.ptr, end, self.max_chunk)
        ]

    @property
    def registered(self) -> bool:
        return bool(self._registered)

    def _get_driver(self) -> CudaDriver:
        if self._driver is None:
            from aiokvo.device.driver import load_driver

            self._driver = load_driver()
        return self._driver

    def register(self) -> None:
        """Pin every chunk; on failure, unpin what was pinned and re-raise. Idempotent."""
        if self._registered:
            return
        driver = self._get_driver()
        try:
            for start, size in self.chunks:
                driver.host_register(start, size)
                self._registered.append(start)
        except BaseException:
            with contextlib.suppress(CudaError):  # the registration error matters more
                self.unregister()
            raise

    def unregister(self) -> None:
        """Unpin every registered chunk (all are tried; the first error is raised)."""
        if not self._registered:
            return
        driver = self._get_driver()
        chunks, self._registered = self._registered, []
        first: CudaError | None = None
        for start in reversed(chunks):
            try:
                driver.host_unregister(start)
            except CudaError as exc:
                first = first or exc
        if first is not None:
            raise first

    def device_pointer(self, host_ptr: int) -> int:
        """The device-side address of ``host_ptr`` (equal to it under UVA)."""
        if not self.ptr <= host_ptr < self.ptr + self.nbytes:
            raise ConfigError(
                f"{host_ptr:#x} is outside the registration "
                f"[{self.ptr:#x}, {self.ptr + self.nbytes:#x})"
            )
        if not self._registered:
            raise ConfigError(f"registration at {self.ptr:#x} is not registered")
        return self._get_driver().host_device_pointer(host_ptr)

    def __enter__(self) -> Self:
        self.register()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.unregister()

    def __repr__(self) -> str:
        state = "registered" if self._registered else "unregistered"
        return f"<HostRegistration {self.ptr:#x}+{self.nbytes} {state}>"


class PinnedHostTensor:
    """A zeroed ``(num_rows, row_bytes)`` int8 CPU tensor pinned for its lifetime.

    The memory is an anonymous mmap, registered through
    :class:`HostRegistration` (rather than ``pin_memory=True``) so that a
    fake driver can stand in and huge pools register in chunks. An mmap of
    its own matters: ``cudaHostRegister`` pins whole pages, and two heap
    allocations sharing a page could not both be registered. Use as a
    context manager, or call :meth:`close`; the tensor must not be used
    for copies after that.
    """

    def __init__(
        self,
        num_rows: int,
        row_bytes: int,
        *,
        driver: CudaDriver | None = None,
        max_chunk: int = DEFAULT_MAX_CHUNK,
    ) -> None:
        import mmap

        import torch

        if num_rows <= 0 or row_bytes <= 0:
            raise ConfigError(
                "a pinned tensor needs num_rows > 0 and row_bytes > 0, "
                f"got {num_rows} x {row_bytes}"
            )
        nbytes = num_rows * row_bytes
        mapped = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        self._mmap = mmap.mmap(-1, mapped)  # anonymous: page-aligned and zero-filled
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": it is
            flat = torch.frombuffer(self._mmap, dtype=torch.int8)
        self.tensor: torch.Tensor = flat[:nbytes].view(num_rows, row_bytes)
        self.registration = HostRegistration(
            int(self.tensor.data_ptr()), mapped, driver=driver, max_chunk=max_chunk
        )
        self.registration.register()

    @property
    def closed(self) -> bool:
        return not self.registration.registered

    def close(self) -> None:
        """Unpin (idempotent). Only after every copy using the tensor has finished."""
        self.registration.unregister()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
