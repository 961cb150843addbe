"""Configuration values: one dataclass per actor, each field's default defined once, here.

The settings table (flags, environment variables, TOML, validation, help) is
generated from these dataclasses; no other module repeats a default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.types import EngineGeneration, KeyFamily, QueryType, Role

KVCM_DEFAULT_PORT = 6381


@dataclass(frozen=True, slots=True)
class ChannelPoolConfig:
    max_channels: int = 256
    idle_expiry_s: float = 60.0
    keepalive_time_ms: int = 30_000
    keepalive_timeout_ms: int = 10_000
    max_message_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    # KVCM bootstrap targets: static list, file (one entry per line or comma-separated), DNS name.
    kvcm_bootstrap: str = ""
    kvcm_bootstrap_file: str = ""
    kvcm_bootstrap_dns: str = ""
    kvcm_port: int = KVCM_DEFAULT_PORT
    # Workers: ip:http_port entries.
    workers: str = ""
    workers_file: str = ""
    workers_dns: str = ""
    worker_http_port: int = 0  # default http port for bare hosts and DNS answers; 0 = an explicit port is required
    worker_grpc_port_offset: int = 1  # grpc port = http port + offset
    worker_status_port: int = 0  # 0 = the grpc port
    refresh_interval_s: float = 5.0  # each source (file, DNS) is re-read this often
    stale_after_s: float = 60.0  # an empty or failed source keeps its last good entries this long, then empty
    refresh_timeout_s: float = 2.0  # bounds one source refresh (a DNS lookup, a file read); over it = failed
    max_entries: int = 10_000  # per source; a longer answer is a failed refresh (bounds per-worker maps)


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    refresh_interval_s: float = 10.0
    max_staleness_s: float = 30.0
    lookup_timeout_s: float = 0.5  # bounds one round of concurrent GetClusterInfo calls
    # Failed lookups: the n-th consecutive failure waits initial × 2^(n-1) + uniform(0, jitter), capped at max.
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    backoff_jitter_s: float = 0.05
    no_leader_retry_s: float = 0.2  # "no leader elected yet" is retried this soon (not a failure, no backoff)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = 5  # consecutive failures that open the breaker
    # ... or a failure rate >= failure_rate over the last window_s (at least window_min_calls calls),
    # counted in window_buckets ring buckets (so memory is bounded whatever the call rate).
    window_s: float = 10.0
    window_min_calls: int = 20
    failure_rate: float = 0.5
    window_buckets: int = 10
    cooldown_s: float = 1.0  # OPEN lasts cooldown_s × 2^(re-opens since last closed) ...
    cooldown_max_s: float = 30.0  # ... capped here
    trial_timeout_s: float = 5.0  # a half-open trial never reported back counts as failed after this
    # A query the request's own deadline cut off before KVCM had this long is not judged (neither a
    # failure nor a success, and the leader is kept): a tight budget says nothing about KVCM.
    slow_query_ms: float = 10.0


@dataclass(frozen=True, slots=True)
class ProberConfig:
    # One global probe budget for the process: RPCs in flight, and a token bucket (probes/s, burst).
    inflight_cap: int = 64
    rate_per_s: float = 2000.0
    rate_burst: int = 64
    fresh_ttl_s: float = 0.05  # a status younger than this is used without an RPC
    max_status_age_s: float = 3.0  # a last good status older than this: the worker is unknown for scoring
    probe_timeout_s: float = 0.2  # bounds a started RPC, whoever still waits for it
    eject_after_failures: int = 3  # consecutive probe failures that eject a worker
    eject_base_s: float = 30.0  # the n-th ejection lasts base × n ...
    eject_max_s: float = 300.0  # ... capped here
    max_ejected_fraction: float = 0.5  # of the tracked workers, at once
    max_tracked_workers: int = 4096  # status-cache entries (LRU) and, equally, probes pending at once
    engine_generation: EngineGeneration = EngineGeneration.K


@dataclass(frozen=True, slots=True)
class ScorerConfig:
    prefill_queue_size_threshold: int = 1024
    p2p_hit_discount: float = 0.2
    max_extra_work_tokens: int = 0
    min_hit_rate: float = 5.0
    outstanding_uncached_tokens_threshold: int = 0
    hot_set_size: int = 8
    cold_set_size: int = 2
    seed: int = 0  # seeds the RNG that breaks exact ties (after least-recently-selected)
    max_tracked_workers: int = 4096  # selection ledger: workers with a last-selected time / pre-charge
    max_pending_charges: int = 256  # per worker; beyond it the two oldest charges are merged


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    ttl_s: float = 300.0  # a record is forgotten this long after it was last recorded
    # Blocks held by all records together (LRU). Measured: ~50 bytes per block for 512-block
    # prompts, ~145 for 16-block ones, so at most ~19 MB at this default.
    capacity_blocks: int = 131_072
    inbox_size: int = 1024  # records waiting to be applied; beyond it they are dropped (counted)


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """What the deployment's engines and KVCM namespace look like."""

    roles: tuple[Role, ...] = (Role.PREFILL,)
    block_size: int = 64
    lookahead_tokens: int = 0
    key_family: KeyFamily = KeyFamily.RTP
    query_type: QueryType = QueryType.PREFIX_MATCH
    kvcm_instance_id: str = ""
    p2p_host_count: int = 0


@dataclass(frozen=True, slots=True)
class RouterConfig:
    kvcm_fallback: bool = True
    inbox_size: int = 1024
    budget_cap_ms: float = 50.0
    reserve_fraction: float = 0.1
    reserve_min_ms: float = 1.0
    kvcm_query_timeout_ms: float = 500.0


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    inbox_size: int = 4096
    decision_ring_size: int = 1024
    shadow_agreement_window: int = 1000  # comparisons averaged into kvroute_shadow_agreement_ratio


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The process: listeners, logging, shutdown."""

    grpc_listen: str = "127.0.0.1:50051"
    debug_listen: str = "127.0.0.1:0"
    log_level: str = "INFO"
    log_format: str = "text"
    log_aggregate_interval_s: float = 60.0
    log_max_keys: int = 1024
    drain_timeout_s: float = 5.0
    drain_lame_duck_s: float = 0.5  # first part of the drain: new calls refused, nothing stopped yet
    grpc_max_workers: int = 64  # sidecar handler threads; also the most Route calls in flight (more: refused)


@dataclass(frozen=True, slots=True)
class KvrouteConfig:
    """The whole effective configuration."""

    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    leader: LeaderConfig = field(default_factory=LeaderConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    prober: ProberConfig = field(default_factory=ProberConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    channel_pool: ChannelPoolConfig = field(default_factory=ChannelPoolConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
