"""MasterDiscovery under MockClock with the in-memory transport and SimMaster's replicas."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import pytest
import trio
import trio.testing

from actors.master_discovery import MasterDiscovery, MasterDiscoverySnapshot, ip_order
from kvroute_sim.sim.master import MasterFaults, SimMaster
from router.config import MasterConfig
from router.transport.master_memory import MemoryMasterNetwork
from router.wire import paths
from router.wire.master import MasterInfo


@pytest.fixture
def clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0)


@dataclass
class Setup:
    sim: SimMaster
    network: MemoryMasterNetwork
    discovery: MasterDiscovery
    hosts: tuple[str, ...]  # by replica index: 10.77.0.1, .2, .3 (already lowest IP first)


async def start(nursery: trio.Nursery, *, elected: int = 0, replicas: int = 3, **config: object) -> Setup:
    sim = SimMaster(replicas=replicas, elected=elected, queue_length=5)
    network = MemoryMasterNetwork()
    addresses = sim.serve_memory(network)
    # Listed out of IP order, to check the ordering is discovery's.
    discovery = MasterDiscovery(MasterConfig(hosts=",".join(reversed(addresses.hosts)), **config), network)  # type: ignore[arg-type]
    await nursery.start(discovery.run)
    return Setup(sim, network, discovery, addresses.hosts)


async def rounds(n: int) -> None:
    """Let ``n`` more discovery rounds run (default interval 1 s; polls answer at once in memory)."""
    await trio.sleep(n * 1.0)
    await trio.testing.wait_all_tasks_blocked()


async def test_the_elected_replica_is_master_and_the_lowest_other_is_slave(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    s = await start(nursery, elected=2)
    snap = s.discovery.snapshot()
    assert (snap.master, snap.slave, snap.queue_length) == (s.hosts[2], s.hosts[0], 5)
    assert [h.host for h in snap.hosts] == list(s.hosts)
    assert all(h.healthy and h.reported_master == s.hosts[2] for h in snap.hosts)
    s.sim.elect(1)
    s.sim.queue_length = 9
    await rounds(1)
    snap = s.discovery.snapshot()
    assert (snap.master, snap.slave, snap.queue_length) == (s.hosts[1], s.hosts[0], 9)
    assert snap.master_changes_total == 2


async def test_a_host_that_never_answered_is_not_healthy(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    """Down from the start, one failed poll is below the failure threshold, but nothing says it was
    ever up: it is neither master nor slave."""
    sim = SimMaster(replicas=3, elected=2, queue_length=5)
    network = MemoryMasterNetwork()
    hosts = sim.serve_memory(network).hosts
    network.stop(hosts[0])
    discovery = MasterDiscovery(MasterConfig(hosts=",".join(hosts)), network)
    await nursery.start(discovery.run)
    snap = discovery.snapshot()
    assert (snap.master, snap.slave) == (hosts[2], hosts[1])
    assert snap.hosts[0].consecutive_failures == 1 and not snap.hosts[0].healthy


async def test_polls_every_host_once_per_interval(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    s = await start(nursery)
    await rounds(3)
    for host in s.hosts:
        assert s.network.call_count(host, paths.MASTER_HTTP_INFO) == 4
    assert s.discovery.snapshot().rounds_total == 4


class _OncePerInstant(MemoryMasterNetwork):
    """Refuses (fails the run) a second poll of one host at one instant."""

    def __init__(self) -> None:
        super().__init__()
        self.polled: set[tuple[str, float]] = set()

    async def master_info(self, host: str) -> MasterInfo:
        at = (host, trio.current_time())
        assert at not in self.polled, f"{host} polled twice at t={at[1]!r}"
        self.polled.add(at)
        return await super().master_info(host)


@pytest.mark.parametrize("interval_s", [0.1, 1.0])
async def test_one_round_per_grid_point_whatever_the_start(
    clock: trio.testing.MockClock, nursery: trio.Nursery, interval_s: float
) -> None:
    """A round that takes no time ends on its own grid point, and the next point was computed from
    floor(elapsed / interval), which float rounding can leave one short: the same point again, a second
    round at the same instant, and on a mock clock rounds at that instant for ever (the run hung). A
    start off the grid's multiples, as after a restart, met it within the minute."""
    sim = SimMaster(replicas=2, elected=0, queue_length=5)
    network = _OncePerInstant()
    hosts = sim.serve_memory(network).hosts
    await trio.sleep(0.3)
    discovery = MasterDiscovery(MasterConfig(hosts=",".join(hosts), discovery_interval_s=interval_s), network)
    await nursery.start(discovery.run)
    await trio.sleep(60.5 * interval_s)
    assert discovery.snapshot().rounds_total == 61  # the first, at the start, and one per interval


async def test_unhealthy_after_two_failures_then_master_moves(
    clock: trio.testing.MockClock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    s = await start(nursery, elected=0)
    caplog.set_level(logging.INFO, logger="actors.master_discovery")
    s.network.stop(s.hosts[0])
    await rounds(1)
    snap = s.discovery.snapshot()
    assert snap.master == s.hosts[0]  # one failure: still healthy
    assert snap.hosts[0].consecutive_failures == 1 and snap.hosts[0].healthy
    await rounds(1)
    snap = s.discovery.snapshot()
    assert not snap.hosts[0].healthy and snap.hosts[0].last_error is not None
    assert "unavailable" in (snap.last_error or "")
    # The others still name replica 0, which is unhealthy: the lowest-IP healthy host takes over.
    assert (snap.master, snap.slave) == (s.hosts[1], s.hosts[2])
    # The operator is told once, on the change (requests only count their failovers).
    moved = [r.getMessage() for r in caplog.records if "master is now" in r.getMessage()]
    assert moved == [f"master discovery: the scheduler master is now {s.hosts[1]} (was {s.hosts[0]})"]


async def test_a_hanging_host_times_out(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    s = await start(nursery, elected=1)
    s.sim.set_faults(1, MasterFaults(hang=True))
    # Rounds at 1.0 and 2.0 s each end at the poll timeout (0.5 s); the next starts on the interval's
    # grid all the same, at 3.0 s: a hung host does not slow the polling of the others.
    await trio.sleep(3.2)
    snap = s.discovery.snapshot()
    assert snap.rounds_total == 3
    assert not snap.hosts[1].healthy
    assert "timeout" in (snap.hosts[1].last_error or "")
    assert snap.hosts[1].last_error_at == pytest.approx(2.5)
    assert (snap.master, snap.slave) == (s.hosts[0], s.hosts[2])
    # Every host polled at 0, 1, 2 and 3 s (once was every 1.5 s: the interval and the hung poll).
    assert s.network.call_count(s.hosts[0], paths.MASTER_HTTP_INFO) == 4


async def test_previous_master_kept_when_nobody_names_a_healthy_one(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    s = await start(nursery, elected=1)
    s.sim.elect(0)
    s.network.stop(s.hosts[0])  # the newly named master is down
    await rounds(2)
    snap = s.discovery.snapshot()
    assert snap.master == s.hosts[1]  # the previous master, still healthy, not the lowest IP
    assert snap.slave == s.hosts[2]


async def test_previous_master_kept_even_when_a_lower_ip_is_healthy(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    s = await start(nursery, elected=2)
    s.network.stop(s.hosts[0])
    await rounds(2)  # hosts[0] unhealthy
    s.sim.elect(0)  # the replicas now name the host that is down
    await rounds(2)
    snap = s.discovery.snapshot()
    assert snap.master == s.hosts[2]  # the previous master, still healthy; not hosts[1], the lowest
    assert snap.slave == s.hosts[1]


async def test_unhealthy_host_dropped_after_drop_after_then_back(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    s = await start(nursery, elected=0, discovery_drop_after_s=5.0)
    refused_at = trio.current_time()
    s.sim.set_faults(2, MasterFaults(refuse=True))
    await rounds(4)
    assert s.hosts[2] in [h.host for h in s.discovery.snapshot().hosts]
    await rounds(2)
    assert trio.current_time() - refused_at >= 5.0
    assert [h.host for h in s.discovery.snapshot().hosts] == list(s.hosts[:2])
    s.sim.clear_faults()
    await rounds(1)
    snap = s.discovery.snapshot()
    assert [h.host for h in snap.hosts] == list(s.hosts)
    assert snap.hosts[2].healthy


async def test_a_host_failing_late_is_listed_until_drop_after_its_last_success(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    s = await start(nursery, elected=0)  # discovery_drop_after_s 30 s by default
    await rounds(100)
    s.network.stop(s.hosts[2])  # last answered at 100 s
    await rounds(29)
    snap = s.discovery.snapshot()
    listed = {h.host: h for h in snap.hosts}
    assert s.hosts[2] in listed and not listed[s.hosts[2]].healthy
    await rounds(1)  # 130 s: drop_after since its last success, to the round
    assert [h.host for h in s.discovery.snapshot().hosts] == list(s.hosts[:2])


async def test_no_healthy_host_means_no_master(
    clock: trio.testing.MockClock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    s = await start(nursery, replicas=2)
    caplog.set_level(logging.INFO, logger="actors.master_discovery")
    for host in s.hosts:
        s.network.stop(host)
    await rounds(4)
    snap = s.discovery.snapshot()
    assert (snap.master, snap.slave, snap.queue_length) == (None, None, None)
    lost = [r for r in caplog.records if "no scheduler master known" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelno == logging.WARNING  # once, on the loss
    assert "unavailable" in lost[0].getMessage()  # with why: the round's last error


async def test_no_master_at_start_is_warned_once_and_finding_one_later_is_told(
    clock: trio.testing.MockClock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """With no host answering from the start, nothing changed (no master before, none after): the
    operator was never told the scheduler could not be found."""
    caplog.set_level(logging.INFO, logger="actors.master_discovery")
    sim = SimMaster(replicas=2)
    network = MemoryMasterNetwork()
    addresses = sim.serve_memory(network)
    for host in addresses.hosts:
        network.stop(host)
    discovery = MasterDiscovery(MasterConfig(hosts=",".join(addresses.hosts)), network)
    await nursery.start(discovery.run)
    await rounds(3)
    told = [r for r in caplog.records if r.name == "actors.master_discovery"]
    assert [(r.levelno, "no scheduler master known" in r.getMessage()) for r in told] == [(logging.WARNING, True)]
    sim.serve_memory(network)  # the replicas answer again; replica 0 is the elected one
    await rounds(1)
    messages = [r.getMessage() for r in caplog.records if r.name == "actors.master_discovery"]
    assert messages[1:] == [f"master discovery: the scheduler master is {addresses.hosts[0]}"]


async def test_garbled_info_counts_as_a_failure(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    s = await start(nursery, elected=0)
    s.sim.set_faults(0, MasterFaults(garbled=True))
    await rounds(2)
    snap = s.discovery.snapshot()
    assert not snap.hosts[0].healthy and "garbled" in (snap.hosts[0].last_error or "")
    assert snap.master == s.hosts[1]


async def test_a_reply_nested_past_the_json_parsers_limit_or_a_port_of_thousands_of_digits_is_a_failed_poll(
    clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Both used to raise out of the poll (RecursionError, and int()'s ValueError past 4,300 digits),
    killing discovery at every restart: the snapshot stayed on a dead master."""
    s = await start(nursery, elected=0)
    replies = {
        s.hosts[1]: b"[" * 3000,
        s.hosts[2]: b'{"success":true,"code":200,"real_master_host":"10.77.0.3:' + b"9" * 5000 + b'"}',
    }
    for host, reply in replies.items():
        real = s.network._handlers[host]

        async def answer(path: str, body: bytes, real: object = real, reply: bytes = reply) -> tuple[int, bytes]:
            if path == paths.MASTER_HTTP_INFO:
                return 200, reply
            return await real(path, body)  # type: ignore[operator, no-any-return]

        s.network.serve(host, answer)
    s.network.stop(s.hosts[0])  # the master dies: the one host whose reply is sane names nobody
    await rounds(5)
    snap = s.discovery.snapshot()
    health = {h.host: h for h in snap.hosts}
    assert not health[s.hosts[1]].healthy and "not JSON" in (health[s.hosts[1]].last_error or "")
    assert health[s.hosts[2]].healthy  # a master address it cannot read names no master; the host answered
    assert snap.master == s.hosts[2]


async def test_readers_never_wait(clock: trio.testing.MockClock, nursery: trio.Nursery) -> None:
    s = await start(nursery, elected=0)
    s.sim.set_faults(0, MasterFaults(hang=True))
    await trio.sleep(MasterConfig().discovery_interval_s)  # the next round starts and sticks on the hung host
    await trio.testing.wait_all_tasks_blocked()
    rounds_before = s.discovery.snapshot().rounds_total
    before = trio.current_time()
    snap = s.discovery.snapshot()
    assert (snap.master, snap.slave) == (s.hosts[0], s.hosts[1])
    assert trio.current_time() == before
    assert s.discovery.snapshot().rounds_total == rounds_before  # the round was still in flight


async def _discover(infos: dict[str, dict[str, object]], hosts: str | None = None) -> tuple[str | None, str | None]:
    """Master and slave after a few rounds, each host answering master/info with its ``infos`` entry."""
    snap = await _discovered(infos, hosts)
    return snap.master, snap.slave


async def _discovered(infos: dict[str, dict[str, object]], hosts: str | None = None) -> MasterDiscoverySnapshot:
    """The snapshot after a few rounds, each host answering master/info with its ``infos`` entry."""
    network = MemoryMasterNetwork()
    for host, info in infos.items():
        body = json.dumps({"success": True, "code": 200, "queue_length": 0, **info}).encode()

        async def answer(path: str, request: bytes, body: bytes = body) -> tuple[int, bytes]:
            return 200, body

        network.serve(host, answer)
    discovery = MasterDiscovery(MasterConfig(hosts=hosts or ",".join(infos)), network)
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)
        await rounds(3)
        snap = discovery.snapshot()
        nursery.cancel_scope.cancel()
    return snap


async def test_a_replica_still_naming_the_old_master_does_not_outweigh_the_one_naming_itself(
    clock: trio.testing.MockClock,
) -> None:
    """After a failover the lowest replica still names the old master (.2), while .2 and .3 agree
    that .3 is master: the host that names itself is the master by its own word."""
    a, b, c = "10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"
    infos: dict[str, dict[str, object]] = {
        a: {"real_master_host": b},
        b: {"real_master_host": c},
        c: {"real_master_host": c},
    }
    assert await _discover(infos) == (c, a)


async def test_the_queue_length_is_the_masters_own(clock: trio.testing.MockClock) -> None:
    a, b, c = "10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"
    infos: dict[str, dict[str, object]] = {
        a: {"real_master_host": b, "queue_length": 3},
        b: {"real_master_host": b, "queue_length": 7},
        c: {"real_master_host": b, "queue_length": 11},
    }
    snap = await _discovered(infos)
    assert (snap.master, snap.queue_length) == (b, 7)


async def test_an_ipv6_master_named_without_brackets_is_recognised(clock: trio.testing.MockClock) -> None:
    """The scheduler joins ip and port with a colon, so an IPv6 master reads as fd00::2:7001."""
    one, two = "[fd00::1]:7001", "[fd00::2]:7001"
    named: dict[str, object] = {"real_master_host": "fd00::2:7001"}
    infos: dict[str, dict[str, object]] = {one: named, two: named}
    assert await _discover(infos) == (two, one)


async def test_hosts_configured_by_name_are_matched_by_the_ip_each_reports_as_its_own(
    clock: trio.testing.MockClock,
) -> None:
    """The scheduler names the master by ip; a host we poll by name is matched by its own pod_ip."""
    a, b = "sched-a.example:7001", "sched-b.example:7001"
    infos: dict[str, dict[str, object]] = {
        a: {"real_master_host": "10.0.0.2:7001", "pod_ip": "10.0.0.1"},
        b: {"real_master_host": "10.0.0.2:7001", "pod_ip": "10.0.0.2"},
    }
    assert await _discover(infos) == (b, a)


def test_ip_order_is_numeric() -> None:
    hosts = ["10.0.0.10:7001", "10.0.0.2:7001", "10.0.0.2:7000", "[::1]:7001", "sched.local:7001"]
    assert sorted(hosts, key=ip_order) == [
        "10.0.0.2:7000",
        "10.0.0.2:7001",
        "10.0.0.10:7001",
        "[::1]:7001",
        "sched.local:7001",
    ]


def test_bad_config_is_rejected_naming_the_fields() -> None:
    with pytest.raises(ValueError, match="hosts") as caught:
        MasterDiscovery(MasterConfig(hosts="nope:x", discovery_timeout_s=0), MemoryMasterNetwork())
    assert "discovery_timeout_s" in str(caught.value)


async def test_a_host_that_never_answered_stays_dropped_across_a_restart(clock: trio.testing.MockClock) -> None:
    """A host down since the start is dropped drop_after past the first start, not past each restart's:
    every crash of discovery listed it again for drop_after."""
    sim = SimMaster(replicas=3, elected=2, queue_length=5)
    network = MemoryMasterNetwork()
    hosts = sim.serve_memory(network).hosts
    network.stop(hosts[0])
    discovery = MasterDiscovery(MasterConfig(hosts=",".join(hosts), discovery_drop_after_s=5.0), network)
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)
        await rounds(10)
        assert [h.host for h in discovery.snapshot().hosts] == list(hosts[1:])
        nursery.cancel_scope.cancel()  # the task stops (as between a crash and its restart)
    async with trio.open_nursery() as nursery:
        await nursery.start(discovery.run)  # restarted: its first round is published at once
        assert [h.host for h in discovery.snapshot().hosts] == list(hosts[1:])
        nursery.cancel_scope.cancel()
