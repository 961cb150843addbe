"""Configuration of the central scheduler ("master") client: one frozen dataclass, its defaults and a
pure validator. Every default is defined here once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from router.config import BreakerConfig
from router.targets import TargetError, parse_target

# The scheduler's gRPC API listens on its HTTP port + this.
MASTER_GRPC_PORT_OFFSET = 2


class MasterProtocol(enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class MasterConfig:
    # The scheduler replicas' HTTP addresses (HOST:PORT). Empty: no master path (KVCM first).
    hosts: tuple[str, ...] = ()
    protocol: MasterProtocol = MasterProtocol.HTTP
    # Bounds one schedule attempt (master, and slave if tried); the request's own deadline may cut it shorter.
    transport_timeout_ms: float = 200.0
    # Background discovery of master and slave through every host's master/info.
    discovery_interval_s: float = 1.0
    discovery_timeout_s: float = 0.5  # bounds one poll of one host
    discovery_failure_threshold: int = 2  # consecutive failed polls that make a host unhealthy
    discovery_drop_after_s: float = 30.0  # an unhealthy host leaves the snapshot this long after its last success
    # Consecutive transport failures of the master open this breaker (the KVCM breaker's state machine).
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # A cached queue_length above this rejects requests up front (error 429); 0 = off.
    queue_length_reject_threshold: int = 0
    # HTTP client pool (one client for all hosts): connections kept and their idle expiry.
    http_max_connections: int = 64
    # Below common server idle timeouts (5 s), so a pooled connection is not reused just as the server drops it.
    http_keepalive_expiry_s: float = 4.0


def problems(config: MasterConfig) -> list[tuple[str, str]]:
    """Every problem of ``config`` as (field, message); empty when it is valid."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for entry in config.hosts:
        try:
            target = parse_target(entry)
        except TargetError as exc:
            found.append(("hosts", str(exc)))
            continue
        if target.port + MASTER_GRPC_PORT_OFFSET > 65535:
            found.append(("hosts", f"{entry!r}: port + {MASTER_GRPC_PORT_OFFSET} (the gRPC port) exceeds 65535"))
        if str(target) in seen:
            found.append(("hosts", f"{entry!r} is listed twice"))
        seen.add(str(target))
    positive = (
        ("transport_timeout_ms", config.transport_timeout_ms),
        ("discovery_interval_s", config.discovery_interval_s),
        ("discovery_timeout_s", config.discovery_timeout_s),
        ("discovery_drop_after_s", config.discovery_drop_after_s),
        ("http_keepalive_expiry_s", config.http_keepalive_expiry_s),
    )
    for name, value in positive:
        if not value > 0:
            found.append((name, f"must be > 0, got {value}"))
    if config.discovery_failure_threshold < 1:
        found.append(("discovery_failure_threshold", f"must be >= 1, got {config.discovery_failure_threshold}"))
    if config.queue_length_reject_threshold < 0:
        found.append(
            ("queue_length_reject_threshold", f"must be >= 0 (0 = off), got {config.queue_length_reject_threshold}")
        )
    if config.http_max_connections < 1:
        found.append(("http_max_connections", f"must be >= 1, got {config.http_max_connections}"))
    # The breaker's fields are checked by its own validator (actors.breaker.validate_breaker_config)
    # when the breaker is built; this layer cannot import actors.
    return found
