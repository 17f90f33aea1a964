"""Every exception aiokvo raises on purpose.

One base class, :class:`AiokvoError`, so callers can catch everything the
library raises deliberately. Subclasses also derive from the builtin that
best describes them (``ValueError``, ``KeyError``, ...) so that generic code
which already catches those keeps working.
"""

from __future__ import annotations

__all__ = [
    "AiokvoError",
    "BlockNotReadyError",
    "CapacityError",
    "ConfigError",
    "CudaError",
    "CudaUnavailableError",
    "DuplicateJobError",
    "DuplicateRouteError",
    "HandlerClosedError",
    "HandlerOwnedError",
    "InvalidKeyError",
    "InvalidSpecError",
    "LeaseError",
    "OffloaderClosedError",
    "PollerClosedError",
    "LayoutError",
    "SharedFileError",
    "SharedRegionError",
    "SharedRegionLayoutError",
    "SharedRegionTimeoutError",
    "SpecLoadError",
    "StaleReservationError",
    "SubscriptionClosed",
    "TierChecksumError",
    "TierError",
    "TierTimeoutError",
    "TierUnavailableError",
    "TransferError",
    "TraceFormatError",
    "TransferSpecError",
    "UnknownKeyError",
    "UnknownPolicyError",
    "UnknownRouteError",
    "UnsafeFileError",
    "UnsafeSharedRegionError",
]


class AiokvoError(Exception):
    """Base class of every error aiokvo raises deliberately."""


class ConfigError(AiokvoError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class UnknownPolicyError(ConfigError):
    """A cache policy name or module path that does not resolve to a policy."""


class TraceFormatError(AiokvoError, ValueError):
    """A request trace line that is not a Mooncake-format request (``aiokvo.lab``)."""


class SpecLoadError(ConfigError):
    """An offloading spec could not be registered, imported or constructed."""


class InvalidSpecError(AiokvoError, ValueError):
    """A ``LoadStoreSpec`` whose fields contradict each other."""


class InvalidKeyError(AiokvoError, ValueError):
    """Something that is not an ``OffloadKey`` (or a list of them) was passed as one.

    A key is ``bytes``: a block hash of at least one byte, then a 4-byte group
    index. A bare key where a list is expected is refused too: iterating it
    would yield ints.
    """


class StaleReservationError(AiokvoError, RuntimeError):
    """A store reservation that this manager no longer holds open was completed.

    Raised for a reservation completed a second time, or made by another
    manager. Nothing changes: in particular a newer reservation of the same
    keys (after a failed store was prepared again) is left alone.
    """


class UnknownKeyError(AiokvoError, KeyError):
    """A key the manager does not hold was used where a held key is required."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class BlockNotReadyError(AiokvoError):
    """A block was asked to be read while it is still being written."""


class CapacityError(AiokvoError):
    """A request that can never fit, whatever is evicted."""


class TransferError(AiokvoError):
    """A copy between media failed while it ran."""


class TransferSpecError(TransferError, ValueError):
    """A transfer was rejected before anything was enqueued (caller bug)."""


class UnknownRouteError(TransferSpecError):
    """No handler is registered for a ``(src_medium, dst_medium)`` pair."""


class DuplicateJobError(TransferSpecError):
    """A ``job_id`` was submitted while an earlier transfer with it is live."""


class CudaError(AiokvoError):
    """A CUDA runtime or driver call returned something other than success.

    ``name`` is the enum name (``"cudaErrorInvalidValue"``), ``code`` its
    integer value and ``call`` the API function that failed.
    """

    def __init__(self, call: str, name: str, code: int, detail: str = "") -> None:
        self.call = call
        self.name = name
        self.code = code
        self.detail = detail
        message = f"{call} failed: {name} ({code})"
        if detail:
            message = f"{message}: {detail}"
        super().__init__(message)

    def __reduce__(self) -> tuple[type[CudaError], tuple[str, str, int, str]]:
        return (type(self), (self.call, self.name, self.code, self.detail))


class CudaUnavailableError(AiokvoError, RuntimeError):
    """No CUDA driver or device is present, so a CUDA backend cannot start."""


class SubscriptionClosed(AiokvoError):
    """An event subscription was closed and everything it buffered was read."""


class LayoutError(ConfigError):
    """KV-cache tensors that cannot be viewed as ``(num_blocks, page_bytes)`` int8 rows."""


class DuplicateRouteError(ConfigError):
    """A ``(src_medium, dst_medium)`` route was registered with a worker twice."""


class HandlerOwnedError(ConfigError):
    """A handler already registered with one worker was registered with another.

    A registered handler reports its results to its worker's stream, so a
    second worker would silently take them away from the first.
    """


class HandlerClosedError(TransferSpecError):
    """A transfer was submitted to a handler or worker that is closing or closed."""


class OffloaderClosedError(AiokvoError, RuntimeError):
    """An :class:`~aiokvo.Offloader` call came after ``aclose()`` began."""


class LeaseError(AiokvoError, RuntimeError):
    """A :class:`~aiokvo.PrefixLease` was loaded after it was released, or loaded twice."""


class PollerClosedError(AiokvoError, RuntimeError):
    """The event poller closed while a completion it watched was still pending."""


class SharedFileError(AiokvoError):
    """A file that processes share (a region, its lock, a tier's index) cannot be used."""


class UnsafeFileError(SharedFileError):
    """A shared file or its directory could be reached or changed by someone else.

    It is a symbolic link, belongs to another uid, grants group or other
    permissions, has more than one name, or is not the kind of file expected.
    Nothing is opened through it, written to it or removed.
    """


class SharedRegionError(SharedFileError):
    """A shared offload region could not be created, attached, used or released."""


class SharedRegionTimeoutError(SharedRegionError, TimeoutError):
    """A rank gave up waiting for a peer to finish creating a shared region."""


class SharedRegionLayoutError(SharedRegionError, ValueError):
    """A shared region's layout does not fit the request (live owner disagrees, slice full)."""


class UnsafeSharedRegionError(SharedRegionError, UnsafeFileError):
    """A shared region's file, lock or directory is unsafe (see :class:`UnsafeFileError`)."""


class TierError(TransferError):
    """A tier transfer (CPU pool <-> disk, ...) failed while it ran."""


class TierChecksumError(TierError):
    """A block read back from a tier does not match its checksum: it is a miss, never data."""


class TierTimeoutError(TierError, TimeoutError):
    """A tier transfer did not finish before its deadline (``io_timeout``)."""


class TierUnavailableError(TierError, ConnectionError):
    """A tier's backend cannot be reached or set up (a cluster's master is down, ...)."""
