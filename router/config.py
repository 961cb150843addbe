"""Configuration values: one dataclass per actor, each field's default and numeric range defined once, here.

The settings table (flags, environment variables, TOML, help) is generated from these dataclasses;
no other module repeats a default or a range. ``bounded(default, low, high)`` declares the range
(every number has an upper bound: a value no deployment means is refused, naming its flag); the
components' ``*_problems`` functions and the settings layer both check it through
``router.problems.range_problems``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from router.problems import bounded
from router.types import EngineGeneration, KeyFamily, QueryType, Role, ScorerPolicy

KVCM_DEFAULT_PORT = 6381
SEED_MAX = 2**63 - 1  # the largest scorer seed (a signed 64-bit integer, as a TOML file holds one)
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1  # gRPC sizes are signed 32-bit


@dataclass(frozen=True, slots=True)
class ChannelPoolConfig:
    max_channels: int = bounded(256, 0, 100_000, low_open=True)
    idle_expiry_s: float = bounded(60.0, 0, 86_400, low_open=True)
    keepalive_time_ms: int = bounded(30_000, 0, 3_600_000, low_open=True)
    keepalive_timeout_ms: int = bounded(10_000, 0, 600_000, low_open=True)
    max_message_bytes: int = bounded(16 * 1024 * 1024, 0, _GRPC_MAX_MESSAGE_BYTES, low_open=True)
    # Lease reports, returns, invalidations and cold opens waiting for the pool's task; two per lease.
    inbox_size: int = bounded(4096, 2, 1_000_000)
    # grpcio starts a thread per call on an idle channel, blocking its caller; starting those on a
    # starter thread frees the loop but costs a handoff that a CPU-bound process pays in GIL waits.
    start_off_loop: bool = False


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    # KVCM bootstrap targets: static list, file (one entry per line or comma-separated), DNS name.
    kvcm_bootstrap: str = ""
    kvcm_bootstrap_file: str = ""
    kvcm_bootstrap_dns: str = ""
    kvcm_port: int = bounded(KVCM_DEFAULT_PORT, 1, 65_535)
    # Workers: ip:http_port entries.
    workers: str = ""
    workers_file: str = ""
    workers_dns: str = ""
    # default http port for bare hosts and DNS answers; 0 = an explicit port is required
    worker_http_port: int = bounded(0, 0, 65_535)
    worker_grpc_port_offset: int = bounded(1, -65_535, 65_535)  # grpc port = http port + offset
    worker_status_port: int = bounded(0, 0, 65_535)  # 0 = the grpc port
    refresh_interval_s: float = bounded(5.0, 0, 86_400, low_open=True)  # each source (file, DNS) is re-read this often
    # an empty or failed source keeps its last good entries this long, then empty
    stale_after_s: float = bounded(60.0, 0, 604_800, low_open=True)
    # bounds one source refresh (a DNS lookup, a file read); over it = failed
    refresh_timeout_s: float = bounded(2.0, 0, 3600, low_open=True)
    # per source; a longer answer is a failed refresh (bounds per-worker maps)
    max_entries: int = bounded(10_000, 0, 1_000_000, low_open=True)


@dataclass(frozen=True, slots=True)
class LeaderConfig:
    refresh_interval_s: float = bounded(10.0, 0, 3600, low_open=True)
    max_staleness_s: float = bounded(30.0, 0, 86_400, low_open=True)
    lookup_timeout_s: float = bounded(0.5, 0, 60, low_open=True)  # bounds one round of concurrent GetClusterInfo calls
    # Failed lookups: the n-th consecutive failure waits initial × 2^(n-1) + uniform(0, jitter), capped at max.
    backoff_initial_s: float = bounded(0.05, 0, 3600, low_open=True)
    backoff_max_s: float = bounded(5.0, 0, 3600, low_open=True)
    backoff_jitter_s: float = bounded(0.05, 0, 60)
    # "no leader elected yet", and a lookup with no KVCM target known, are retried this soon (not failures, no backoff)
    no_leader_retry_s: float = bounded(0.2, 0, 60, low_open=True)
    # A leader a query found wrong (NotLeader, Unavailable, DeadlineExceeded) stays suspect this long: a
    # replica naming it, other than itself, does not win a lookup round while another answer may still
    # name someone else (a replica that has not yet seen the leader go). 0 trusts the first answer.
    invalidated_suspect_s: float = bounded(30.0, 0, 3600)


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    failure_threshold: int = bounded(5, 0, 1_000_000_000, low_open=True)  # consecutive failures that open the breaker
    # ... or a failure rate >= failure_rate over the last window_s (at least window_min_calls calls),
    # counted in window_buckets ring buckets (so memory is bounded whatever the call rate).
    window_s: float = bounded(10.0, 0, 3600, low_open=True)
    window_min_calls: int = bounded(20, 0, 1_000_000_000, low_open=True)
    failure_rate: float = bounded(0.5, 0, 1, low_open=True)
    window_buckets: int = bounded(10, 0, 1000, low_open=True)
    # OPEN lasts cooldown_s × 2^(re-opens since last closed) ...
    cooldown_s: float = bounded(1.0, 0, 3600, low_open=True)
    cooldown_max_s: float = bounded(30.0, 0, 86_400, low_open=True)  # ... capped here
    # a half-open trial never reported back counts as failed after this
    trial_timeout_s: float = bounded(5.0, 0, 600, low_open=True)
    # A query the request's own deadline cut off before KVCM had this long is not judged (neither a
    # failure nor a success, and the leader is kept): a tight budget says nothing about KVCM.
    slow_query_ms: float = bounded(10.0, 0, 60_000)
    # Failures of calls that were in flight together (a call that went out before the last failure
    # counted) add one to the consecutive run, not one each: one stall is one failure. The window's
    # rate still counts every call.
    overlapping_failures_count_once: bool = True


@dataclass(frozen=True, slots=True)
class ProberConfig:
    # One global probe budget for the process: RPCs in flight, and a token bucket (probes/s, burst).
    inflight_cap: int = bounded(64, 0, 100_000, low_open=True)
    rate_per_s: float = bounded(2000.0, 0, 1_000_000, low_open=True)
    rate_burst: int = bounded(64, 0, 1_000_000, low_open=True)
    fresh_ttl_s: float = bounded(0.05, 0, 3600)  # a status younger than this is used without an RPC
    # a last good status older than this: the worker is unknown for scoring
    max_status_age_s: float = bounded(3.0, 0, 86_400, low_open=True)
    probe_timeout_s: float = bounded(0.2, 0, 60, low_open=True)  # bounds a started RPC, whoever still waits for it
    eject_after_failures: int = bounded(3, 0, 1000, low_open=True)  # consecutive probe failures that eject a worker
    eject_base_s: float = bounded(30.0, 0, 86_400, low_open=True)  # the n-th ejection lasts base × n ...
    eject_max_s: float = bounded(300.0, 0, 604_800, low_open=True)  # ... capped here
    # Of the tracked workers, at once; at least one when two or more are tracked (0 = never eject).
    # More workers failing than that is a collective failure, not outliers: nobody is ejected.
    max_ejected_fraction: float = bounded(0.1, 0, 1)
    # status-cache entries (LRU) and, equally, probes pending at once
    max_tracked_workers: int = bounded(4096, 0, 1_000_000, low_open=True)
    engine_generation: EngineGeneration = EngineGeneration.K
    # Background health probes of discovered workers, so routability is known without probing on
    # the request path: every interval a pass over the fleet probes the workers not heard from for an
    # interval, taking only rate tokens already in the bucket and at most half of the background slots;
    # each step of a pass probes up to health_max_probes and the pass goes on as its probes land
    # (health_interval_s 0 = no background probes).
    health_interval_s: float = bounded(1.0, 0, 3600)
    health_max_probes: int = bounded(64, 0, 100_000, low_open=True)
    # Background refresh of the hot workers (candidates of a request within hot_window_s): each is
    # polled every refresh_interval_s, so requests find its status fresh and make no probe of their own.
    # Polls take only tokens beyond the share of the budget kept for requests' own probes, and at most
    # refresh_budget_share of the rate. Runs only while refresh_interval_s < fresh_ttl_s. The interval
    # leaves fresh_ttl_s a poll's round trip and the loop's lag to spare (10 ms of 50): polls are most
    # of the router's CPU when idle, so polling sooner than the status needs is paid for by requests.
    background_refresh: bool = True
    refresh_interval_s: float = bounded(0.04, 0, 60, low_open=True)
    hot_window_s: float = bounded(2.0, 0, 3600, low_open=True)
    refresh_budget_share: float = bounded(0.5, 0, 1, low_open=True)
    # A hot worker is polled only while a request read it within this many of its usual gaps between
    # reads (at least two refresh intervals, at most hot_window_s): polls stop soon after reads stop.
    refresh_idle_gaps: float = bounded(8.0, 0, 1000, low_open=True)
    # A round's polls are made one after another by one transport call (over gRPC: blocking calls on one
    # worker thread) instead of a task and an asynchronous call each: grpcio starts a thread of its own
    # for every call on an idle channel, which a blocking call does not, and the routing thread waits for
    # that thread to start.
    serial_refresh: bool = True


@dataclass(frozen=True, slots=True)
class ScorerConfig:
    policy: ScorerPolicy = ScorerPolicy.CACHE_AFFINITY
    prefill_queue_size_threshold: int = bounded(1024, 0, 10_000_000, low_open=True)
    p2p_hit_discount: float = bounded(0.2, 0, 1)
    max_extra_work_tokens: int = bounded(0, 0, 1_000_000_000)
    min_hit_rate: float = bounded(5.0, 0, 100)
    outstanding_uncached_tokens_threshold: int = bounded(0, 0, 1_000_000_000)
    hot_set_size: int = bounded(8, 0, 1024, low_open=True)
    cold_set_size: int = bounded(2, 0, 1024)
    seed: int = bounded(0, 0, SEED_MAX)  # seeds the RNG that breaks exact ties (after least-recently-selected)
    # selection ledger: workers with a last-selected time / pre-charge
    max_tracked_workers: int = bounded(4096, 0, 1_000_000, low_open=True)
    # Per worker; beyond it the oldest charge's time is forgotten, not its tokens: they clear only with
    # the next charge's time, so they stay counted a little longer (over, never under).
    max_pending_charges: int = bounded(256, 2, 100_000)
    # cost-aware only: the price of copying a prefix another candidate holds, per copied token (the
    # eviction it causes, in tokens of future prefill), and a request's fixed cost in tokens
    copy_cost_weight: float = bounded(2.0, 0, 100)
    request_cost_tokens: int = bounded(0, 0, 1_000_000)
    # cost-aware only: candidates within this many tokens of the cheapest are near-ties, spread by
    # the power of two choices (0 = off)
    near_tie_tokens: int = bounded(0, 0, 1_000_000)
    # cost-aware only: its cold set (in place of cold_set_size); a priced copy is taken only when it
    # pays, so looking wider for idle workers costs no extra copies
    cost_aware_cold_set_size: int = bounded(6, 0, 1024)


@dataclass(frozen=True, slots=True)
class ShadowConfig:
    # a record is forgotten this long after it was last recorded
    ttl_s: float = bounded(300.0, 0, 604_800, low_open=True)
    # Blocks held by all records together (LRU): the index's memory bound (docs/design.md §7 has the
    # bytes per block, most for prompts of one block).
    capacity_blocks: int = bounded(131_072, 0, 100_000_000, low_open=True)
    # records waiting to be applied; beyond it they are dropped (counted)
    inbox_size: int = bounded(1024, 0, 1_000_000, low_open=True)


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """What the deployment's engines and KVCM namespace look like."""

    roles: tuple[Role, ...] = (Role.PREFILL,)
    block_size: int = bounded(64, 0, 65_536, low_open=True)
    lookahead_tokens: int = bounded(0, 0, 65_536)
    key_family: KeyFamily = KeyFamily.RTP
    query_type: QueryType = QueryType.PREFIX_MATCH
    kvcm_instance_id: str = ""
    p2p_host_count: int = bounded(0, 0, 10_000)


class DeadlineSplit(enum.Enum):
    """How a cache source's waits share the request's time (router/policy/deadline_split.py)."""

    FIXED = "fixed"  # every wait ends at decide_at = deadline − reserve
    LEARNED = "learned"  # each wait leaves the later stages their estimated time


@dataclass(frozen=True, slots=True)
class RouterConfig:
    kvcm_fallback: bool = True
    max_in_flight: int = bounded(256, 0, 100_000, low_open=True)  # admission cap; beyond it: overloaded at once
    budget_cap_ms: float = bounded(50.0, 0, 600_000, low_open=True)
    reserve_fraction: float = bounded(0.1, 0, 1, high_open=True)
    reserve_min_ms: float = bounded(1.0, 0, 600_000)
    kvcm_query_timeout_ms: float = bounded(500.0, 0, 600_000, low_open=True)
    deadline_split: DeadlineSplit = DeadlineSplit.FIXED
    # The learned split's estimates: weight per new sample, mean absolute deviations added to the
    # mean (the quantile they aim at), samples each stage needs before the split uses it.
    split_estimate_weight: float = bounded(0.25, 0, 1, low_open=True)
    split_deviations: float = bounded(2.0, 0, 20)
    split_min_samples: int = bounded(8, 1, 100_000)
    # Weight the admission estimate's averages keep per new sample (router/admission.py).
    admission_decay: float = bounded(0.9, 0, 1, high_open=True)
    # The sidecar's admission, shrunk below one request at a time by late answers, keeps at least this
    # share of the time for routing (router/admission.py, InFlightLimit): lower sheds more under a storm
    # of calls it cannot serve in time, and takes longer to come back after one.
    admission_duty_floor: float = bounded(1 / 32, 0, 1, low_open=True)
    # How often the routing loop's lag is measured (a timer's lateness), in ms.
    lag_probe_interval_ms: float = bounded(10.0, 0, 10_000, low_open=True)
    # Once no request has come for this long and none is in flight, the lag is measured this often
    # instead, until the next request (which brings back lag_probe_interval_ms at once): an idle
    # router's probe was most of its CPU. 0, or not above lag_probe_interval_ms: never slower.
    lag_probe_idle_ms: float = bounded(250.0, 0, 60_000)
    # Route to workers known to be unreachable rather than answer no_candidates (and stay ready); the
    # request's roles still hold unless no worker may serve them.
    route_blind: bool = False
    # A prompt KVCM says nobody holds, and the shadow index neither: score the cold set by load
    # (the less loaded of a few) instead of the domain's draw (docs/design.md §4 has the demo runs).
    score_unmatched: bool = True
    # Kept free before an absolute (caller's) deadline to send the answer back: the router decides
    # this much earlier than the deadline it was given, so the answer arrives in time.
    reply_margin_ms: float = bounded(1.0, 0, 60_000)
    # The decision log: every decision's inputs, framed, rotated; "" = off.
    decision_log: str = ""
    decision_log_max_bytes: int = bounded(64 * 1024 * 1024, 4096, 2**40)  # one file; then it rotates
    decision_log_files: int = bounded(4, 1, 1000)  # files kept (PATH, PATH.1, ...): the bound is their product
    decision_log_inbox_size: int = bounded(4096, 0, 1_000_000, low_open=True)  # beyond it: dropped, counted


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """The largest request the router takes; beyond a bound it is refused, naming the field and the bound."""

    max_prompt_tokens: int = bounded(262_144, 0, 16_777_216, low_open=True)  # token_ids, and seq_len
    max_block_keys: int = bounded(16_384, 0, 16_777_216, low_open=True)  # block_cache_keys
    max_roles: int = bounded(8, 0, 64, low_open=True)
    max_request_id_bytes: int = bounded(256, 0, 65_536, low_open=True)  # UTF-8
    # A longer prompt is hashed in slices of this many tokens, other requests running between two
    # slices and the request's deadline checked; a shorter one is hashed at once.
    hash_slice_tokens: int = bounded(2048, 0, 16_777_216, low_open=True)


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    inbox_size: int = bounded(4096, 0, 1_000_000, low_open=True)
    decision_ring_size: int = bounded(1024, 0, 1_000_000, low_open=True)
    # What one kept decision may hold: longer ids and errors are cut (with a marker), extra candidates dropped.
    decision_text_chars: int = bounded(256, 32, 65_536)
    decision_max_candidates: int = bounded(32, 0, 4096)
    # /debug/decisions stops adding decisions beyond this many bytes of JSON (and says it did).
    decisions_body_max_bytes: int = bounded(4 * 1024 * 1024, 4096, 1024 * 1024 * 1024)
    # Predicted vs reported hits (actors/hit_accuracy.py): predictions kept, how long, messages waiting.
    accuracy_pending_max: int = bounded(65_536, 0, 10_000_000, low_open=True)
    accuracy_ttl_s: float = bounded(60.0, 0, 86_400, low_open=True)
    accuracy_inbox_size: int = bounded(4096, 0, 1_000_000, low_open=True)
    # Readiness warns while more than this share of recent comparisons found no cached prefix (0 = off).
    accuracy_warn_silent_share: float = bounded(0.2, 0, 1)
    # comparisons averaged into kvroute_shadow_agreement_ratio
    shadow_agreement_window: int = bounded(1000, 0, 1_000_000, low_open=True)
    # One KVCM answer in this many is compared with the shadow index (the first is): a comparison
    # matches the prompt against the index on the request's path, and the ratio needs only a sample.
    shadow_compare_every: int = bounded(8, 1, 1_000_000)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """The process: listeners, logging, shutdown."""

    grpc_listen: str = "127.0.0.1:50051"
    debug_listen: str = "127.0.0.1:0"
    log_level: str = "INFO"
    log_format: str = "text"
    log_aggregate_interval_s: float = bounded(60.0, 0, 86_400, low_open=True)
    log_max_keys: int = bounded(1024, 0, 1_000_000, low_open=True)
    drain_timeout_s: float = bounded(5.0, 0, 3600)
    drain_lame_duck_s: float = bounded(0.5, 0, 3600)  # first part of the drain: new calls refused, nothing stopped yet
    # sidecar handler threads: the most Route calls being handled at once. Few: each thread answering a
    # shed competes with the routing thread for the GIL, and calls beyond them wait for one.
    grpc_max_workers: int = bounded(16, 0, 10_000, low_open=True)
    # the most Route calls gRPC holds at once, handled or waiting for a handler thread (more: refused
    # with RESOURCE_EXHAUSTED); at least grpc_max_workers. A waiting call holds no thread and at most
    # its own message, and is answered overloaded at once from a thread when its time left is short.
    grpc_max_concurrent_rpcs: int = bounded(1024, 0, 1_000_000, low_open=True)
    # Route calls that may wait on their handler threads for a place in the router when its in-flight
    # limit is reached (0, the default: such a call is answered overloaded at once); fewer than
    # grpc_max_workers.
    slot_waiters: int = bounded(0, 0, 10_000)
    # A Route call handed to the router after waiting for a handler thread more than this share of its
    # client's deadline counts as late for the learnt in-flight limit (1: only one that waited it all).
    crowded_wait_share: float = bounded(0.5, 0, 1, low_open=True)
    # Router processes sharing the gRPC port (SO_REUSEPORT); above 1 a supervising parent runs them.
    processes: int = bounded(1, 1, 64)
    # Bearer token every debug path but /healthz requires (empty: none); given directly or read from a file.
    debug_token: str = ""
    debug_token_file: str = ""


@dataclass(frozen=True, slots=True)
class GrpcTlsConfig:
    """TLS of the sidecar's gRPC server. No certificate: plaintext."""

    cert: str = ""  # PEM server certificate chain
    key: str = ""  # PEM private key of ``cert``
    client_ca: str = ""  # PEM CA bundle; set: clients must present a certificate it signed (mTLS)


@dataclass(frozen=True, slots=True)
class UpstreamTlsConfig:
    """TLS of kvroute's own connections (KVCM, workers, the master). Nothing set: plaintext."""

    ca: str = ""  # PEM CA bundle the servers' certificates are checked against (empty: the system's)
    cert: str = ""  # PEM client certificate chain presented to servers that ask for one
    key: str = ""  # PEM private key of ``cert``

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert)


# The scheduler's gRPC API listens on its HTTP port + this.
MASTER_GRPC_PORT_OFFSET = 2
# A scheduler host named without a port listens on this HTTP port.
MASTER_HTTP_PORT = 7001


class MasterProtocol(enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """The central scheduler ("master") client. No hosts: no master source (the chain starts at KVCM)."""

    hosts: str = ""  # the scheduler replicas' HTTP addresses, HOST[:PORT][,...] (port MASTER_HTTP_PORT by default)
    protocol: MasterProtocol = MasterProtocol.HTTP
    # Bounds one schedule attempt window (master, then the slave inside the same window); the request's
    # own deadline, less the time kept for the sources after the master, may cut it shorter.
    transport_timeout_ms: float = bounded(200.0, 0, 60_000, low_open=True)
    # Kept for the sources after the master (KVCM, shadow) when the master cannot answer.
    later_sources_ms: float = bounded(20.0, 0, 60_000)
    # With a slave known, the share of the attempt window the master's call leaves for one to the
    # slave. Off by default: a slave forwards a schedule call to the master, so a master that hangs
    # usually hangs the slave's try too, while a queueing master answering late in the window would
    # be cut short. For deployments whose slave routes by itself when the master stalls.
    slave_window_share: float = bounded(0.0, 0, 1, high_open=True)
    # Background discovery of master and slave through every host's master/info.
    discovery_interval_s: float = bounded(1.0, 0, 3600, low_open=True)
    discovery_timeout_s: float = bounded(0.5, 0, 600, low_open=True)  # bounds one poll of one host
    discovery_failure_threshold: int = bounded(2, 0, 1000, low_open=True)  # consecutive failed polls: unhealthy
    discovery_drop_after_s: float = bounded(30.0, 0, 86_400, low_open=True)  # unhealthy this long: forgotten
    # A known queue_length above this rejects requests up front (error 429); 0 = off. The reference
    # frontend's default, as the discovery settings above are its.
    queue_length_reject_threshold: int = bounded(100_000, 0, 1_000_000_000)
    # HTTP client pool (one client for all hosts): connections kept and their idle expiry (below common
    # server idle timeouts, so a pooled connection is not reused just as the server drops it).
    http_max_connections: int = bounded(64, 0, 10_000, low_open=True)
    http_keepalive_expiry_s: float = bounded(4.0, 0, 3600, low_open=True)


@dataclass(frozen=True, slots=True)
class KvrouteConfig:
    """The whole effective configuration."""

    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    leader: LeaderConfig = field(default_factory=LeaderConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    prober: ProberConfig = field(default_factory=ProberConfig)
    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    shadow: ShadowConfig = field(default_factory=ShadowConfig)
    channel_pool: ChannelPoolConfig = field(default_factory=ChannelPoolConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    master: MasterConfig = field(default_factory=MasterConfig)
    # The master is asked first by every request, so a hung one costs each its window until the breaker
    # opens, and an open one costs little (the KVCM path answers): every failure counts, for speed.
    master_breaker: BreakerConfig = field(default_factory=lambda: BreakerConfig(overlapping_failures_count_once=False))
    grpc_tls: GrpcTlsConfig = field(default_factory=GrpcTlsConfig)
    upstream_tls: UpstreamTlsConfig = field(default_factory=UpstreamTlsConfig)
