"""``MooncakeTierConfig``: a Mooncake tier's settings, validated once (pure data).

:class:`~aiokvo.tiers.mooncake.MooncakeTier` takes the same keywords and
builds one of these; :class:`~aiokvo.OffloadConfig` keeps them in ``tiers``
(``from_dict``'s ``"tiers": [{"kind": "mooncake", ...}]``), so an engine's
JSON config can ask for the cluster. The first group of fields is what
Mooncake's ``setup()`` takes; docs/tiers.md describes every knob.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiokvo._settings import check_seconds, settings_from_dict
from aiokvo._util import check_int, check_text
from aiokvo.errors import ConfigError

if TYPE_CHECKING:
    from aiokvo.tiers.base import Tier

__all__ = ["MooncakeTierConfig", "SetupSettings"]

_ADDRESS = re.compile(r"[^\s:]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}")
_PROTOCOL = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SetupSettings:
    """The arguments of ``MooncakeDistributedStore.setup()``, as this tier passes them."""

    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    rdma_devices: str
    master_server_addr: str
    enable_ssd_offload: bool
    ssd_offload_path: str
    tenant_id: str
    enable_client_http_server: bool
    client_http_port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MooncakeTierConfig:
    """Settings of one Mooncake tier (see docs/tiers.md, "Mooncake knobs").

    Connecting (Mooncake's ``setup()``): ``master_server_addr`` is the
    master's ``host:port``; ``metadata_server`` ``"P2PHANDSHAKE"`` (nothing to
    run), the master's ``http://host:port/metadata`` or an etcd/redis URL;
    ``local_hostname`` the address peers reach this process on (None: the
    local address the master is routed through); ``protocol`` ``"tcp"`` or
    ``"rdma"`` (with ``rdma_devices``); ``global_segment_size`` bytes of this
    process's memory lent to the cluster (0: a pure client, storage lives on
    other nodes); ``local_buffer_size`` Mooncake's staging buffer (the tier's
    zero-copy calls do not use it); ``tenant_id``, ``enable_ssd_offload``,
    ``ssd_offload_path``, ``enable_client_http_server``, ``client_http_port``
    as Mooncake documents them.

    Placement: ``replica_num`` copies of each block (on distinct segments),
    ``preferred_segment`` a segment name to place them on first.

    Naming: objects are ``key_prefix/<layout fingerprint>/<key>``;
    ``model_id`` and ``dtype`` (default: the engine tensors') are part of
    the fingerprint.

    Liveness: ``io_timeout`` seconds per transfer, ``lookup_timeout`` per
    lookup, ``setup_timeout`` per connection attempt; ``rpc_timeout``
    (default ``io_timeout``) and ``setup_retries`` are Mooncake's own RPC
    deadline and setup retry count (``MC_RPC_TIMEOUT_MS``,
    ``MC_STORE_CLIENT_SETUP_RETRIES``; a value already in the environment
    wins); ``failure_threshold`` failures in a row open the breaker for
    ``reset_after`` seconds, doubling up to ``max_reset_after`` while trials
    fail.

    Caching what it learnt: ``negative_ttl`` seconds a block whose get failed
    after the cluster said it exists is treated as absent; ``index_ttl``
    seconds a block seen in the cluster is not written again;
    ``max_tracked`` bounds the index, the negative cache and the admission
    counts. ``admit_after`` offers before a block is written;
    ``max_write_blocks`` CPU blocks pinned by writes in flight at most
    (default half the pool).

    Throughput: ``checksum_threads`` threads compute (before a put) and
    verify (after a get) a transfer's checksums together; with
    ``pipeline_bytes`` a larger transfer is split into batch calls of about
    that size, each overlapped with the next one's checksums (default None:
    one call per transfer, which measured best on a 2-core host;
    benchmarks/RESULTS.md). With ``row_trailers`` (default) the tier asks the
    Offloader for room after every CPU-pool row and keeps each block's trailer
    there, so a block of one canonical tensor goes out and in as one buffer
    (Mooncake's TCP transport pays per buffer); the room costs a row's stride
    rounded up to a page (rows of whole pages) or to 64 bytes, and the tier
    asks only where that is at most 1/64 of a row. False: trailers in a
    separate arena, one more buffer per block. The objects are the same
    bytes either way.
    """

    master_server_addr: str
    model_id: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str | None = None
    protocol: str = "tcp"
    rdma_devices: str = ""
    global_segment_size: int = 0
    local_buffer_size: int = 16 << 20
    tenant_id: str = "default"
    enable_ssd_offload: bool = False
    ssd_offload_path: str = ""
    enable_client_http_server: bool = False
    client_http_port: int = 9300
    replica_num: int = 1
    preferred_segment: str | None = None
    key_prefix: str = "aiokvo"
    dtype: str | None = None
    admit_after: int = 1
    io_timeout: float = 5.0
    lookup_timeout: float = 1.0
    setup_timeout: float = 30.0
    rpc_timeout: float | None = None
    setup_retries: int = 1
    failure_threshold: int = 3
    reset_after: float = 1.0
    max_reset_after: float = 30.0
    negative_ttl: float = 10.0
    index_ttl: float = 10.0
    max_tracked: int = 64_000
    max_write_blocks: int | None = None
    pipeline_bytes: int | None = None
    checksum_threads: int = 2
    row_trailers: bool = True

    kind = "mooncake"

    def __post_init__(self) -> None:
        address = self.master_server_addr
        if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
            raise ConfigError(f"master_server_addr must be 'host:port', got {address!r}")
        check_text("model_id", self.model_id, printable=True)
        check_text("metadata_server", self.metadata_server, printable=True)
        check_text("tenant_id", self.tenant_id, printable=True)
        for name in ("local_hostname", "dtype", "preferred_segment"):
            value = getattr(self, name)
            if value is not None:
                check_text(name, value, printable=True)
        if not isinstance(self.protocol, str) or not _PROTOCOL.fullmatch(self.protocol):
            raise ConfigError(
                f"protocol must be a Mooncake transport name ('tcp', 'rdma', ...), "
                f"got {self.protocol!r}"
            )
        for name in ("rdma_devices", "ssd_offload_path"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("enable_ssd_offload", "enable_client_http_server", "row_trailers"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        prefix = self.key_prefix
        if not isinstance(prefix, str) or not prefix or not prefix.isprintable() or (
            prefix.startswith("/") or prefix.endswith("/") or " " in prefix
        ):  # fmt: skip
            raise ConfigError(
                f"key_prefix must be a non-empty printable string without spaces or a "
                f"leading or trailing '/', got {prefix!r}"
            )
        for name, minimum, maximum in (
            ("global_segment_size", 0, None),
            ("local_buffer_size", 0, None),
            ("client_http_port", 1, 65535),
            ("replica_num", 1, 64),
            ("admit_after", 1, None),
            ("setup_retries", 1, 1000),
            ("failure_threshold", 1, None),
            ("max_tracked", 1, None),
            ("checksum_threads", 1, 64),
        ):
            value = check_int(name, getattr(self, name), minimum=minimum, maximum=maximum)
            object.__setattr__(self, name, value)
        for name in ("io_timeout", "lookup_timeout", "setup_timeout", "reset_after",
                     "max_reset_after", "negative_ttl", "index_ttl"):  # fmt: skip
            object.__setattr__(self, name, check_seconds(name, getattr(self, name)))
        if self.rpc_timeout is not None:
            object.__setattr__(self, "rpc_timeout", check_seconds("rpc_timeout", self.rpc_timeout))
        if self.max_reset_after < self.reset_after:
            raise ConfigError(
                f"max_reset_after={self.max_reset_after!r} is below "
                f"reset_after={self.reset_after!r}"
            )
        for name in ("max_write_blocks", "pipeline_bytes"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, check_int(name, value, minimum=1))

    @property
    def effective_rpc_timeout(self) -> float:
        """Mooncake's per-RPC deadline this tier asks for (``rpc_timeout`` or ``io_timeout``)."""
        return self.io_timeout if self.rpc_timeout is None else self.rpc_timeout

    def setup_settings(self, local_hostname: str) -> SetupSettings:
        """What ``setup()`` is called with, ``local_hostname`` resolved."""
        return SetupSettings(
            local_hostname=local_hostname,
            metadata_server=self.metadata_server,
            global_segment_size=self.global_segment_size,
            local_buffer_size=self.local_buffer_size,
            protocol=self.protocol,
            rdma_devices=self.rdma_devices,
            master_server_addr=self.master_server_addr,
            enable_ssd_offload=self.enable_ssd_offload,
            ssd_offload_path=self.ssd_offload_path,
            tenant_id=self.tenant_id,
            enable_client_http_server=self.enable_client_http_server,
            client_http_port=self.client_http_port,
        )

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any]) -> MooncakeTierConfig:
        """From a JSON-style mapping (``kind`` may be present); unknown keys are errors.

        Integers and seconds may be numeric strings, as in vLLM's extra config.
        """
        return settings_from_dict(
            cls, settings, "Mooncake tier", ints=_INT_FIELDS, seconds=_SECONDS_FIELDS
        )

    def build(self) -> Tier:
        """A :class:`~aiokvo.tiers.mooncake.MooncakeTier` with these settings."""
        from aiokvo.tiers.mooncake.tier import MooncakeTier

        return MooncakeTier.from_config(self)


_INT_FIELDS = (
    "global_segment_size", "local_buffer_size", "client_http_port", "replica_num",
    "admit_after", "setup_retries", "failure_threshold", "max_tracked", "max_write_blocks",
    "pipeline_bytes", "checksum_threads",
)  # fmt: skip
_SECONDS_FIELDS = (
    "io_timeout", "lookup_timeout", "setup_timeout", "rpc_timeout", "reset_after",
    "max_reset_after", "negative_ttl", "index_ttl",
)  # fmt: skip
