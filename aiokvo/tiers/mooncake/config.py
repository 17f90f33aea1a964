"""``MooncakeTierConfig``: a Mooncake tier's settings, validated once (pure data).

:class:`~aiokvo.tiers.mooncake.MooncakeTier` takes the same keywords and
builds one of these; :class:`~aiokvo.OffloadConfig` keeps them in ``tiers``
(``from_dict``'s ``"tiers": [{"kind": "mooncake", ...}]``), so an engine's
JSON config can ask for the cluster. The first group of fields is what
Mooncake's ``setup()`` takes; docs/tiers.md describes every knob.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from aiokvo._settings import check_seconds
from aiokvo._util import check_int, check_text
from aiokvo.errors import ConfigError
from aiokvo.tiers.settings import MAX_BYTES, TierSettings

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
class MooncakeTierConfig(TierSettings):
    """A Mooncake tier's settings: :class:`~aiokvo.tiers.settings.TierSettings` and its
    own (docs/tiers.md, "Mooncake knobs"). The first group is what Mooncake's
    ``setup()`` takes."""

    master_server_addr: str
    """The master's ``host:port``."""
    metadata_server: str = "P2PHANDSHAKE"
    """``"P2PHANDSHAKE"`` (nothing to run), the master's ``http://host:port/metadata``,
    or an etcd/redis URL."""
    local_hostname: str | None = None
    """The address peers reach this process on (None: the local address the master is
    routed through)."""
    protocol: str = "tcp"
    """``"tcp"`` or ``"rdma"`` (with ``rdma_devices``)."""
    rdma_devices: str = ""
    """RDMA devices, as Mooncake takes them."""
    global_segment_size: int = 0
    """Bytes of this process's memory lent to the cluster (0: a pure client)."""
    local_buffer_size: int = 16 << 20
    """Mooncake's staging buffer (the tier's zero-copy calls do not use it)."""
    tenant_id: str = "default"
    """Mooncake's tenant: clusters shared by deployments keep them apart by it."""
    enable_ssd_offload: bool = False
    """Mooncake's own SSD offload (as Mooncake documents it)."""
    ssd_offload_path: str = ""
    """Where Mooncake's SSD offload keeps its files."""
    enable_client_http_server: bool = False
    """Mooncake's client HTTP server."""
    client_http_port: int = 9300
    """Its port."""
    replica_num: int = 1
    """Copies of each block, on distinct segments."""
    preferred_segment: str | None = None
    """A segment to place them on first."""
    key_prefix: str = "aiokvo"
    """Objects are ``key_prefix/<layout fingerprint>/<key>``: deployments sharing a
    cluster keep apart by it."""
    io_timeout: float = 5.0
    lookup_timeout: float = 1.0
    """Seconds one lookup (``batch_is_exist``) may take."""
    setup_timeout: float = 30.0
    """Seconds one connection attempt may take."""
    rpc_timeout: float | None = None
    """Mooncake's own RPC deadline (``MC_RPC_TIMEOUT_MS``; None: ``io_timeout``; a value
    already in the environment wins)."""
    setup_retries: int = 1
    """Mooncake's setup retries (``MC_STORE_CLIENT_SETUP_RETRIES``)."""
    reset_after: float = 1.0
    max_reset_after: float = 30.0
    negative_ttl: float = 10.0
    """Seconds a block whose read failed after the cluster said it exists is taken
    as absent."""
    index_ttl: float = 10.0
    """Seconds a block seen in the cluster is not written again."""
    pipeline_bytes: int | None = None
    """Split a larger transfer into calls of about this size, each overlapped with the
    next one's checksums (None: one call per transfer, which measured best on a
    2-core host; benchmarks/RESULTS.md)."""
    checksum_threads: int = 2
    """Threads that compute (before a put) and verify (after a get) a transfer's
    checksums together."""
    integrity_key: str | None = field(default=None, repr=False)
    """Opt-in: a hex AES key (16, 24 or 32 bytes) shared by the deployment. Each block
    then carries a GMAC under it instead of a plain checksum, so a client of the
    cluster without the key cannot plant blocks (docs/tiers.md, "Trust"). Keep it out
    of logs and configs under version control."""
    row_trailers: bool = True
    """Keep each block's trailer in room after its CPU-pool row, so a one-tensor block
    is one buffer (Mooncake's TCP transport pays per buffer); asked for only where
    the room costs at most 1/64 of a row. False: a separate arena. The objects are
    the same bytes either way."""

    kind: ClassVar[str] = "mooncake"
    _ints: ClassVar[tuple[str, ...]] = (
        "global_segment_size", "local_buffer_size", "client_http_port", "replica_num",
        "setup_retries", "pipeline_bytes", "checksum_threads",
    )  # fmt: skip
    _seconds: ClassVar[tuple[str, ...]] = (
        "lookup_timeout", "setup_timeout", "rpc_timeout", "negative_ttl", "index_ttl",
    )  # fmt: skip

    def __post_init__(self) -> None:
        TierSettings.__post_init__(self)
        check_address("master_server_addr", self.master_server_addr)
        check_text("metadata_server", self.metadata_server, printable=True)
        if "://" in self.metadata_server:
            check_url_port("metadata_server", self.metadata_server)
        check_text("tenant_id", self.tenant_id, printable=True)
        for name in ("local_hostname", "preferred_segment"):
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
            ("global_segment_size", 0, MAX_BYTES),
            ("local_buffer_size", 0, MAX_BYTES),
            ("client_http_port", 1, 65535),
            ("replica_num", 1, 64),
            ("setup_retries", 1, 1000),
            ("checksum_threads", 1, 64),
        ):
            self._set(name, check_int(name, getattr(self, name), minimum=minimum,
                                      maximum=maximum))  # fmt: skip
        for name in ("lookup_timeout", "setup_timeout", "negative_ttl", "index_ttl"):
            self._set(name, check_seconds(name, getattr(self, name)))
        if self.rpc_timeout is not None:
            self._set("rpc_timeout", check_seconds("rpc_timeout", self.rpc_timeout))
        if self.integrity_key is not None:
            integrity_key_bytes(self.integrity_key)
        if self.pipeline_bytes is not None:
            self._set("pipeline_bytes",
                      check_int("pipeline_bytes", self.pipeline_bytes, minimum=1,
                                maximum=MAX_BYTES))  # fmt: skip

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



def integrity_key_bytes(value: object) -> bytes:
    """The AES key from its hex spelling: 16, 24 or 32 bytes (a ConfigError otherwise,
    naming the length, never the key)."""
    if not isinstance(value, str):
        raise ConfigError("integrity_key must be a hex string of 16, 24 or 32 bytes")
    try:
        key = bytes.fromhex(value)
    except ValueError:
        raise ConfigError("integrity_key must be hex (0-9, a-f)") from None
    if len(key) not in (16, 24, 32):
        raise ConfigError(f"integrity_key is {len(key)} bytes; AES takes 16, 24 or 32")
    return key


def check_address(name: str, address: object) -> str:
    """``address`` if it is ``host:port`` (or ``[v6]:port``) with a port in 1..65535."""
    if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
        raise ConfigError(f"{name} must be 'host:port', got {address!r}")
    port = int(address.rpartition(":")[2])
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name} has port {port}, outside 1..65535: got {address!r}")
    return address


def check_url_port(name: str, url: str) -> None:
    """A ConfigError if ``url`` names a port outside 1..65535."""
    from urllib.parse import urlsplit

    try:
        port = urlsplit(url).port
    except ValueError as exc:
        raise ConfigError(f"{name} has a bad port ({exc}): got {url!r}") from None
    if port == 0:
        raise ConfigError(f"{name} has port 0, outside 1..65535: got {url!r}")
