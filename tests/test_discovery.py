"""Discovery: static lists, file and DNS sources, stale handling, and that nothing blocks the loop.

Static and DNS tests run under MockClock(autojump) with a trio HostnameResolver given to
Discovery standing in for the DNS server (in-trio, no threads). File tests and the real
"localhost" lookup do real I/O in worker threads, so they use the real clock with an
absolute ``trio.fail_after`` and wait on published changes, never on sleeps.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from actors import discovery
from actors.discovery import (
    FILE_BYTES_PER_ENTRY,
    MIN_LIST_FILE_BYTES,
    Discovery,
    DiscoveryConfigError,
    WorkerSnapshot,
    _file_signature_and_outcome,
    list_file_max_bytes,
)
from router.config import KVCM_DEFAULT_PORT, DiscoveryConfig
from router.types import WorkerAddr

CFG = DiscoveryConfig(refresh_interval_s=1.0, stale_after_s=5.0, refresh_timeout_s=0.5, worker_http_port=8080)


def http_targets(snapshot: WorkerSnapshot) -> list[str]:
    return [w.http_target for w in snapshot.workers]


# --- static lists -------------------------------------------------------------------------------


async def test_static_lists_honour_explicit_ports_and_default_bare_hosts() -> None:
    d = Discovery(
        dataclasses.replace(
            CFG,
            kvcm_bootstrap="10.0.0.1, 10.0.0.2:7000, [fd00::1]",
            workers="10.1.0.1:9000,10.1.0.2,[fd00::2]:9100",
        )
    )
    assert d.kvcm_bootstrap() == (
        f"10.0.0.1:{KVCM_DEFAULT_PORT}",
        "10.0.0.2:7000",
        f"[fd00::1]:{KVCM_DEFAULT_PORT}",
    )
    snap = d.workers()
    assert http_targets(snap) == ["10.1.0.1:9000", "10.1.0.2:8080", "[fd00::2]:9100"]
    assert snap.workers[0] == WorkerAddr("10.1.0.1", 9000, 9001, 9001)  # grpc = http + 1, status = grpc
    assert snap.by_http_target["[fd00::2]:9100"].grpc_target == "[fd00::2]:9101"
    assert snap.version == 1
    with pytest.raises(TypeError):
        snap.by_http_target["x"] = snap.workers[0]  # type: ignore[index]


async def test_port_overrides_per_deployment() -> None:
    d = Discovery(
        dataclasses.replace(CFG, workers="10.1.0.1:9000", worker_grpc_port_offset=10, worker_status_port=7777)
    )
    assert d.workers().workers == (WorkerAddr("10.1.0.1", 9000, 9010, 7777),)


async def test_bad_entries_are_all_named_at_once() -> None:
    bad = dataclasses.replace(
        CFG,
        worker_http_port=0,
        kvcm_bootstrap="10.0.0.1:6381,kvcm one:6381",
        workers="10.1.0.1:9000,10.1.0.2,10.1.0.3:99999,[fd00::1",
        refresh_interval_s=0.0,
    )
    with pytest.raises(DiscoveryConfigError) as info:
        Discovery(bad)
    message = str(info.value)
    for named in ("kvcm one", "10.1.0.2", "99999", "[fd00::1", "refresh_interval_s", "worker_http_port"):
        assert named in message, named
    assert "10.1.0.1:9000" not in message  # good entries are not blamed
    assert len(info.value.problems) == 3  # kvcm_bootstrap, workers, refresh_interval_s


async def test_worker_grpc_port_out_of_range_is_named() -> None:
    with pytest.raises(DiscoveryConfigError, match=r"10\.1\.0\.9:65535: grpc port 65536"):
        Discovery(dataclasses.replace(CFG, workers="10.1.0.1:9000,10.1.0.9:65535"))


@pytest.mark.parametrize("name", ["workers", "kvcm_bootstrap"])
async def test_a_list_of_separators_alone_is_refused(name: str) -> None:
    """Given, a list with no entry counted as a source set: check-config said the fallback's leader
    and the workers came from it, and routing then found no worker."""
    if name == "workers":
        given = dataclasses.replace(CFG, workers=" , ")
    else:
        given = dataclasses.replace(CFG, kvcm_bootstrap=" , ")
    with pytest.raises(DiscoveryConfigError) as info:
        Discovery(given)
    expected = [((name,), "names no entry, only separators (' , ')")]
    assert [(p.fields, p.message) for p in info.value.problems] == expected


async def test_a_dns_names_port_whose_grpc_port_is_out_of_range_is_named() -> None:
    """A DNS name's answers take its port, as a static entry does: it passed unchecked, and every
    refresh then failed with a warning naming the offset's field, not the flag."""
    with pytest.raises(DiscoveryConfigError, match=r"workers_dns: workers\.example:65535: grpc port 65536") as info:
        Discovery(dataclasses.replace(CFG, workers_dns="workers.example:65535"))
    assert [p.fields for p in info.value.problems] == [("workers_dns",)]
    Discovery(dataclasses.replace(CFG, workers_dns="workers.example:65534", worker_grpc_port_offset=1))


async def test_a_stale_timeout_shorter_than_the_refresh_interval_is_refused() -> None:
    """Every failed refresh would drop the source's entries at once, not keep its last good ones."""
    with pytest.raises(DiscoveryConfigError, match="stale timeout") as info:
        Discovery(dataclasses.replace(CFG, refresh_interval_s=10.0, stale_after_s=5.0))
    assert [p.fields for p in info.value.problems] == [("stale_after_s", "refresh_interval_s")]


async def test_a_setting_out_of_range_is_named_alone_not_the_lists_parsed_with_it() -> None:
    bad = dataclasses.replace(CFG, worker_http_port=70000, max_entries=0, workers="10.1.0.1", kvcm_bootstrap="10.0.0.1")
    with pytest.raises(DiscoveryConfigError) as info:
        Discovery(bad)
    assert sorted(p.fields for p in info.value.problems) == [("max_entries",), ("worker_http_port",)]


async def test_dns_name_without_port_needs_a_default() -> None:
    with pytest.raises(DiscoveryConfigError, match="workers_dns"):
        Discovery(dataclasses.replace(CFG, worker_http_port=0, workers_dns="workers.example"))
    Discovery(dataclasses.replace(CFG, worker_http_port=0, workers_dns="workers.example:9000"))


async def test_set_static_workers_replaces_and_validates(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    d = Discovery(dataclasses.replace(CFG, workers="10.1.0.1,10.1.0.2"))
    await nursery.start(d.run)
    generation = d.generation
    d.set_static_workers("10.1.0.3:9000")
    assert http_targets(d.workers()) == ["10.1.0.3:9000"]
    assert d.workers().version == 2
    assert await d.wait_for_change(generation) == generation + 1
    with pytest.raises(DiscoveryConfigError, match="bad_host!"):
        d.set_static_workers("10.1.0.4,bad_host!")
    assert http_targets(d.workers()) == ["10.1.0.3:9000"]  # a rejected list changes nothing


async def test_empty_refresh_keeps_last_snapshot_until_stale(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    d = Discovery(dataclasses.replace(CFG, workers="10.1.0.1,10.1.0.2"))
    await nursery.start(d.run)
    start = trio.current_time()
    before = d.workers()
    d.set_static_workers("")  # the source now answers empty
    assert d.workers() is before  # same snapshot: nothing published
    await trio.sleep_until(start + CFG.stale_after_s - 0.01)
    assert d.workers() is before
    with trio.fail_after(2 * CFG.stale_after_s):
        await d.wait_for_change(d.generation)
    # Dropped at the first refresh after stale_after_s (refreshes run every second).
    assert trio.current_time() - start == pytest.approx(CFG.stale_after_s + CFG.refresh_interval_s, abs=0.02)
    assert d.workers().workers == ()
    static = next(s for s in d.snapshot().sources if s.name == "workers.static")
    assert static.stale_expiries_total == 1
    assert static.empty_total >= 5


# --- DNS (a fake DNS server given as Discovery's resolver) -------------------------------------------


class FakeDns(trio.abc.HostnameResolver):
    """Only the DNS server is fake: Discovery's DNS sources ask it instead of the system's resolver."""

    def __init__(self) -> None:
        self.answers: dict[str, list[str]] = {}
        self.fail = False
        self.hang = False
        self.calls = 0

    async def getaddrinfo(  # type: ignore[override]
        self,
        host: bytes | None,
        port: bytes | str | int | None,
        family: int = 0,
        type: int = 0,
        proto: int = 0,
        flags: int = 0,
    ) -> list[
        tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int] | tuple[str, int, int, int]]
    ]:
        self.calls += 1
        if self.hang:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        assert host is not None and isinstance(port, int)
        out: list[
            tuple[
                socket.AddressFamily, socket.SocketKind, int, str, tuple[str, int] | tuple[str, int, int, int]
            ]
        ] = []
        for ip in self.answers.get(host.decode(), []):
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)))
        return out

    async def getnameinfo(
        self, sockaddr: tuple[str, int] | tuple[str, int, int, int], flags: int
    ) -> tuple[str, str]:
        raise NotImplementedError


@pytest.fixture
def fake_dns() -> FakeDns:
    return FakeDns()


async def test_dns_answers_with_default_and_explicit_ports(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, fake_dns: FakeDns
) -> None:
    fake_dns.answers["kvcm.example"] = ["10.0.0.2", "10.0.0.1", "10.0.0.1"]
    fake_dns.answers["workers.example"] = ["fd00::7", "10.1.0.1"]
    d = Discovery(
        dataclasses.replace(CFG, kvcm_bootstrap_dns="kvcm.example", workers_dns="workers.example:9000"),
        resolver=fake_dns,
    )
    await nursery.start(d.run)  # the first round completes before started()
    assert d.kvcm_bootstrap() == (f"10.0.0.1:{KVCM_DEFAULT_PORT}", f"10.0.0.2:{KVCM_DEFAULT_PORT}")
    assert http_targets(d.workers()) == ["10.1.0.1:9000", "[fd00::7]:9000"]

    generation = d.generation
    fake_dns.answers["workers.example"] = ["10.1.0.5"]
    with trio.fail_after(CFG.refresh_interval_s + 0.01):
        await d.wait_for_change(generation)
    assert http_targets(d.workers()) == ["10.1.0.5:9000"]


async def test_an_absolute_dns_name_is_looked_up_with_its_final_dot(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, fake_dns: FakeDns
) -> None:
    """The dot was dropped before the lookup: the resolver's search list applied to the name again (with
    Kubernetes' ndots of 5, the search domains first, and one with a wildcard record answered for it)."""
    fake_dns.answers["workers.example."] = ["10.1.0.1"]
    fake_dns.answers["workers.example"] = ["10.9.9.9"]  # what a search domain's wildcard would answer
    d = Discovery(dataclasses.replace(CFG, workers_dns="workers.example.:9000"), resolver=fake_dns)
    await nursery.start(d.run)
    assert http_targets(d.workers()) == ["10.1.0.1:9000"]


async def test_dns_failure_keeps_last_answer_until_stale(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, fake_dns: FakeDns
) -> None:
    fake_dns.answers["workers.example"] = ["10.1.0.1", "10.1.0.2"]
    d = Discovery(dataclasses.replace(CFG, workers_dns="workers.example"), resolver=fake_dns)
    await nursery.start(d.run)
    good_at = trio.current_time()
    assert len(d.workers().workers) == 2
    fake_dns.fail = True
    await trio.sleep_until(good_at + CFG.stale_after_s + 0.5)
    assert len(d.workers().workers) == 2  # failing for 5.5 s, but last good is not older than 5 s at 5.0
    with trio.fail_after(CFG.refresh_interval_s):
        await d.wait_for_change(d.generation)
    assert d.workers().workers == ()
    dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
    assert dns.stale_expiries_total == 1
    assert dns.failures_total == 6
    assert dns.last_error is not None and "workers.example" in dns.last_error

    fake_dns.fail = False  # recovers: picked up at the next refresh
    with trio.fail_after(CFG.refresh_interval_s + 0.01):
        await d.wait_for_change(d.generation)
    assert len(d.workers().workers) == 2


async def test_hanging_dns_times_out_and_never_stalls_readers(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, fake_dns: FakeDns
) -> None:
    fake_dns.hang = True
    d = Discovery(dataclasses.replace(CFG, workers="10.1.0.1", workers_dns="workers.example"), resolver=fake_dns)
    start = trio.current_time()
    await nursery.start(d.run)
    # The first round waited for the DNS source only up to refresh_timeout_s.
    assert trio.current_time() - start == pytest.approx(CFG.refresh_timeout_s)
    assert http_targets(d.workers()) == ["10.1.0.1:8080"]
    dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
    assert dns.failures_total == 1
    assert dns.last_error is not None and "refresh_timeout_s" in dns.last_error


async def test_dns_answer_over_max_entries_is_a_failed_refresh(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, fake_dns: FakeDns
) -> None:
    fake_dns.answers["workers.example"] = [f"10.1.0.{i}" for i in range(1, 6)]
    d = Discovery(dataclasses.replace(CFG, workers_dns="workers.example", max_entries=4), resolver=fake_dns)
    await nursery.start(d.run)
    assert d.workers().workers == ()
    dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
    assert dns.last_error is not None and "max_entries=4" in dns.last_error


async def test_an_empty_dns_answer_ends_the_error_and_its_return_is_warned_again(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    fake_dns: FakeDns,
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake_dns.fail = True
    with caplog.at_level(logging.INFO, logger="actors.discovery"):
        d = Discovery(dataclasses.replace(CFG, workers_dns="workers.example"), resolver=fake_dns)
        await nursery.start(d.run)
        dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
        assert dns.last_error is not None and "workers.example" in dns.last_error
        fake_dns.fail = False  # answers, with no address
        await trio.sleep(CFG.refresh_interval_s + 0.1)  # past the next refresh
        dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
        assert (dns.last_error, dns.empty_total, dns.failures_total) == (None, 1, 1)
        fake_dns.fail = True
        await trio.sleep(CFG.refresh_interval_s)
    messages = [(r.levelno, r.getMessage().partition(";")[0]) for r in caplog.records]
    lookup_failed = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")  # as FakeDns fails
    failed = f"discovery: workers.dns workers.example: {lookup_failed}"
    assert messages == [
        (logging.WARNING, failed),
        (logging.INFO, "discovery: workers.dns workers.example is readable again"),
        (logging.WARNING, failed),
    ]


async def test_a_lookup_that_never_answers_holds_one_thread_of_its_sources_own(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The system's resolver, for a name whose DNS server never answers: the lookup holds one worker
    thread of the source's own, never one of trio's shared ones, and a refresh that finds it still
    running fails at once rather than starting another (each took a shared thread until none was left)."""
    hung = "workers.hung.example"
    entered = threading.Event()
    released = threading.Event()
    lookups: list[str] = []
    system_lookup = socket.getaddrinfo

    def never_answers(host: str | bytes, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host  # trio's own lookups pass bytes
        flags = args[4] if len(args) > 4 else kwargs.get("flags", 0)
        if name != hung or flags & socket.AI_NUMERICHOST:  # a numeric-only lookup asks no server
            return system_lookup(host, *args, **kwargs)
        lookups.append(name)
        entered.set()
        released.wait(15.0)  # a regression is a failure, not a hang
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", never_answers)
    shared = trio.to_thread.current_default_thread_limiter()
    try:
        d = Discovery(dataclasses.replace(CFG, workers_dns=f"{hung}:9000"))
        await nursery.start(d.run)  # the first round's lookup is abandoned at refresh_timeout_s
        await trio.sleep(5 * CFG.refresh_interval_s + 0.1)  # five more refreshes
        dns = next(s for s in d.snapshot().sources if s.name == "workers.dns")
        assert dns.failures_total == 6
        assert dns.last_error == f"workers.dns {hung}:9000: an earlier lookup of the name has not answered yet"
        assert shared.borrowed_tokens == 0
        assert await trio.to_thread.run_sync(entered.wait, 8.0)
        assert lookups == [hung]  # one thread, however many refreshes
    finally:
        released.set()


async def test_real_dns_localhost() -> None:
    with trio.fail_after(10):
        d = Discovery(dataclasses.replace(CFG, workers_dns="localhost", kvcm_bootstrap_dns="localhost:7001"))
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            assert "127.0.0.1:7001" in d.kvcm_bootstrap()
            assert "127.0.0.1:8080" in http_targets(d.workers())
            assert all(t.startswith(("127.", "[::1]")) for t in http_targets(d.workers()))
            nursery.cancel_scope.cancel()


# --- files (real I/O in threads: real clock) ----------------------------------------------------------


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # atomic, new inode: the change is always visible


async def test_file_changes_are_picked_up(tmp_path: Path) -> None:
    workers = tmp_path / "workers.txt"
    kvcm = tmp_path / "kvcm.txt"
    write(workers, "# fleet\n10.1.0.1:9000\n10.1.0.2  # bare host: default port\n")
    write(kvcm, "10.0.0.1,10.0.0.2:7000\n")
    cfg = dataclasses.replace(
        CFG, refresh_interval_s=0.01, workers_file=str(workers), kvcm_bootstrap_file=str(kvcm)
    )
    with trio.fail_after(10):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            assert http_targets(d.workers()) == ["10.1.0.1:9000", "10.1.0.2:8080"]
            assert d.kvcm_bootstrap() == (f"10.0.0.1:{KVCM_DEFAULT_PORT}", "10.0.0.2:7000")

            generation = d.generation
            write(workers, "10.1.0.3:9000, 10.1.0.1:9000\n")
            await d.wait_for_change(generation)
            assert http_targets(d.workers()) == ["10.1.0.3:9000", "10.1.0.1:9000"]

            generation = d.generation
            write(kvcm, "10.0.0.9\n")
            await d.wait_for_change(generation)
            assert d.kvcm_bootstrap() == (f"10.0.0.9:{KVCM_DEFAULT_PORT}",)
            nursery.cancel_scope.cancel()


async def test_bad_file_keeps_last_good_until_stale_and_names_the_entry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="actors.discovery")
    workers = tmp_path / "workers.txt"
    write(workers, "10.1.0.1:9000\n")
    stale = 0.3
    cfg = dataclasses.replace(
        CFG, refresh_interval_s=0.01, stale_after_s=stale, worker_http_port=0, workers_file=str(workers)
    )
    with trio.fail_after(10):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            assert http_targets(d.workers()) == ["10.1.0.1:9000"]
            generation = d.generation
            written_at = trio.current_time()
            write(workers, "10.1.0.1:9000\n10.1.0.2\n")  # no port, and no default port
            await d.wait_for_change(generation)
            # The last good list was kept until it went stale (a lower bound: robust under load).
            assert trio.current_time() - written_at >= stale - cfg.refresh_interval_s
            assert d.workers().workers == ()
            source = next(s for s in d.snapshot().sources if s.name == "workers.file")
            assert source.stale_expiries_total == 1
            assert source.last_error is not None
            assert "10.1.0.2" in source.last_error and "worker_http_port" in source.last_error
            # The drop is said as it happens, with why: the list went empty silently.
            dropped = [r.getMessage() for r in caplog.records if "are dropped" in r.getMessage()]
            assert len(dropped) == 1 and dropped[0].count(str(workers)) == 1 and "10.1.0.2" in dropped[0], dropped

            generation = d.generation
            write(workers, "10.1.0.2:9000\n")
            await d.wait_for_change(generation)
            assert http_targets(d.workers()) == ["10.1.0.2:9000"]
            nursery.cancel_scope.cancel()


async def test_missing_file_is_a_failed_refresh_until_it_appears(tmp_path: Path) -> None:
    workers = tmp_path / "workers.txt"
    cfg = dataclasses.replace(CFG, refresh_interval_s=0.01, workers_file=str(workers))
    with trio.fail_after(10):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)  # the first round has run
            assert d.workers().workers == ()
            source = next(s for s in d.snapshot().sources if s.name == "workers.file")
            assert source.failures_total == 1
            assert source.last_error is not None and str(workers) in source.last_error
            generation = d.generation
            write(workers, "10.1.0.7\n")
            await d.wait_for_change(generation)
            assert http_targets(d.workers()) == ["10.1.0.7:8080"]
            nursery.cancel_scope.cancel()


async def test_an_unreadable_file_is_warned_once_per_new_error_and_its_recovery_noted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workers = tmp_path / "workers.txt"
    workers.mkdir()  # a directory where the list should be
    cfg = dataclasses.replace(CFG, refresh_interval_s=0.01, workers_file=str(workers))
    with trio.fail_after(10), caplog.at_level(logging.INFO, logger="actors.discovery"):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            # A few more rounds fail the same way (a failed round publishes nothing to wait on).
            while next(s for s in d.snapshot().sources if s.name == "workers.file").failures_total < 3:  # noqa: ASYNC110
                await trio.sleep(0.01)
            warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warned) == 1
            assert warned[0].startswith(f"discovery: workers.file {workers}: not a regular file")
            workers.rmdir()
            generation = d.generation
            write(workers, "10.1.0.7\n")
            await d.wait_for_change(generation)
            nursery.cancel_scope.cancel()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"discovery: workers.file {workers} is readable again"
    ]


async def test_an_empty_list_file_ends_the_error_and_its_return_is_warned_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    workers = tmp_path / "workers.txt"  # missing at first
    cfg = dataclasses.replace(CFG, refresh_interval_s=0.01, workers_file=str(workers))

    def health() -> discovery.SourceHealth:
        return next(s for s in d.snapshot().sources if s.name == "workers.file")

    with trio.fail_after(10), caplog.at_level(logging.INFO, logger="actors.discovery"):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            assert health().last_error is not None
            write(workers, "# no workers yet\n")
            # An empty read publishes nothing to wait on.
            while health().empty_total == 0:  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert health().last_error is None
            failures = health().failures_total
            workers.unlink()
            while health().failures_total == failures:  # noqa: ASYNC110
                await trio.sleep(0.01)
            assert health().last_error is not None
            nursery.cancel_scope.cancel()
    missing = f"discovery: workers.file {workers}: No such file or directory"
    assert [(r.levelno, r.getMessage().partition(";")[0]) for r in caplog.records] == [
        (logging.WARNING, missing),
        (logging.INFO, f"discovery: workers.file {workers} is readable again"),
        (logging.WARNING, missing),
    ]


def test_a_list_file_larger_than_its_entries_can_be_is_refused_unread(tmp_path: Path) -> None:
    big = tmp_path / "workers.txt"
    big.write_text("10.1.0.1:9000\n" * 1000)
    cfg = dataclasses.replace(CFG, workers_file=str(big), max_entries=4_000)
    assert list_file_max_bytes(cfg) == 4_000 * FILE_BYTES_PER_ENTRY
    _signature, outcome = _file_signature_and_outcome(str(big), None, lambda text: (), 1024, "workers.file x")
    assert outcome == "workers.file x: larger than 1024 bytes: not a list"
    # A small max_entries still leaves a commented list room.
    assert list_file_max_bytes(dataclasses.replace(CFG, max_entries=2)) == MIN_LIST_FILE_BYTES


async def test_a_blocked_file_read_never_blocks_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """review-lessons §1: a read stuck in the kernel (a slow or hung file system) runs off the loop
    thread. The read is held here by an event the test sets at its end.

    An observer task waits until every task is blocked (the loop is idle while the first
    round's read is pending) and runs before that round ends at refresh_timeout_s. Were the
    read on the loop thread, the loop would never be idle before the round's end (the read
    released), and the observer would run only after it.
    """
    path = tmp_path / "workers.txt"
    write(path, "10.1.0.2:9000\n")
    released = threading.Event()
    read_file = discovery._file_signature_and_outcome

    def stuck(*args: Any) -> Any:
        released.wait(8.0)  # a regression is a failure, not a hang
        return read_file(*args)

    monkeypatch.setattr(discovery, "_file_signature_and_outcome", stuck)
    timeout = 3.0  # the window in which the idle loop must be noticed (room for a stalled busy machine)
    try:
        cfg = dataclasses.replace(CFG, workers="10.1.0.1:9000", workers_file=str(path), refresh_timeout_s=timeout)
        with trio.fail_after(20):
            d = Discovery(cfg)
            observed: list[tuple[float, list[str]]] = []

            async def observer() -> None:
                await trio.testing.wait_all_tasks_blocked()  # d.run's file refresh waits on its thread
                observed.append((trio.current_time(), http_targets(d.workers())))

            async with trio.open_nursery() as nursery:
                start = trio.current_time()
                nursery.start_soon(observer)
                await nursery.start(d.run)  # the first round waits for the read up to refresh_timeout_s
                round_done = trio.current_time()  # no checkpoint since start() returned
                assert round_done - start >= timeout
                assert len(observed) == 1  # it ran while the read was stuck, before the round ended
                observed_at, targets = observed[0]
                assert targets == ["10.1.0.1:9000"]
                assert observed_at < round_done
                source = next(s for s in d.snapshot().sources if s.name == "workers.file")
                assert source.failures_total == 1
                assert source.last_error is not None and "refresh_timeout_s" in source.last_error
                nursery.cancel_scope.cancel()
    finally:
        released.set()


async def test_a_fifo_at_a_list_files_path_is_refused_without_holding_the_read_and_then_replaced(
    tmp_path: Path,
) -> None:
    """Opened to be read, a FIFO with no writer held the source's one read slot for good: the file
    replaced by a good one was never read again until a restart."""
    path = tmp_path / "workers"
    os.mkfifo(path)
    cfg = dataclasses.replace(CFG, workers="", workers_file=str(path), refresh_interval_s=0.2, refresh_timeout_s=0.3)
    with trio.fail_after(10):
        d = Discovery(cfg)
        async with trio.open_nursery() as nursery:
            await nursery.start(d.run)
            source = next(s for s in d.snapshot().sources if s.name == "workers.file")
            assert source.last_error == f"workers.file {path}: not a regular file (a named pipe)"
            replacement = tmp_path / "workers.new"
            write(replacement, "10.1.0.1:9000\n10.1.0.2:9000\n")
            os.replace(replacement, path)
            generation = d.generation
            await d.wait_for_change(generation)
            assert http_targets(d.workers()) == ["10.1.0.1:9000", "10.1.0.2:9000"]
            nursery.cancel_scope.cancel()
