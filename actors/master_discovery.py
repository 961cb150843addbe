"""MasterDiscovery actor: which configured scheduler replica is the master, and which the slave.

``run`` polls every configured host's ``POST /rtp_llm/master/info`` concurrently, once per
``discovery_interval_s`` (each poll bounded by ``discovery_timeout_s``), and publishes an
immutable ``MasterDiscoverySnapshot``. Request paths read ``snapshot()`` synchronously and never
wait for discovery.

- A host is unhealthy after ``discovery_failure_threshold`` consecutive failed polls, healthy
  again after one success. An unhealthy host leaves the snapshot's host list once
  ``discovery_drop_after_s`` has passed since its last success (or since start); it is still
  polled, so it comes back when it answers.
- Master: the first healthy host, lowest IP first, whose address a healthy host reports as
  ``real_master_host``; else the previous master if it is not unhealthy; else the lowest-IP
  healthy host. Slave: the lowest-IP healthy host that is not the master. A master that fails
  requests between rounds is the master source's breaker's to handle, not a reason to poll sooner.

State is owned by ``run`` (its poll tasks write only their own host's record, between awaits);
the published snapshot is replaced, never mutated. Time is ``trio.current_time()``.
"""

from __future__ import annotations

import ipaddress
import logging
import math
from dataclasses import dataclass

import trio

from router.config import MasterConfig
from router.master_config import master_hosts, master_problems
from router.problems import refuse
from router.targets import HostPort, TargetError, parse_target
from router.transport.errors import TransportError
from router.transport.ports import MasterTransport
from router.wire.master import MasterInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MasterHostHealth:
    host: str  # as configured
    healthy: bool
    consecutive_failures: int
    last_success_at: float | None
    last_error: str | None
    last_error_at: float | None
    reported_master: str | None  # real_master_host of its last answer
    queue_length: int | None  # of its last answer


@dataclass(frozen=True, slots=True)
class MasterDiscoverySnapshot:
    hosts: tuple[MasterHostHealth, ...]  # configured hosts not dropped, lowest IP first
    master: str | None  # a configured host, or None when no master is known
    slave: str | None
    queue_length: int | None  # the master's last reported queue length
    last_error: str | None  # the latest failed poll, "host: error"
    rounds_total: int
    polls_failed_total: int
    master_changes_total: int
    version: int  # bumped on every publish


EMPTY_SNAPSHOT = MasterDiscoverySnapshot((), None, None, None, None, 0, 0, 0, 0)


def ip_order(host: str) -> tuple[int, int, str, int]:
    """Sort key: IPs numerically (v4 before v6), then names; then the port."""
    target = parse_target(host)
    try:
        ip = ipaddress.ip_address(target.host)
    except ValueError:
        return (9, 0, target.host, target.port)
    return (ip.version, int(ip), "", target.port)


def _same_address(a: HostPort, reported: str | None) -> bool:
    if not reported:
        return False
    try:
        return parse_target(reported) == a
    except TargetError:
        pass
    # The scheduler joins ip and port with a colon, brackets or not, so an IPv6 master reads as
    # "fd00::2:7001", which a target parser refuses as ambiguous: its last colon is the port's.
    host, _, port = reported.strip().rpartition(":")
    try:
        return ipaddress.ip_address(host.strip("[]")) == ipaddress.ip_address(a.host) and int(port) == a.port
    except ValueError:
        return False


def _names(host: _Host, reported: str | None) -> bool:
    """Whether ``reported`` (a replica's ``real_master_host``, ip:port) is ``host``: by the address we
    poll it at, or, for a host configured by name, by the ip it reports as its own at that port."""
    if _same_address(host.address, reported):
        return True
    info = host.info
    if info is None or not reported:
        return False
    own = {ip for ip in (info.pod_ip, info.instance_ip) if ip}
    return any(_same_address(HostPort(ip, host.address.port), reported) for ip in own)


class _Host:
    """One host's record, written by its poll task and read by ``_publish``."""

    __slots__ = (
        "address",
        "consecutive_failures",
        "host",
        "info",
        "last_error",
        "last_error_at",
        "last_success_at",
        "order",
    )

    def __init__(self, host: str) -> None:
        self.host = host
        self.address = parse_target(host)
        self.order = ip_order(host)
        self.consecutive_failures = 0
        self.last_success_at: float | None = None
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.info: MasterInfo | None = None


class MasterDiscovery:
    def __init__(self, config: MasterConfig, transport: MasterTransport) -> None:
        refuse("master", master_problems(config))
        self._config = config
        self._transport = transport
        self._hosts = sorted((_Host(h) for h in master_hosts(config)), key=lambda h: h.order)
        self._started_at = 0.0  # this incarnation's start: the rounds' grid
        # The first run's start: a host that never answered is listed until drop_after past it (not
        # past a restart's, which listed such hosts again for drop_after after every crash).
        self._first_started_at: float | None = None
        self._master: _Host | None = None
        self._master_told = False  # the first round's finding is logged, a master or none
        self._snapshot = EMPTY_SNAPSHOT
        self._rounds_total = 0
        self._polls_failed_total = 0
        self._master_changes_total = 0
        self._last_error: str | None = None

    # --- readers (synchronous, never wait) ------------------------------------------------

    def snapshot(self) -> MasterDiscoverySnapshot:
        return self._snapshot

    # --- the actor -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll rounds forever, one every ``discovery_interval_s`` from the start (a round that a hung
        host held to its timeout does not push the next ones later: sleeping the interval after each
        round made every host's period the interval plus the slowest poll, and a master's loss was seen
        that much later); ``started`` after the first round, so a master is known at start."""
        self._started_at = trio.current_time()
        if self._first_started_at is None:
            self._first_started_at = self._started_at
        await self._round()
        task_status.started()
        interval = self._config.discovery_interval_s
        point = 0  # the grid point of the round just made, counted: each round gets a later one
        while True:
            # The next grid point still ahead: a round longer than the interval skips the ones it overran.
            # Stepped on past ``now`` as well: a round that took no time ends on its own point, and the
            # division can come out a hair short of it, naming that point again (a second round at the
            # same instant; on a mock clock, rounds at one instant for ever).
            now = trio.current_time()
            point = max(point + 1, math.floor((now - self._started_at) / interval) + 1)
            while self._started_at + point * interval <= now:
                point += 1
            await trio.sleep_until(self._started_at + point * interval)
            await self._round()

    async def _round(self) -> None:
        async with trio.open_nursery() as nursery:
            for host in self._hosts:
                nursery.start_soon(self._poll, host)
        self._rounds_total += 1
        self._publish(trio.current_time())

    async def _poll(self, host: _Host) -> None:
        error: str | None = None
        with trio.move_on_after(self._config.discovery_timeout_s) as scope:
            try:
                info = await self._transport.master_info(host.host)
            except TransportError as exc:
                error = f"{exc.kind}: {exc.detail}"
        now = trio.current_time()
        if scope.cancelled_caught:
            error = f"timeout: no master/info answer within {self._config.discovery_timeout_s} s"
        if error is None:
            host.info = info
            host.consecutive_failures = 0
            host.last_success_at = now
            return
        host.consecutive_failures += 1
        host.last_error = error
        host.last_error_at = now
        self._polls_failed_total += 1
        self._last_error = f"{host.host}: {error}"

    def _healthy(self, host: _Host) -> bool:
        return host.last_success_at is not None and (
            host.consecutive_failures < self._config.discovery_failure_threshold
        )

    def _publish(self, now: float) -> None:
        healthy = [h for h in self._hosts if self._healthy(h)]
        # A host that names itself is the master by its own word; another's naming it may be stale
        # (a replica still naming the master before a failover), so it counts only when none does.
        master = next((h for h in healthy if h.info is not None and _names(h, h.info.real_master_host)), None)
        if master is None:
            named = {h.info.real_master_host for h in healthy if h.info is not None and h.info.real_master_host}
            master = next((h for h in healthy if any(_names(h, n) for n in named)), None)
        if master is None and self._master is not None and self._healthy(self._master):
            master = self._master
        if master is None and healthy:
            master = healthy[0]
        changed = master is not self._master
        if changed:
            self._master_changes_total += 1
        if changed or not self._master_told:
            # Logged on the change only (and the first round's finding, a master or none): requests
            # count their "no master" and failover answers, but say nothing of why (a round's errors;
            # the health of each host is on /debug/actors).
            self._master_told = True
            if master is None:
                log.warning("master discovery: no scheduler master known (%s)", self._last_error or "no host answered")
            elif self._master is None:
                log.info("master discovery: the scheduler master is %s", master.host)
            else:
                log.warning("master discovery: the scheduler master is now %s (was %s)", master.host, self._master.host)
        self._master = master
        slave = next((h for h in healthy if h is not master), None)
        listed = tuple(self._health(h) for h in self._hosts if self._listed(h, now))
        self._snapshot = MasterDiscoverySnapshot(
            hosts=listed,
            master=None if master is None else master.host,
            slave=None if slave is None else slave.host,
            queue_length=None if master is None or master.info is None else master.info.queue_length,
            last_error=self._last_error,
            rounds_total=self._rounds_total,
            polls_failed_total=self._polls_failed_total,
            master_changes_total=self._master_changes_total,
            version=self._snapshot.version + 1,
        )

    def _listed(self, host: _Host, now: float) -> bool:
        if self._healthy(host):
            return True
        since = host.last_success_at
        if since is None:
            since = self._started_at if self._first_started_at is None else self._first_started_at
        return now - since < self._config.discovery_drop_after_s

    def _health(self, host: _Host) -> MasterHostHealth:
        info = host.info
        return MasterHostHealth(
            host=host.host,
            healthy=self._healthy(host),
            consecutive_failures=host.consecutive_failures,
            last_success_at=host.last_success_at,
            last_error=host.last_error,
            last_error_at=host.last_error_at,
            reported_master=None if info is None else info.real_master_host,
            queue_length=None if info is None else info.queue_length,
        )

