"""Real gRPC server for one ``SimEndpoint`` on 127.0.0.1:0, run under a trio nursery.

Built on ``router.transport.grpc_server`` (raw bytes on the pinned method paths,
``PeerAbort`` → gRPC status). Handlers run on the server's bounded thread pool:

- Time: handler threads cannot call ``trio.current_time()``, so the server reads a
  ``clock`` callable passed in. The default is the running trio clock object's
  ``current_time`` (captured when the server starts), which gives the same timebase as
  ``trio.current_time()`` in the simulation's trio code; ``SystemClock.current_time``
  is a pure read and safe from any thread.
- Hang: the handler thread waits on an Event set by a knob change (then it re-plans)
  or by ``context.add_callback`` when the RPC ends (client cancel or deadline, server
  stop), so a hung call holds its thread no longer than the caller waits.
- Pool exhaustion: with every thread busy (e.g. all hung), new calls queue in the
  executor and start when a thread frees; a call whose RPC already ended by then
  returns at once. The callers' deadlines bound every wait.
- Start and stop are blocking grpcio calls and go through ``trio.to_thread.run_sync``;
  stopping cancels in-flight RPCs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import grpc
import trio

from kvroute_sim.sim.faults import CallPlan, SimEndpoint
from router.transport.grpc_server import GrpcServer, UnaryBytesHandler, start_grpc_server

Clock = Callable[[], float]


def grpc_routes(endpoint: SimEndpoint, clock: Clock) -> dict[str, UnaryBytesHandler]:
    """Method path → thread-pool handler for every method ``endpoint`` serves."""
    return {path: functools.partial(_serve_call, endpoint, path, clock) for path in endpoint.methods}


def _serve_call(
    endpoint: SimEndpoint, method_path: str, clock: Clock, request: bytes, context: grpc.ServicerContext
) -> bytes:
    endpoint.stats.begin(method_path)
    try:
        plan = endpoint.plan(method_path, clock())
        if plan.hang or plan.delay_s > 0:
            ended = threading.Event()  # the RPC is over: nobody will read a reply
            wake = threading.Event()  # the RPC ended or a knob changed

            def on_end() -> None:
                ended.set()
                wake.set()

            if not context.add_callback(on_end):
                return b""  # already over
            if plan.hang:
                cleared = _wait_out_hang(endpoint, method_path, clock, ended, wake)
                if cleared is None:
                    return b""
                plan = cleared
            if plan.delay_s > 0 and ended.wait(plan.delay_s):
                return b""
        if plan.abort is not None:
            raise plan.abort
        return endpoint.answer(method_path, request, clock())
    finally:
        endpoint.stats.end(method_path)


def _wait_out_hang(
    endpoint: SimEndpoint, method_path: str, clock: Clock, ended: threading.Event, wake: threading.Event
) -> CallPlan | None:
    """The plan once no hang applies, or None when the RPC ended first (no polling: waits on ``wake``)."""
    unsubscribe = endpoint.subscribe(wake.set)
    try:
        while True:
            wake.clear()  # before the checks, so a wake-up after them is not lost
            if ended.is_set():
                return None
            plan = endpoint.plan(method_path, clock())
            if not plan.hang:
                return plan
            wake.wait()
    finally:
        unsubscribe()


async def serve_endpoint(
    endpoint: SimEndpoint,
    *,
    clock: Clock | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    max_threads: int = 8,
    credentials: grpc.ServerCredentials | None = None,
    task_status: trio.TaskStatus[GrpcServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``endpoint`` until cancelled: ``server = await nursery.start(serve_endpoint, endpoint)``.

    With ``credentials`` (``grpc.ssl_server_credentials``) it serves TLS, else plaintext.
    """
    routes = grpc_routes(endpoint, clock or trio.lowlevel.current_clock().current_time)
    start = functools.partial(
        start_grpc_server, routes, host=host, port=port, max_workers=max_threads, credentials=credentials
    )
    # Not abandoned on cancel: the server is always returned, and stopped below.
    server = await trio.to_thread.run_sync(start)
    try:
        task_status.started(server)
        await trio.sleep_forever()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.stop)
