"""SimMaster: a simulated central scheduler — several replicas, one elected — over HTTP JSON and gRPC.

Every replica answers ``POST /rtp_llm/master/info`` naming the elected replica's HTTP address,
and serves ``POST /rtp_llm/schedule`` (HTTP, hypercorn on trio) and ``/FlexlbService/Schedule``
and ``/Cancel`` (gRPC on the HTTP port + 2, grpcio's thread pool). Routing is a pluggable
``decide`` callback; the default picks deterministically from a given worker list.

Fault knobs per replica (``MasterFaults``): refuse (the listeners close; in memory the host has
no server), hang (accept, never answer until the knob changes or the caller goes away), slow,
8600, a business error code, a garbled body (a 200 that is not JSON / undecodable bytes), a
plain-text 500, flapping (refusing during every other period), and a queue that routes nothing
(8503 once the call's ``generate_timeout`` has passed). ``serve_memory`` puts the
same replicas on a ``MemoryMasterNetwork`` for MockClock tests.

Knobs are changed from the trio thread; gRPC handler threads read them under a lock.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import hypercorn.config
import hypercorn.trio
import trio

from kvroute_sim.sim.faults import UNDECODABLE_REPLY, CallStats
from router.config import MASTER_GRPC_PORT_OFFSET
from router.targets import format_target
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.grpc_server import GrpcServer, UnaryBytesHandler, start_grpc_server
from router.transport.master_memory import MemoryMasterNetwork
from router.types import Role, RoleAddr
from router.wire import paths
from router.wire.master import (
    CODE_INVALID_REQUEST,
    CODE_NO_AVAILABLE_WORKER,
    CODE_QUEUE_TIMEOUT,
    MASTER_ROLES,
    MAX_REPLY_BYTES,
    BadScheduleRequest,
    MasterScheduleRequest,
    error_json,
    error_pb,
    info_json,
    parse_cancel_pb,
    parse_schedule_json,
    parse_schedule_pb,
    routed_json,
    routed_pb,
)

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

Decide = Callable[[MasterScheduleRequest], Sequence[RoleAddr]]

# The scheduler's routing failure for a role the cluster has but cannot serve now (8402–8405).
NO_WORKER_CODES = {Role.PREFILL: 8402, Role.DECODE: 8403, Role.PDFUSION: 8404, Role.VIT: 8405}


class NoWorkerForRole(Exception):
    """Raised by a ``Decide``: the cluster has workers of ``role`` and none can take the request."""

    def __init__(self, role: Role) -> None:
        super().__init__(f"no available {role.value} worker")
        self.role = role
        self.code = NO_WORKER_CODES[role]
"""The routing policy: the workers to name (one per role) for a request; none → 8400."""

METHODS = frozenset({paths.MASTER_HTTP_SCHEDULE, paths.MASTER_HTTP_INFO, paths.MASTER_SCHEDULE, paths.MASTER_CANCEL})
GARBLED_BODY = b"<html>upstream hiccup</html>"
_BIND_ATTEMPTS = 20  # HTTP on port 0, gRPC on that + 2: retried when the second port is taken


@dataclass(frozen=True, slots=True)
class MasterFaults:
    refuse: bool = False
    hang: bool = False
    slow_ms: float = 0.0
    fallback: bool = False  # answer 8600
    business_error: int | None = None  # answer this error code
    garbled: bool = False  # a 200 whose body is not JSON (gRPC: undecodable bytes)
    server_error: bool = False  # a plain-text 500 (gRPC: INTERNAL)
    oversized: bool = False  # a well-formed error reply longer than MAX_REPLY_BYTES, its message the padding
    flapping_period_s: float = 0.0  # > 0: refuse during every other period of this length
    # Not None: every schedule call is queued and never routed, and answered QUEUE_TIMEOUT (8503) once
    # its generate_timeout has passed, counted from this replica's receipt less this many ms (a
    # scheduler counting from request_time_ms, which the client rounds down, or whose clock is ahead).
    queue_timeout_early_ms: float | None = None


def pick_from(workers: Sequence[RoleAddr]) -> Decide:
    """Per role present in ``workers``, one worker chosen by a stable hash of the request id."""
    by_role = {role: [w for w in workers if w.role is role] for role in MASTER_ROLES}

    def decide(request: MasterScheduleRequest) -> Sequence[RoleAddr]:
        digest = int.from_bytes(hashlib.blake2b(request.request_id.encode(), digest_size=8).digest(), "big")
        return [group[digest % len(group)] for group in by_role.values() if group]

    return decide


def _queued_s(faults: MasterFaults, request: MasterScheduleRequest) -> float | None:
    """How long a queueing replica holds ``request`` before its QUEUE_TIMEOUT (None: not queueing)."""
    if faults.queue_timeout_early_ms is None:
        return None
    return max(0.0, request.generate_timeout_ms - faults.queue_timeout_early_ms) / 1000


def _http_status(code: int) -> int:
    if code == CODE_INVALID_REQUEST:
        return 400
    if code == 8502:
        return 503
    return 500


class SimMasterReplica:
    """One scheduler replica's state: knobs, counters and (when served for real) its ports."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.host = ""  # its HTTP address, once served
        self.stats = CallStats(METHODS)
        self.cancels: list[tuple[int, bool]] = []  # (int64 request id, deadline exceeded) received
        self.disconnects = 0  # HTTP calls whose caller went away before the answer
        self.http_clients: set[tuple[str, int]] = set()  # client (ip, port) of every HTTP call: connection reuse
        self.listening = False  # real servers: the listeners are open
        self._listening_changed = trio.Event()
        self._faults = MasterFaults()
        self._faults_since = 0.0
        self._lock = threading.Lock()
        self._grpc_changed = threading.Condition(self._lock)
        self._trio_changed = trio.Event()

    @property
    def faults(self) -> MasterFaults:
        with self._lock:
            return self._faults

    def set_faults(self, faults: MasterFaults, now: float) -> None:
        """Trio thread only (it wakes trio waiters); ``now`` starts a flapping period."""
        with self._lock:
            self._faults = faults
            self._faults_since = now
            self._grpc_changed.notify_all()
        changed, self._trio_changed = self._trio_changed, trio.Event()
        changed.set()

    def refusing(self, now: float) -> bool:
        with self._lock:
            faults, since = self._faults, self._faults_since
        if faults.refuse:
            return True
        period = faults.flapping_period_s
        return period > 0 and math.floor((now - since) / period) % 2 == 1

    def next_flap_at(self, now: float) -> float:
        """When ``refusing`` may change next by the passing of time alone (inf: never)."""
        with self._lock:
            period, since = self._faults.flapping_period_s, self._faults_since
        if period <= 0:
            return math.inf
        return since + (math.floor((now - since) / period) + 1) * period

    async def wait_changed(self) -> None:
        await self._trio_changed.wait()

    def _set_listening(self, listening: bool) -> None:
        self.listening = listening
        changed, self._listening_changed = self._listening_changed, trio.Event()
        changed.set()

    async def wait_listening(self, listening: bool) -> None:
        """Real servers: until the listeners are open (True) or closed (False)."""
        while self.listening != listening:
            await self._listening_changed.wait()

    def _record_cancel(self, cancel: tuple[int, bool]) -> None:
        with self._lock:
            self.cancels.append(cancel)
            self._grpc_changed.notify_all()

    def wait_cancels(self, count: int, timeout_s: float) -> bool:
        """Block (in a thread) until ``count`` Cancel calls arrived; False on timeout."""
        with self._lock:
            return self._grpc_changed.wait_for(lambda: len(self.cancels) >= count, timeout_s)

    def wait_grpc_hang(self, ended: threading.Event) -> bool:
        """A gRPC thread: wait while ``hang`` is on; False when the RPC ended first."""
        with self._lock:
            while self._faults.hang:
                if ended.is_set():
                    return False
                self._grpc_changed.wait()
            return not ended.is_set()

    def wake_grpc(self) -> None:
        with self._lock:
            self._grpc_changed.notify_all()


@dataclass(frozen=True, slots=True)
class SimMasterAddresses:
    hosts: tuple[str, ...]  # HTTP addresses, by replica index
    grpc_targets: tuple[str, ...]
    elected: str


class SimMaster:
    def __init__(
        self,
        workers: Sequence[RoleAddr] = (),
        *,
        replicas: int = 3,
        decide: Decide | None = None,
        elected: int = 0,
        queue_length: int = 0,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {replicas}")
        self.replicas = [SimMasterReplica(i) for i in range(replicas)]
        self._decide = decide if decide is not None else pick_from(workers)
        self._elected = elected
        self.queue_length = queue_length
        self.schedules = 0  # schedule requests answered with workers, all replicas
        self._schedules_lock = threading.Lock()  # gRPC handler threads count too

    # --- knobs --------------------------------------------------------------------------

    def set_decide(self, decide: Decide) -> None:
        self._decide = decide

    def elect(self, index: int) -> None:
        self._elected = index

    @property
    def elected(self) -> SimMasterReplica:
        return self.replicas[self._elected]

    def set_faults(self, index: int, faults: MasterFaults) -> None:
        self.replicas[index].set_faults(faults, trio.current_time())

    def clear_faults(self) -> None:
        for replica in self.replicas:
            replica.set_faults(MasterFaults(), trio.current_time())

    def addresses(self) -> SimMasterAddresses:
        hosts = tuple(r.host for r in self.replicas)
        return SimMasterAddresses(hosts, tuple(_grpc_of(h) for h in hosts), self.elected.host)

    # --- behaviour shared by the transports ----------------------------------------------

    def _schedule_answer(self, request: MasterScheduleRequest) -> tuple[int, str, Sequence[RoleAddr]]:
        """(code, message, workers) for a request the replica answers now."""
        try:
            addrs = list(self._decide(request))
        except NoWorkerForRole as missing:
            return missing.code, str(missing), ()
        if not addrs:
            return CODE_NO_AVAILABLE_WORKER, "no available worker", ()
        with self._schedules_lock:
            self.schedules += 1
        return 200, "", addrs

    def _fault_code(self, faults: MasterFaults) -> tuple[int, str] | None:
        if faults.fallback:
            return 8600, "FALLBACK"
        if faults.business_error is not None:
            return faults.business_error, f"simulated error {faults.business_error}"
        return None

    async def _http(self, replica: SimMasterReplica, path: str, body: bytes) -> tuple[int, bytes]:
        """One HTTP exchange after the faults that delay it (refuse is handled by the caller)."""
        if path not in (paths.MASTER_HTTP_INFO, paths.MASTER_HTTP_SCHEDULE):
            return 404, error_json(404, f"no such path: {path}")
        while replica.faults.hang:
            await replica.wait_changed()
        faults = replica.faults
        if faults.slow_ms > 0:
            await trio.sleep(faults.slow_ms / 1000)
        if faults.garbled:
            return 200, GARBLED_BODY
        if faults.server_error:
            return 500, b"java.lang.IllegalStateException: simulated"
        if faults.oversized:
            return _http_status(CODE_QUEUE_TIMEOUT), error_json(CODE_QUEUE_TIMEOUT, "e" * MAX_REPLY_BYTES)
        if path == paths.MASTER_HTTP_INFO:
            return 200, info_json(self.elected.host, self.queue_length, replica.host.rpartition(":")[0])
        fault = self._fault_code(faults)
        if fault is not None:
            return _http_status(fault[0]), error_json(*fault)
        try:
            request = parse_schedule_json(body)
        except BadScheduleRequest as exc:
            return 400, error_json(CODE_INVALID_REQUEST, str(exc))
        queued_s = _queued_s(faults, request)
        if queued_s is not None:
            await trio.sleep(queued_s)
            return _http_status(CODE_QUEUE_TIMEOUT), error_json(CODE_QUEUE_TIMEOUT, "QUEUE_TIMEOUT")
        code, message, addrs = self._schedule_answer(request)
        if code != 200:
            return _http_status(code), error_json(code, message)
        return 200, routed_json(addrs, self.elected.host, self.queue_length, request.request_id)

    # --- in memory -------------------------------------------------------------------------

    def serve_memory(self, network: MemoryMasterNetwork) -> SimMasterAddresses:
        """Serve every replica on ``network`` at 10.77.0.<i+1>:7001."""
        for replica in self.replicas:
            replica.host = f"10.77.0.{replica.index + 1}:7001"

            async def handler(path: str, body: bytes, replica: SimMasterReplica = replica) -> tuple[int, bytes]:
                if replica.refusing(trio.current_time()):
                    raise PeerAbort(RpcStatus.UNAVAILABLE, "connection refused (replica refusing)")
                replica.stats.begin(path)
                try:
                    return await self._http(replica, path, body)
                finally:
                    replica.stats.end(path)

            network.serve(replica.host, handler)
        return self.addresses()

    # --- real servers -----------------------------------------------------------------------

    async def run(
        self, *, host: str = "127.0.0.1", task_status: trio.TaskStatus[SimMasterAddresses] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve every replica (HTTP and gRPC) on ``host`` until cancelled; reports the addresses."""
        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                bound = trio.Event()
                nursery.start_soon(self._serve_replica, replica, host, bound)
                await bound.wait()
            task_status.started(self.addresses())

    async def _serve_replica(self, replica: SimMasterReplica, host: str, bound: trio.Event) -> None:
        """Keep the replica's listeners open while it is not refusing; closed while it is."""
        http_port = 0
        while True:
            now = trio.current_time()
            if replica.refusing(now) and bound.is_set():
                with trio.move_on_at(replica.next_flap_at(now)):
                    await replica.wait_changed()
                continue
            with trio.CancelScope() as serving:
                try:
                    async with trio.open_nursery() as nursery:
                        http_port, grpc_server = await self._bind(nursery, replica, host, http_port)
                        replica._set_listening(True)
                        try:
                            bound.set()  # the ports are known (a replica refusing from the start closes them now)
                            while not replica.refusing(trio.current_time()):
                                with trio.move_on_at(replica.next_flap_at(trio.current_time())):
                                    await replica.wait_changed()
                            serving.cancel()
                        finally:
                            grpc_server.stop()
                            replica.wake_grpc()
                finally:
                    replica._set_listening(False)  # hypercorn's listener is closed by now

    async def _bind(
        self, nursery: trio.Nursery, replica: SimMasterReplica, host: str, http_port: int
    ) -> tuple[int, GrpcServer]:
        """Start HTTP on ``http_port`` (0: any) and gRPC on it + 2; the first bind retries for a free pair."""
        for _ in range(_BIND_ATTEMPTS if http_port == 0 else 1):
            config = hypercorn.config.Config()
            config.bind = [format_target(host, http_port)]
            config.accesslog = None
            config.errorlog = logging.getLogger("hypercorn.error")
            config.include_server_header = False
            app = _ReplicaApp(self, replica)
            scope = trio.CancelScope()

            async def serve(
                *,
                scope: trio.CancelScope = scope,
                config: hypercorn.config.Config = config,
                app: _ReplicaApp = app,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await hypercorn.trio.serve(app, config, task_status=task_status)  # type: ignore[arg-type]

            binds: list[str] = await nursery.start(serve)
            bound = int(binds[0].rpartition(":")[2])
            try:
                grpc_server = start_grpc_server(
                    _grpc_routes(self, replica), host=host, port=bound + MASTER_GRPC_PORT_OFFSET
                )
            except OSError:
                scope.cancel()
                if http_port != 0:
                    raise
                continue
            replica.host = format_target(host, bound)
            return bound, grpc_server
        raise OSError(f"SimMaster: no free HTTP port with a free port + {MASTER_GRPC_PORT_OFFSET} on {host}")


def _grpc_of(http_host: str) -> str:
    ip, _, port = http_host.rpartition(":")
    return f"{ip}:{int(port) + MASTER_GRPC_PORT_OFFSET}" if port else ""


class _ReplicaApp:
    """The replica's HTTP API as an ASGI app (POST only)."""

    def __init__(self, master: SimMaster, replica: SimMasterReplica) -> None:
        self._master = master
        self._replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["method"] != "POST":
            await _respond(send, 405, b"use POST")
            return
        client = scope.get("client")
        if client:
            self._replica.http_clients.add((str(client[0]), int(client[1])))
        stat_path = path if path in METHODS else None
        if stat_path is not None:
            self._replica.stats.begin(stat_path)
        try:
            answer: tuple[int, bytes] | None = None
            async with trio.open_nursery() as nursery:

                async def exchange() -> None:
                    nonlocal answer
                    answer = await self._master._http(self._replica, path, body)
                    nursery.cancel_scope.cancel()

                async def watch_disconnect() -> None:
                    message: Message = await receive()
                    while message["type"] != "http.disconnect":
                        message = await receive()
                    self._replica.disconnects += 1
                    nursery.cancel_scope.cancel()

                nursery.start_soon(exchange)
                nursery.start_soon(watch_disconnect)
        finally:
            if stat_path is not None:
                self._replica.stats.end(stat_path)
        if answer is not None:
            await _respond(send, *answer)


async def _respond(send: Send, status: int, body: bytes) -> None:
    # The scheduler labels every reply JSON, even its plain-text errors.
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _grpc_routes(master: SimMaster, replica: SimMasterReplica) -> dict[str, UnaryBytesHandler]:
    def schedule(request: bytes, context: grpc.ServicerContext) -> bytes:
        replica.stats.begin(paths.MASTER_SCHEDULE)
        try:
            ended = threading.Event()

            def on_end() -> None:
                ended.set()
                replica.wake_grpc()

            if not context.add_callback(on_end):
                return b""
            if not replica.wait_grpc_hang(ended):
                return b""
            faults = replica.faults
            if faults.slow_ms > 0 and ended.wait(faults.slow_ms / 1000):
                return b""
            if faults.garbled:
                return UNDECODABLE_REPLY
            if faults.server_error:
                raise PeerAbort(RpcStatus.INTERNAL, "simulated")
            if faults.oversized:
                return error_pb(CODE_QUEUE_TIMEOUT, "e" * MAX_REPLY_BYTES)
            fault = master._fault_code(faults)
            if fault is not None:
                return error_pb(*fault)
            try:
                _, parsed = parse_schedule_pb(request)
            except BadScheduleRequest as exc:
                return error_pb(CODE_INVALID_REQUEST, str(exc))
            queued_s = _queued_s(faults, parsed)
            if queued_s is not None:
                if ended.wait(queued_s):
                    return b""
                return error_pb(CODE_QUEUE_TIMEOUT, "QUEUE_TIMEOUT")
            code, message, addrs = master._schedule_answer(parsed)
            if code != 200:
                return error_pb(code, message)
            return routed_pb(addrs, master.elected.host, master.queue_length)
        finally:
            replica.stats.end(paths.MASTER_SCHEDULE)

    def cancel(request: bytes, context: grpc.ServicerContext) -> bytes:
        replica.stats.begin(paths.MASTER_CANCEL)
        try:
            try:
                replica._record_cancel(parse_cancel_pb(request))
            except BadScheduleRequest as exc:
                raise PeerAbort(RpcStatus.INVALID_ARGUMENT, str(exc)) from exc
            return b""
        finally:
            replica.stats.end(paths.MASTER_CANCEL)

    return {paths.MASTER_SCHEDULE: schedule, paths.MASTER_CANCEL: cancel}
