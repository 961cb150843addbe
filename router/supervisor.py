"""The supervisor: the actor topology, wired in one place.

    frontend ─route()─▶ RouterActor (admission cap; the request runs in the caller's task)
                          │  chain:  MasterSource (with --master-hosts: MasterDiscovery, MasterTransport)
                          │            ──▶ KvcmSource ──▶ ShadowSource ──▶ DomainSource
                          │            │  │            │               └─ FleetView (Discovery snapshot)
                          │            │  └────────────┴─ CandidateScoring ─┬─ WorkerProber ─▶ RawRpc
                          │            │                                    └─ Scorer (owns the policy)
                          │            ├─ LeaderResolver (leader cache, single-flight lookups, KVCM breaker)
                          │            └─ KvcmClient ─▶ RawRpc (GrpcRawRpc over ChannelPool | MemoryNetwork)
                          ├─ ShadowIndexActor (write-on-route prefix index, read by ShadowSource)
                          ├─ HitAccuracy (predicted hits vs the prefixes workers report; fed by the prober)
                          └─ DecisionLog (with --decision-log: every decision's inputs, for kvroute replay)
    every actor ─emit()─▶ MetricsSink ─▶ prometheus registry ─▶ DebugServer (/metrics, /debug/*)

Long-lived actors run in the service nursery under ``_supervised``: a crash after start-up is
recorded (restarts, last error) and the actor is restarted with backoff, while the router keeps
answering with what remains (at worst domain fallback). A crash during start-up is fatal.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from actors.breaker import BreakerState
from actors.channel_pool import ChannelPool
from actors.decision_log import DecisionLog
from actors.discovery import Discovery, ListKind
from actors.hit_accuracy import HitAccuracy
from actors.leader_resolver import LeaderResolver, LeaderState
from actors.master_discovery import MasterDiscovery
from actors.metrics_sink import BREAKER_STATE_VALUES, BackgroundProbes, ChannelEvicted, MetricsSink
from actors.router_actor import RouterActor
from actors.scorer import SHED_CHARGE_ROOM, Scorer
from actors.shadow_index import ShadowIndexActor
from actors.sources.base import FleetView, Source
from actors.sources.companions import CompanionPicker
from actors.sources.domain import ROUTE_BLIND_HINT, DomainSource
from actors.sources.kvcm import KvcmSource
from actors.sources.master import MasterSource
from actors.sources.scoring import CandidateScoring
from actors.sources.shadow import ShadowSource
from actors.worker_prober import WorkerProber
from router.config import KvrouteConfig, MasterProtocol
from router.decision_record import FORMAT_VERSION
from router.exception_groups import leaves, sole_leaf
from router.logs import AggregatingLogger
from router.master_config import master_hosts
from router.policy.choice import make_policy, status_horizon_s
from router.problems import refuse
from router.settings import SECTIONS, LoadedConfig, section_problems, section_type_problems
from router.settings.redact import config_digest, non_default_settings
from router.targets import HostPort
from router.transport.clients import KvcmClient, WorkerStatusClient
from router.transport.grpc_adapter import GrpcRawRpc
from router.transport.master_grpc import GrpcMasterTransport
from router.transport.master_http import HttpMasterTransport
from router.transport.ports import MasterTransport, RawRpc
from router.transport.tls import channel_credentials, client_ssl_context
from router.types import PREFILL_CAPABLE_ROLES, RouteDecision, RouteRequest

log = logging.getLogger(__name__)
log_router = logging.getLogger("actors.router_actor")  # the chain's aggregated warnings keep the router's logger

RESTART_BACKOFF_INITIAL_S = 0.05
RESTART_BACKOFF_MAX_S = 5.0
RESTART_STABLE_S = 30.0  # an incarnation that lived this long resets the backoff

RunFn = Callable[..., Awaitable[None]]


@dataclass(slots=True)
class ActorRecord:
    """What the supervisor knows of one actor (for /debug/actors)."""

    name: str
    state: str = "starting"
    started_at: float = 0.0
    restarts: int = 0
    last_error: str | None = None
    last_error_at: float | None = None
    snapshot: Callable[[], object] | None = field(default=None, repr=False)
    inbox: Callable[[], Mapping[str, int]] | None = field(default=None, repr=False)
    nursery: trio.Nursery | None = field(default=None, repr=False)  # the running incarnation's

    def view(self, now: float) -> dict[str, object]:
        out: dict[str, object] = {
            "state": self.state,
            "uptime_s": round(now - self.started_at, 3) if self.state == "running" else 0.0,
            "restarts": self.restarts,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
            "last_error_age_s": None if self.last_error_at is None else round(now - self.last_error_at, 3),
        }
        if self.inbox is not None:
            out["inbox"] = dict(self.inbox())
        if self.snapshot is not None:
            out["health"] = self.snapshot()
        return out


class Supervisor:
    """Starts every actor in one service nursery and restarts crashed ones with backoff."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.records: dict[str, ActorRecord] = {}

    async def start(
        self,
        name: str,
        run: RunFn,
        *,
        snapshot: Callable[[], object] | None = None,
        inbox: Callable[[], Mapping[str, int]] | None = None,
    ) -> Any:
        record = ActorRecord(name, snapshot=snapshot, inbox=inbox)
        self.records[name] = record
        return await self._nursery.start(partial(self._supervised, record, run))

    async def _supervised(
        self, record: ActorRecord, run: RunFn, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED
    ) -> None:
        first: trio.TaskStatus[Any] | None = task_status
        backoff = RESTART_BACKOFF_INITIAL_S
        while True:
            crashed: BaseException | None = None
            started_at: float | None = None  # this incarnation's, once its start-up succeeded
            try:
                async with trio.open_nursery() as inner:
                    record.nursery = inner
                    value = await inner.start(run)
                    record.state = "running"
                    record.started_at = started_at = trio.current_time()
                    if first is not None:
                        first.started(value)
                        first = None
            except* Exception as group:
                if first is not None:
                    raise  # a failure during start-up is a configuration or environment error: fatal
                crashed = group
            record.nursery = None
            if crashed is None:
                record.state = "stopped"
                return
            # Only an incarnation that itself ran stably resets the backoff: one whose start-up failed
            # ran not at all, whatever an earlier one did (else a restart failing at start-up loops).
            if started_at is not None and trio.current_time() - started_at > RESTART_STABLE_S:
                backoff = RESTART_BACKOFF_INITIAL_S  # a fresh failure, not a crash loop
            record.restarts += 1
            record.state = "restarting"
            record.last_error = repr(leaves(crashed)[0])
            record.last_error_at = trio.current_time()
            log.error(
                "actor crashed; restarting actor=%s error=%s backoff_s=%.3f",
                record.name,
                record.last_error,
                backoff,
            )
            await trio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)

    def inject_crash(self, name: str) -> None:
        """Crash a running actor as a bug would (a test hook, for the chaos tests): the supervisor
        sees the failure, records it and restarts the actor with backoff."""
        record = self.records[name]
        if record.nursery is None:
            raise RuntimeError(f"actor {name!r} is not running (state {record.state})")
        record.nursery.start_soon(_crash, name)

    def views(self) -> dict[str, dict[str, object]]:
        now = trio.current_time()
        return {name: record.view(now) for name, record in self.records.items()}


class InjectedCrash(Exception):
    """Raised inside an actor's task tree by :meth:`Supervisor.inject_crash`."""


async def _crash(name: str) -> None:
    raise InjectedCrash(f"injected crash of actor {name!r}")


class RouterHandle:
    """What a frontend holds: ``await handle.route(request)``; plus operator views."""

    def __init__(
        self,
        *,
        router: RouterActor,
        supervisor: Supervisor,
        discovery: Discovery,
        resolver: LeaderResolver | None,
        prober: WorkerProber,
        metrics: MetricsSink,
        config: KvrouteConfig,
        loaded: LoadedConfig | None,
        pool: ChannelPool[Any] | None,
        accuracy: HitAccuracy | None = None,
    ) -> None:
        self._router = router
        self._supervisor = supervisor
        self._discovery = discovery
        self._resolver = resolver
        self._prober = prober
        self._metrics = metrics
        self._pool = pool
        self._accuracy = accuracy
        self.config = config
        self.loaded = loaded
        self.debug_address: HostPort | None = None
        self._draining: str | None = None  # why the process stops taking requests (its server drains)

    async def route(self, request: RouteRequest) -> RouteDecision:
        return await self._router.route(request)

    @property
    def metrics(self) -> MetricsSink:
        return self._metrics

    def discovery(self) -> Discovery:
        return self._discovery

    def leader_resolver(self) -> LeaderResolver | None:
        return self._resolver

    def prober(self) -> WorkerProber:
        return self._prober

    def router_actor(self) -> RouterActor:
        return self._router

    def hit_accuracy(self) -> HitAccuracy | None:
        """The predicted-vs-reported hit actor (None when the router was opened without it)."""
        return self._accuracy

    def actors_health(self) -> dict[str, dict[str, object]]:
        return self._supervisor.views()

    @property
    def supervisor(self) -> Supervisor:
        return self._supervisor

    # DebugSources
    def actors(self) -> Mapping[str, Mapping[str, object]]:
        return self.actors_health()

    def mark_draining(self, why: str) -> None:
        """The server in front of this router drains: from now on not ready, saying ``why``, on every
        readiness view (the debug endpoint's /readyz as well as the server's own health). The first
        reason stays: the router's close follows its server's drain."""
        if self._draining is None:
            self._draining = why

    def ready(self) -> tuple[bool, str]:
        """Routable (see :meth:`_routable`), unless a drain began; the reason carries a warning while
        predicted cache hits keep finding nothing on the engines (a key or namespace mismatch)."""
        if self._draining is not None:
            return False, self._draining
        ready, why = self._routable()
        warning = None if self._accuracy is None else self._accuracy.health().warning
        return ready, why if warning is None else f"{why}; warning: {warning}"

    def _routable(self) -> tuple[bool, str]:
        """Routable when discovery has workers, one of them of a routed prefill-capable role (a request's
        worker is one; a decode worker only rides along) can take a request (unless the operator routes
        blind), and, with the fallback on, a leader is known or the breaker is deliberately open (domain
        fallback then answers at once)."""
        workers = self._discovery.workers().workers
        if not workers:
            # With why, where a worker source says: its file, name or list failing since.
            failing = [  # each error names its source (its kind and origin) itself
                s.last_error
                for s in self._discovery.snapshot().sources
                if s.name.startswith(f"{ListKind.WORKERS.value}.") and s.last_error
            ]
            return False, "discovery has no worker" + (f" ({'; '.join(failing)})" if failing else "")
        if not self.config.router.route_blind:
            roles = tuple(r for r in self.config.deployment.roles if r in PREFILL_CAPABLE_ROLES)
            unroutable = self._prober.unroutable_reason(workers, roles)
            if unroutable is not None:
                return False, f"{unroutable}; {ROUTE_BLIND_HINT}"
        if self._resolver is None:
            return True, "domain routing (KVCM fallback off)"
        snap = self._resolver.snapshot()
        if snap.state is LeaderState.LEADER:
            return True, f"leader {snap.leader_target}"
        if snap.breaker.state is BreakerState.OPEN:
            return True, "KVCM breaker open: domain fallback answers"
        if snap.state in (LeaderState.BACKING_OFF, LeaderState.NO_LEADER, LeaderState.NO_BOOTSTRAP):
            # Leader waits fail fast in these states: every request gets domain fallback at once.
            return True, f"no KVCM leader ({snap.state.value}; last error {snap.last_error}): domain fallback answers"
        if snap.last_lookup_s is not None:
            # Looked up again (a failover): requests wait at most their window for it, then fall back.
            # Unready here, every router seeing the same failover would leave the fleet at once.
            return True, f"KVCM leader being looked up again (state {snap.state.value}): requests fall back meanwhile"
        return False, f"KVCM leader not resolved yet (state {snap.state.value})"


@asynccontextmanager
async def open_router(
    config: KvrouteConfig,
    *,
    rpc: RawRpc | None = None,
    master: MasterTransport | None = None,
    loaded: LoadedConfig | None = None,
    debug_http: bool = False,
) -> AsyncIterator[RouterHandle]:
    """Start the whole topology; yield a handle; on exit cancel the actors and close every channel.

    ``rpc`` None → real gRPC (ChannelPool + GrpcRawRpc); pass a MemoryNetwork for in-memory peers.
    ``master`` None → the scheduler transport ``--master-protocol`` names (when ``--master-hosts`` is
    set); pass a MemoryMasterNetwork for in-memory schedulers.
    A single failure (a start-up error such as a bad ``--workers`` entry, or the body's own
    exception, ``SystemExit`` and ``KeyboardInterrupt`` included) comes out as itself, not wrapped in
    an ExceptionGroup.
    """
    try:
        async with _topology(config, rpc=rpc, master=master, loaded=loaded, debug_http=debug_http) as handle:
            yield handle
    except BaseExceptionGroup as group:
        single = _single_exception(group)
        if single is None:
            raise
        raise single from None


def _single_exception(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one exception a (nested) group holds (a body's ``sys.exit()`` or KeyboardInterrupt too),
    or None. A lone ``trio.Cancelled`` stays in its group: it is the enclosing cancel scope's."""
    leaf = sole_leaf(group)
    return None if isinstance(leaf, trio.Cancelled) else leaf


@asynccontextmanager
async def _topology(
    config: KvrouteConfig,
    *,
    rpc: RawRpc | None,
    master: MasterTransport | None,
    loaded: LoadedConfig | None,
    debug_http: bool,
) -> AsyncIterator[RouterHandle]:
    # The sections no actor's constructor refuses (each actor refuses its own), before any actor is
    # built on them: a configuration built in code reaches here without the settings' validation (a NaN
    # budget cap answered every request internal_error; no request in flight failed on an inbox sized
    # from it).
    # The serve section: the warnings' logger, the close's wait, the debug endpoint's token. The upstream
    # TLS: a client certificate without its key aborted the process in grpc's core at the first channel.
    # Every section first of its declared types: the actors' own checks compare what they are given.
    for section in SECTIONS:
        refuse(section, section_type_problems(section, getattr(config, section)))
    for section in ("deployment", "router", "limits", "serve", "upstream_tls"):
        refuse(section, section_problems(section, getattr(config, section)))
    async with AsyncExitStack() as stack, trio.open_nursery() as services:
        supervisor = Supervisor(services)
        metrics = MetricsSink(config.metrics, split=config.router)
        await supervisor.start(
            "metrics_sink",
            metrics.run,
            snapshot=metrics.snapshot,
            inbox=lambda: {"depth": metrics.inbox_depth(), "capacity": config.metrics.inbox_size},
        )

        pool: ChannelPool[Any] | None = None
        if rpc is None:
            credentials = None
            if config.upstream_tls.enabled:  # reading the PEM files is I/O: off the trio thread
                credentials = await trio.to_thread.run_sync(channel_credentials, config.upstream_tls)
            pool = ChannelPool(config.channel_pool, credentials=credentials)
            # Closed however open_router ends, a failed start-up too (a debug port in use): the lookups
            # and probes begun meanwhile opened channels (aclose is idempotent; the stack exits last).
            stack.push_async_callback(_close_shielded, pool)
            pool.on_evict(lambda reason: metrics.emit(ChannelEvicted(reason.value)))
            await supervisor.start("channel_pool", pool.run, snapshot=pool.snapshot)
            rpc = GrpcRawRpc(pool, start_off_loop=config.channel_pool.start_off_loop)

        discovery = Discovery(config.discovery)
        await supervisor.start("discovery", discovery.run, snapshot=discovery.snapshot)

        resolver: LeaderResolver | None = None
        kvcm: KvcmClient | None = None
        if config.router.kvcm_fallback:
            kvcm = KvcmClient(rpc)
            resolver = LeaderResolver(
                config.leader,
                config.breaker,
                kvcm,
                discovery.kvcm_bootstrap,
                instance_id=config.deployment.kvcm_instance_id,
                inbox_size=2 * config.router.max_in_flight,  # an outcome and an invalidation per request at most
                metrics=metrics,
            )
            await supervisor.start("leader_resolver", resolver.run, snapshot=resolver.snapshot)

        prober = WorkerProber(
            config.prober,
            WorkerStatusClient(rpc, config.prober.engine_generation),
            fleet=lambda: discovery.workers().workers,  # the background health probes' subjects
            on_probes=lambda kind, n: metrics.emit(BackgroundProbes(kind.value, n)),
        )
        await supervisor.start("worker_prober", prober.run, snapshot=prober.snapshot)

        shadow = ShadowIndexActor(config.shadow)
        await supervisor.start("shadow_index", shadow.run, snapshot=shadow.health)

        scorer = Scorer(
            make_policy(config.scorer, config.deployment, status_horizon_s=status_horizon_s(config)),
            # A decision and a fallback record per request at most, and the room for sheds' charges.
            inbox_size=2 * config.router.max_in_flight + SHED_CHARGE_ROOM,
            max_warned_workers=config.scorer.max_tracked_workers,
            error_log_interval_s=config.serve.log_aggregate_interval_s,
            # A request routes for its budget at most: planned before a discovery change, it is decided
            # and charged by then.
            retain_settle_s=config.router.budget_cap_ms / 1000.0,
        )
        await supervisor.start("scorer", scorer.run, snapshot=scorer.health)

        # The chain of sources, in the order a request asks them; the domain source ends every chain.
        fleet = FleetView(discovery, prober, scorer)
        warn = AggregatingLogger(
            log_router, interval_s=config.serve.log_aggregate_interval_s, max_keys=config.serve.log_max_keys
        )
        domain = DomainSource(config, fleet=fleet, prober=prober, scorer=scorer)
        chain: list[Source] = []
        master_source: MasterSource | None = None
        hosts = master_hosts(config.master)
        if hosts:
            if master is None:
                tls = None
                if config.upstream_tls.enabled:  # reading the PEM files is I/O: off the trio thread
                    tls = await trio.to_thread.run_sync(client_ssl_context, config.upstream_tls)
                calls_at_once = config.router.max_in_flight + len(hosts)
                # Building the client loads and parses the CA bundle, TLS or not: off the trio thread,
                # where the actors started so far are already running.
                built = await trio.to_thread.run_sync(
                    partial(HttpMasterTransport, config.master, tls, calls_at_once=calls_at_once)
                )
                http = await stack.enter_async_context(built)
                grpc_wanted = config.master.protocol is MasterProtocol.GRPC
                if grpc_wanted and pool is None:
                    raise ValueError("--master-protocol grpc needs real gRPC channels (no in-memory network)")
                master = (
                    GrpcMasterTransport(pool, info=http, start_off_loop=config.channel_pool.start_off_loop)
                    if grpc_wanted and pool is not None
                    else http
                )
            master_discovery = MasterDiscovery(config.master, master)
            master_source = MasterSource(
                config,
                discovery=master_discovery,
                transport=master,
                domain=domain,
                metrics=metrics,
                later_sources=resolver is not None,
            )
            await supervisor.start("master_discovery", master_discovery.run, snapshot=master_discovery.snapshot)
            await supervisor.start("master_client", master_source.run, snapshot=master_source.health)
            chain.append(master_source)
        if resolver is not None and kvcm is not None:
            scoring = CandidateScoring(scorer=scorer, prober=prober, fleet=fleet, metrics=metrics)
            chain.append(
                KvcmSource(
                    config, resolver=resolver, kvcm=kvcm, scoring=scoring, shadow=shadow, metrics=metrics, warn=warn
                )
            )
            chain.append(ShadowSource(config, shadow=shadow, scoring=scoring, metrics=metrics, warn=warn))
        chain.append(domain)
        companions = CompanionPicker(config, fleet=fleet, prober=prober)
        decision_log: DecisionLog | None = None
        if config.router.decision_log:
            decision_log = DecisionLog(config.router, decision_log_header(config))
            await supervisor.start("decision_log", decision_log.run, snapshot=decision_log.health)
        accuracy = HitAccuracy(config.metrics, metrics)  # predicted hits against the statuses' prefixes
        await supervisor.start("hit_accuracy", accuracy.run, snapshot=accuracy.health)
        prober.on_status(lambda worker, status: accuracy.status_seen(worker.http_target, status))
        router = RouterActor(
            config,
            chain=chain,
            domain=domain,
            companions=companions,
            metrics=metrics,
            warn=warn,
            decision_log=decision_log,
            accuracy=accuracy,
        )
        await supervisor.start("router", router.run, snapshot=router.health)

        _register_gauges(
            metrics, resolver, prober, pool, router, shadow, master_source, scorer, accuracy, decision_log
        )
        handle = RouterHandle(
            router=router,
            supervisor=supervisor,
            discovery=discovery,
            resolver=resolver,
            prober=prober,
            metrics=metrics,
            config=config,
            loaded=loaded,
            pool=pool,
            accuracy=accuracy,
        )
        # An outage as a series to alert on: readiness was on the health endpoints alone.
        metrics.register_gauge_source("kvroute_ready", lambda: float(handle.ready()[0]))
        if debug_http:
            from router.debug_http import DebugServer  # upper module: imported only when serving HTTP
            from router.settings import given_in_code

            server = DebugServer(
                handle,
                metrics,
                loaded or given_in_code(config),  # built in code: the debug views show it as given
                config.serve.debug_listen,
                token=config.serve.debug_token,
                token_file=config.serve.debug_token_file,
            )
            handle.debug_address = await supervisor.start("debug_http", server.run)
        try:
            yield handle
        finally:
            # Requests still routing (from tasks outside the block) get their answers; new ones are
            # refused. They end by their deadlines; the drain's bound caps the wait all the same.
            router.close_to_new()
            # A server still in front of it (a task outside the block) must stop being sent requests.
            handle.mark_draining("the router is closed: its open_router block ended")
            with trio.CancelScope(shield=True), trio.move_on_after(config.serve.drain_timeout_s):
                await router.wait_idle()
            services.cancel_scope.cancel()
            if pool is not None:
                with trio.CancelScope(shield=True):
                    await pool.aclose()  # every channel closed, leased ones when their lease returns


async def _close_shielded(pool: ChannelPool[Any]) -> None:
    with trio.CancelScope(shield=True):
        await pool.aclose()  # every channel closed, leased ones when their lease returns


def decision_log_header(config: KvrouteConfig) -> dict[str, object]:
    """A decision log file's header: the format, the configuration (digest and non-default settings), the seed."""
    return {
        "v": FORMAT_VERSION,
        "digest": config_digest(config),
        "seed": config.scorer.seed,
        # The policy always, so a log replays with the policy it was recorded with whatever the default.
        "settings": non_default_settings(config) | {"scorer_policy": config.scorer.policy.value},
    }


def _register_gauges(
    metrics: MetricsSink,
    resolver: LeaderResolver | None,
    prober: WorkerProber,
    pool: ChannelPool[Any] | None,
    router: RouterActor,
    shadow: ShadowIndexActor,
    master: MasterSource | None,
    scorer: Scorer,
    accuracy: HitAccuracy,
    decision_log: DecisionLog | None,
) -> None:
    if master is not None:
        metrics.register_gauge_source(
            "kvroute_master_breaker_state", lambda: BREAKER_STATE_VALUES[master.breaker_state().value]
        )
        metrics.register_gauge_source("kvroute_master_queue_length", lambda: float(master.queue_length()))
    if resolver is not None:
        metrics.register_gauge_source(
            "kvroute_kvcm_breaker_state",
            lambda: BREAKER_STATE_VALUES[resolver.snapshot().breaker.state.value],
        )
    metrics.register_gauge_source("kvroute_probe_inflight", lambda: float(prober.snapshot().inflight))
    metrics.register_gauge_source("kvroute_workers_ejected", lambda: float(len(prober.snapshot().ejected_until)))
    if pool is not None:
        metrics.register_gauge_source("kvroute_channel_pool_channels", lambda: float(pool.snapshot().size))
    metrics.register_gauge_source("kvroute_inbox_depth", lambda: float(router.in_flight()), actor="router")
    metrics.register_gauge_source(
        "kvroute_inbox_depth", lambda: float(shadow.health().inbox_depth), actor="shadow_index"
    )
    if resolver is not None:
        metrics.register_gauge_source(
            "kvroute_inbox_depth", lambda: float(resolver.snapshot().inbox_depth), actor="leader_resolver"
        )
    if pool is not None:
        metrics.register_gauge_source(
            "kvroute_inbox_depth", lambda: float(pool.snapshot().inbox_depth), actor="channel_pool"
        )
    if master is not None:
        metrics.register_gauge_source(
            "kvroute_inbox_depth", lambda: float(master.health().inbox_depth), actor="master_client"
        )
    metrics.register_gauge_source("kvroute_inbox_depth", lambda: float(scorer.health().inbox_depth), actor="scorer")
    metrics.register_gauge_source(
        "kvroute_inbox_depth", lambda: float(prober.snapshot().inbox_depth), actor="worker_prober"
    )
    metrics.register_gauge_source(
        "kvroute_inbox_depth", lambda: float(accuracy.health().inbox_depth), actor="hit_accuracy"
    )
    if decision_log is not None:
        metrics.register_gauge_source(
            "kvroute_inbox_depth", lambda: float(decision_log.health().inbox_depth), actor="decision_log"
        )
