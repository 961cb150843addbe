"""Discovery actor: KVCM bootstrap targets and worker addresses, as immutable snapshots.

Request paths call ``workers()`` / ``kvcm_bootstrap()``: a read of the current snapshot,
never a wait. A background task per source refreshes it every ``refresh_interval_s``:
- static: the configured list (validated at construction, every bad entry reported at
  once); ``set_static_workers`` replaces it at runtime (operators, tests, the demo);
- file: re-read when its (mtime, size, inode) changes; stat and read run in a worker
  thread (``trio.to_thread.run_sync``, abandoned on timeout), never on the event loop;
- DNS: A/AAAA answers from the system's ``socket.getaddrinfo`` in a worker thread of the
  source's own (abandoned on timeout; a refresh that finds it still running fails at once),
  or from a ``trio.abc.HostnameResolver`` given to ``Discovery``; with the name's explicit
  port or the default port.
Each refresh is bounded by ``refresh_timeout_s``. A source whose refresh fails or comes
back empty keeps its last good entries until ``stale_after_s`` after they were last good,
then drops to empty (counted). The published snapshot is the union of all sources.

Ports: an explicit port is honoured; a bare host takes the default
(``kvcm_port`` for KVCM, ``worker_http_port`` for workers — if that is 0, a bare worker
host is an error naming the entry). A worker's gRPC port is http + ``worker_grpc_port_offset``;
its status port is ``worker_status_port`` or the gRPC port.

State is mutated only in synchronous, non-awaiting methods (trio is cooperative, so each
is atomic); the refresh tasks await I/O and then apply their result in one such call.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import trio

from router.config import DiscoveryConfig
from router.files import open_regular_file
from router.problems import ConfigError, Problem, range_problems
from router.targets import NO_PORT, HostPort, TargetError, parse_target, parse_target_list
from router.types import WorkerAddr

log = logging.getLogger(__name__)


class DiscoveryConfigError(ConfigError):
    """Bad discovery configuration; ``problems`` lists every one, each naming its field and entry."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        super().__init__("discovery", problems)


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """The known workers at one moment. Immutable; a new version replaces it when the set changes."""

    workers: tuple[WorkerAddr, ...]
    version: int
    taken_at: float  # trio time it was published
    by_http_target: Mapping[str, WorkerAddr]  # read-only; keys are ``ip:http_port`` (KVCM's host_ip_port)

    @classmethod
    def of(cls, workers: tuple[WorkerAddr, ...], version: int, taken_at: float) -> WorkerSnapshot:
        return cls(workers, version, taken_at, MappingProxyType({w.http_target: w for w in workers}))


class SourceKind(enum.Enum):
    STATIC = "static"
    FILE = "file"
    DNS = "dns"


class ListKind(enum.Enum):
    KVCM = "kvcm"
    WORKERS = "workers"


@dataclass(frozen=True, slots=True)
class SourceHealth:
    name: str  # e.g. "workers.file"
    origin: str  # the path, the DNS name, or "config" for a static list
    entries: int  # currently contributed to the snapshot
    last_good_at: float | None
    last_refresh_at: float | None
    last_error: str | None
    refreshes_total: int
    failures_total: int
    empty_total: int
    stale_expiries_total: int  # times the last good entries expired and the source went empty


@dataclass(frozen=True, slots=True)
class DiscoverySnapshot:
    """Health of discovery, for the debug endpoint and metrics."""

    workers: int
    workers_version: int
    workers_taken_at: float
    kvcm_bootstrap: tuple[str, ...]
    generation: int  # bumps on every published change (workers or KVCM)
    sources: tuple[SourceHealth, ...]


# One getaddrinfo answer: (family, type, proto, canonname, sockaddr), the address first in sockaddr.
_AddrInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, tuple[object, ...]]


class _RefreshFailed(Exception):
    """A source could not be read; the message says why, naming the bad entries."""


class _TooManyEntries(_RefreshFailed):
    """A source listed more than max_entries."""


# --- pure parsing --------------------------------------------------------------------------


def parse_entries(text: str, default_port: int | None, what: str, max_entries: int) -> tuple[HostPort, ...]:
    """Entries separated by commas or newlines; ``#`` starts a comment. All errors reported at once.

    Whitespace inside an entry is an error, not a separator ("kvcm one" is a typo, not two hosts).
    """
    joined = ",".join(line.partition("#")[0] for line in text.splitlines())
    try:
        entries = parse_target_list(joined, default_port)
    except TargetError as exc:
        hint = " (or set worker_http_port for entries without a port)" if NO_PORT in str(exc) else ""
        raise _RefreshFailed(f"{what}: {exc}{hint}") from exc
    if len(entries) > max_entries:
        raise _TooManyEntries(f"{what}: {len(entries)} entries, more than max_entries={max_entries}")
    return entries


def to_workers(entries: tuple[HostPort, ...], config: DiscoveryConfig, what: str) -> tuple[WorkerAddr, ...]:
    """``ip:http_port`` entries as workers, with derived gRPC and status ports checked."""
    status_port = config.worker_status_port or None
    workers: list[WorkerAddr] = []
    bad: list[str] = []
    for hp in entries:
        worker = WorkerAddr.from_http(hp.host, hp.port, config.worker_grpc_port_offset, status_port)
        if not 1 <= worker.grpc_port <= 65535:
            bad.append(f"{hp}: grpc port {worker.grpc_port} (http + worker_grpc_port_offset) out of 1..65535")
        else:
            workers.append(worker)
    if bad:
        raise _RefreshFailed(f"{what}: " + "; ".join(bad))
    return tuple(workers)


def _dns_name(text: str, default_port: int | None, field: str) -> HostPort:
    """The name to look up and the port to give its addresses. An absolute name (a final dot) keeps its
    dot: without it the resolver's search list applies again (with Kubernetes' ndots of 5, search
    domains are asked first, and one with a wildcard record answers for it)."""
    try:
        target = parse_target(text, default_port)
    except TargetError as exc:
        hint = " (give name:port, or set worker_http_port)" if NO_PORT in str(exc) else ""
        raise _RefreshFailed(f"{field}: {exc}{hint}") from exc
    # The host part of a name (an IPv6 literal is bracketed; an IPv4 address ending in a dot is refused).
    absolute = text.strip().split(":")[0].endswith(".")
    return HostPort(f"{target.host}.", target.port) if absolute else target


def parse_list(config: DiscoveryConfig, list_kind: ListKind, text: str, what: str) -> tuple[HostPort, ...]:
    """A list's entries as a refresh reads them (workers checked as workers); raises naming ``what``."""
    if list_kind is ListKind.WORKERS:
        entries = parse_entries(text, config.worker_http_port or None, what, config.max_entries)
        to_workers(entries, config, what)
        return entries
    return parse_entries(text, config.kvcm_port, what, config.max_entries)


def list_file_problem(config: DiscoveryConfig, list_kind: ListKind, path: str, what: str) -> str | None:
    """Why the list file at ``path`` cannot be used now, read and parsed as a refresh would (None: it
    can, or it does not exist yet, which a refresh waits out). Reads the file: for check-config."""
    if not os.path.lexists(path):
        return None
    try:
        _signature, outcome = _file_signature_and_outcome(
            path, None, lambda text: parse_list(config, list_kind, text, what), list_file_max_bytes(config), what
        )
    except OSError as exc:
        return f"{what}: {exc.strerror or exc}"
    return outcome if isinstance(outcome, str) else None


# A list file holds at most max_entries entries of this many bytes each (an address and its comment),
# and is allowed MIN_LIST_FILE_BYTES whatever max_entries is: a larger file is no list, and is not read
# into memory.
FILE_BYTES_PER_ENTRY = 512
MIN_LIST_FILE_BYTES = 1 << 20


def list_file_max_bytes(config: DiscoveryConfig) -> int:
    return max(MIN_LIST_FILE_BYTES, config.max_entries * FILE_BYTES_PER_ENTRY)


def _file_signature_and_outcome(
    path: str,
    last: tuple[int, int, int] | None,
    parse: Callable[[str], tuple[HostPort, ...]],
    max_bytes: int,
    what: str,
) -> tuple[tuple[int, int, int], tuple[HostPort, ...] | str | None]:
    """Runs in a worker thread: (signature, the parsed entries or why the file cannot be used), the
    outcome None when the signature is unchanged. Parsed here too: a long list must not hold the loop."""
    # Refused before any read unless a regular file (an OSError): a FIFO or a device at the path would
    # hold the thread for good (a refresh abandons it, but it keeps the source's one read slot).
    with open_regular_file(path) as f:
        st = os.fstat(f.fileno())
        signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        if signature == last:
            return signature, None
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        return signature, f"{what}: larger than {max_bytes} bytes: not a list"
    try:
        return signature, parse(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return signature, f"{what}: not UTF-8 text (byte {exc.start})"
    except _RefreshFailed as exc:
        return signature, str(exc)


# --- sources ---------------------------------------------------------------------------------


class _Source:
    """One source of entries and its last good result (mutated by Discovery's synchronous methods)."""

    def __init__(
        self, list_kind: ListKind, kind: SourceKind, origin: str, dns_target: HostPort | None = None
    ) -> None:
        self.list_kind = list_kind
        self.kind = kind
        self.origin = origin
        self.dns_target = dns_target  # DNS: the name to resolve and the port to apply
        self.entries: tuple[HostPort, ...] = ()
        self.last_good_at: float | None = None
        self.last_refresh_at: float | None = None
        self.last_error: str | None = None
        self.refreshes_total = 0
        self.failures_total = 0
        self.empty_total = 0
        self.stale_expiries_total = 0
        # static: the configured entries; file: the last read's signature and parse outcome.
        self.static_entries: tuple[HostPort, ...] = ()
        self.file_signature: tuple[int, int, int] | None = None
        self.file_outcome: tuple[HostPort, ...] | str = ()
        # One worker thread per source at a time (a file's read, a name's lookup), never one of trio's
        # shared default ones, which every to_thread caller needs: a read stuck in the kernel or a
        # lookup a DNS server never answers (abandoned at the refresh timeout) holds this token, so it
        # costs at most one thread and delays only its own source.
        self.thread_limiter = trio.CapacityLimiter(1)

    @property
    def name(self) -> str:
        return f"{self.list_kind.value}.{self.kind.value}"

    def health(self) -> SourceHealth:
        return SourceHealth(
            name=self.name,
            origin=self.origin,
            entries=len(self.entries),
            last_good_at=self.last_good_at,
            last_refresh_at=self.last_refresh_at,
            last_error=self.last_error,
            refreshes_total=self.refreshes_total,
            failures_total=self.failures_total,
            empty_total=self.empty_total,
            stale_expiries_total=self.stale_expiries_total,
        )


class Discovery:
    """Construct inside a trio run (the first snapshot is stamped with ``trio.current_time()``).

    ``resolver``: answers the DNS sources' lookups in trio (none: the system's, each source in a
    worker thread of its own)."""

    def __init__(self, config: DiscoveryConfig, *, resolver: trio.abc.HostnameResolver | None = None) -> None:
        self._config = config
        self._resolver = resolver
        problems = discovery_problems(config)
        if problems:
            raise DiscoveryConfigError(problems)
        self._kvcm_default = config.kvcm_port
        self._worker_default = config.worker_http_port or None
        self._sources: list[_Source] = []
        self._kvcm_static = self._add(ListKind.KVCM, SourceKind.STATIC, "config")
        self._workers_static = self._add(ListKind.WORKERS, SourceKind.STATIC, "config")
        # Valid (checked above): parsing cannot fail.
        self._kvcm_static.static_entries = parse_list(config, ListKind.KVCM, config.kvcm_bootstrap, "kvcm_bootstrap")
        self._workers_static.static_entries = parse_list(config, ListKind.WORKERS, config.workers, "workers")
        for list_kind, field, name, default in (
            (ListKind.KVCM, "kvcm_bootstrap_dns", config.kvcm_bootstrap_dns, self._kvcm_default),
            (ListKind.WORKERS, "workers_dns", config.workers_dns, self._worker_default),
        ):
            if name:
                self._add(list_kind, SourceKind.DNS, name, _dns_name(name, default, field))
        if config.kvcm_bootstrap_file:
            self._add(ListKind.KVCM, SourceKind.FILE, config.kvcm_bootstrap_file)
        if config.workers_file:
            self._add(ListKind.WORKERS, SourceKind.FILE, config.workers_file)

        self._generation = 0
        self._changed = trio.Event()
        self._kvcm: tuple[str, ...] = ()
        self._workers = WorkerSnapshot.of((), 0, trio.current_time())
        now = trio.current_time()
        for source in (self._kvcm_static, self._workers_static):
            self._apply(source, source.static_entries, None, now)

    # --- request path: immutable snapshots, no waiting -----------------------------------------

    def workers(self) -> WorkerSnapshot:
        return self._workers

    def kvcm_bootstrap(self) -> tuple[str, ...]:
        return self._kvcm

    def snapshot(self) -> DiscoverySnapshot:
        return DiscoverySnapshot(
            workers=len(self._workers.workers),
            workers_version=self._workers.version,
            workers_taken_at=self._workers.taken_at,
            kvcm_bootstrap=self._kvcm,
            generation=self._generation,
            sources=tuple(s.health() for s in self._sources),
        )

    @property
    def generation(self) -> int:
        return self._generation

    async def wait_for_change(self, generation: int) -> int:
        """Wait (within the caller's cancel scope) until a change after ``generation`` is published."""
        while self._generation == generation:
            await self._changed.wait()
        return self._generation

    def set_static_workers(self, entries: str) -> None:
        """Replace the static worker list now (validated; raises DiscoveryConfigError naming bad entries).

        Empty counts as an empty refresh: the last good entries stay until ``stale_after_s``.
        """
        try:
            parsed = parse_list(self._config, ListKind.WORKERS, entries, "workers")
        except _RefreshFailed as exc:
            raise DiscoveryConfigError([Problem(("workers",), str(exc).removeprefix("workers: "))]) from exc
        self._workers_static.static_entries = parsed
        self._apply(self._workers_static, parsed, None, trio.current_time())

    # --- background ----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh every source once (so the first snapshot is complete), report started, keep refreshing."""
        async with trio.open_nursery() as first_round:
            for source in self._sources:
                first_round.start_soon(self._refresh, source)
        task_status.started()
        async with trio.open_nursery() as loops:
            for source in self._sources:
                loops.start_soon(self._refresh_loop, source)

    async def _refresh_loop(self, source: _Source) -> None:
        while True:
            await trio.sleep(self._config.refresh_interval_s)
            await self._refresh(source)

    async def _refresh(self, source: _Source) -> None:
        entries: tuple[HostPort, ...] = ()
        error: str | None = None
        with trio.move_on_after(self._config.refresh_timeout_s) as timeout:
            try:
                entries = await self._fetch(source)
            except _RefreshFailed as exc:
                error = str(exc)
        if timeout.cancelled_caught:
            limit = self._config.refresh_timeout_s
            error = f"{source.name} {source.origin}: no answer within refresh_timeout_s={limit}"
        self._apply(source, entries, error, trio.current_time())

    async def _fetch(self, source: _Source) -> tuple[HostPort, ...]:
        if source.kind is SourceKind.STATIC:
            return source.static_entries
        if source.kind is SourceKind.FILE:
            return await self._fetch_file(source)
        return await self._fetch_dns(source)

    async def _fetch_file(self, source: _Source) -> tuple[HostPort, ...]:
        try:
            signature, outcome = await trio.to_thread.run_sync(
                functools.partial(
                    _file_signature_and_outcome,
                    source.origin,
                    source.file_signature,
                    functools.partial(self._parse, source),
                    list_file_max_bytes(self._config),
                    f"{source.name} {source.origin}",
                ),
                abandon_on_cancel=True,
                limiter=source.thread_limiter,
            )
        except OSError as exc:
            source.file_signature = None
            raise _RefreshFailed(f"{source.name} {source.origin}: {exc.strerror or exc}") from exc
        if outcome is not None:  # changed: the outcome is kept until the next change
            source.file_signature = signature
            source.file_outcome = outcome
        if isinstance(source.file_outcome, str):
            raise _RefreshFailed(source.file_outcome)
        return source.file_outcome

    async def _fetch_dns(self, source: _Source) -> tuple[HostPort, ...]:
        name = source.dns_target
        assert name is not None  # set for every DNS source
        try:
            answers = await self._lookup(source, name)
        except OSError as exc:
            raise _RefreshFailed(f"{source.name} {source.origin}: {exc}") from exc
        addresses = sorted(
            {ipaddress.ip_address(str(sockaddr[0]).partition("%")[0]) for *_, sockaddr in answers},
            key=lambda a: (a.version, a.packed),
        )
        if len(addresses) > self._config.max_entries:
            raise _RefreshFailed(
                f"{source.name} {source.origin}: {len(addresses)} addresses, "
                f"more than max_entries={self._config.max_entries}"
            )
        entries = tuple(HostPort(str(a), name.port) for a in addresses)
        if source.list_kind is ListKind.WORKERS:
            to_workers(entries, self._config, f"{source.name} {source.origin}")
        return entries

    async def _lookup(self, source: _Source, name: HostPort) -> Sequence[_AddrInfo]:
        if self._resolver is not None:
            # Hosts are ASCII (parse_target refuses others), as a HostnameResolver takes them.
            return await self._resolver.getaddrinfo(name.host.encode("ascii"), name.port, type=socket.SOCK_STREAM)
        if source.thread_limiter.borrowed_tokens:
            # An earlier refresh's lookup, abandoned at its timeout, still holds the source's thread:
            # waiting for it could only time out again.
            raise _RefreshFailed(f"{source.name} {source.origin}: an earlier lookup of the name has not answered yet")
        lookup = functools.partial(socket.getaddrinfo, name.host, name.port, type=socket.SOCK_STREAM)
        return await trio.to_thread.run_sync(lookup, abandon_on_cancel=True, limiter=source.thread_limiter)

    # --- state (synchronous, atomic) -------------------------------------------------------------

    def _add(
        self, list_kind: ListKind, kind: SourceKind, origin: str, dns_target: HostPort | None = None
    ) -> _Source:
        source = _Source(list_kind, kind, origin, dns_target)
        self._sources.append(source)
        return source

    def _parse(self, source: _Source, text: str) -> tuple[HostPort, ...]:
        return parse_list(self._config, source.list_kind, text, f"{source.name} {source.origin}")

    def _apply(self, source: _Source, entries: tuple[HostPort, ...], error: str | None, now: float) -> None:
        before = source.entries
        source.refreshes_total += 1
        source.last_refresh_at = now
        if error is None and source.last_error is not None:
            # Read, if only an empty list: the error is over, and its return is news again.
            log.info("discovery: %s %s is readable again", source.name, source.origin)
            source.last_error = None
        if error is None and entries:
            source.entries = entries
            source.last_good_at = now
        else:
            if error is not None:
                source.failures_total += 1
                if error != source.last_error:  # once per new error, not once per refresh
                    kept = (
                        f"its last good entries are kept until stale_after_s ({self._config.stale_after_s:g} s) "
                        "after they were read"
                        if source.entries
                        else "the source has no entries until it can be read"
                    )
                    log.warning("discovery: %s; %s", error, kept)
                source.last_error = error
            else:
                source.empty_total += 1
            last_good = source.last_good_at
            if source.entries and last_good is not None and now - last_good > self._config.stale_after_s:
                source.entries = ()
                source.stale_expiries_total += 1
                # Said once, as it happens: the list may now be empty, and the router unready. The last
                # error names the source itself.
                log.warning(
                    "discovery: %s; its last good entries are older than stale_after_s (%g s) and are dropped",
                    source.last_error or f"{source.name} {source.origin}: it has read no entry since",
                    self._config.stale_after_s,
                )
        # The union over every source is rebuilt only when this one's entries changed: a long list
        # re-read unchanged every refresh_interval_s must not cost the loop its conversion each time.
        if source.entries is not before and source.entries != before:
            self._publish(now)

    def _publish(self, now: float) -> None:
        kvcm: dict[str, None] = {}
        workers: dict[str, WorkerAddr] = {}
        for source in self._sources:
            if source.list_kind is ListKind.KVCM:
                for hp in source.entries:
                    kvcm.setdefault(str(hp))
            else:
                for worker in to_workers(source.entries, self._config, source.name):
                    workers.setdefault(worker.http_target, worker)
        changed = False
        if tuple(kvcm) != self._kvcm:
            self._kvcm = tuple(kvcm)
            changed = True
        if tuple(workers.values()) != self._workers.workers:
            self._workers = WorkerSnapshot.of(tuple(workers.values()), self._workers.version + 1, now)
            changed = True
        if changed:
            self._generation += 1
            self._changed.set()
            self._changed = trio.Event()


_WORKER_PORTS = ("worker_http_port", "worker_grpc_port_offset", "worker_status_port")


def discovery_problems(config: DiscoveryConfig) -> list[Problem]:
    """Every reason discovery cannot work with ``config``: ranges, and the static lists and DNS names
    parsed exactly as the running actor parses them (every bad entry named at once)."""
    problems = range_problems(config)
    if config.stale_after_s < config.refresh_interval_s:
        problems.append(
            Problem(
                ("stale_after_s", "refresh_interval_s"),
                f"the stale timeout ({config.stale_after_s} s) is shorter than the refresh interval "
                f"({config.refresh_interval_s} s)",
            )
        )
    out_of_range = {name for p in problems for name in p.fields}
    worker_port = config.worker_http_port or None
    c = config
    checks: tuple[tuple[str, str, Callable[[], object]], ...] = (
        ("kvcm_bootstrap", c.kvcm_bootstrap, lambda: parse_list(c, ListKind.KVCM, c.kvcm_bootstrap, "kvcm_bootstrap")),
        ("workers", c.workers, lambda: parse_list(c, ListKind.WORKERS, c.workers, "workers")),
        (
            "kvcm_bootstrap_dns",
            c.kvcm_bootstrap_dns,
            lambda: _dns_name(c.kvcm_bootstrap_dns, c.kvcm_port, "kvcm_bootstrap_dns"),
        ),
        (
            "workers_dns",
            c.workers_dns,
            # Its answers take the name's port: the ports derived from it are checked as a list's are.
            lambda: to_workers((_dns_name(c.workers_dns, worker_port, "workers_dns"),), c, "workers_dns"),
        ),
    )
    for name, given, parse in checks:
        # Each list is parsed with its port settings and max_entries: only when those are valid.
        inputs = {"max_entries", "kvcm_port"} if name.startswith("kvcm") else {"max_entries", *_WORKER_PORTS}
        if not given or inputs & out_of_range:
            continue
        try:
            parsed = parse()
        except _TooManyEntries as exc:
            problems.append(Problem((name, "max_entries"), str(exc).removeprefix(f"{name}: ")))
        except _RefreshFailed as exc:
            problems.append(Problem((name,), str(exc).removeprefix(f"{name}: ")))
        else:
            if parsed == ():  # given, so counted as a source by every check of "is one set"
                problems.append(Problem((name,), f"names no entry, only separators ({given!r})"))
    return problems
