"""gRPC adapter: ``RawRpc`` over real channels leased from the channel pool.

Bridge (measured in bench/bench_grpc_bridge.py, see docs/design.md): every outbound call runs on
ONE asyncio event loop on its own thread (grpc.aio), shared by all channels of the process. The
trio task hands the call over with ``call_soon_threadsafe`` and parks; the call's completion wakes
it through the trio token (``run_sync_soon``). A trio cancellation cancels the call on that loop,
which cancels the RPC at the server — unless the reply is already in (then it is kept; see
``wait_call``).

Why not the sync stub's ``.future()`` (the bridge before): grpcio starts a thread to drive a
channel's calls whenever a call begins on a channel with none in flight, and the router's channels
— one per worker, a few for KVCM — are idle between calls most of the time, so nearly every call
paid a thread start. The loop thread and grpc.aio's poller live as long as the process, so a call
pays two thread hand-offs instead, and calls that complete together share them.

Every call passes ``timeout=`` equal to the caller's remaining trio deadline (Python gRPC
does not propagate deadlines by itself). gRPC's own retries are disabled on our channels:
retries, where wanted, belong to the callers (one retry owner).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Sequence

import grpc
import grpc.aio
import trio

from router.config import ChannelPoolConfig
from router.transport.errors import DeadlineExceeded, RpcStatus, TransportError, Unavailable, status_to_error
from router.transport.ports import ChannelLeaser

# grpc codes our RpcStatus does not name map to UNKNOWN; the original name is kept in the detail.
_STATUS_BY_CODE = {code: RpcStatus[code.name] for code in grpc.StatusCode if code.name in RpcStatus.__members__}

ChannelOptions = Sequence[tuple[str, int | str]]


def channel_options(config: ChannelPoolConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.enable_retries", 0),  # one retry owner: our code (grpc would multiply our attempts)
        # A channel opened after invalidate() must not inherit the dead one's subchannel and its
        # reconnect backoff from grpc's process-wide subchannel pool.
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]


class OutboundLoop:
    """The asyncio event loop, on a daemon thread of its own, that runs outbound grpc.aio calls.

    One per process (:func:`outbound_loop`), started on first use and kept for the life of the
    process, as grpcio keeps its own threads: idle, it waits in epoll and costs nothing.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvroute-outbound-grpc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the loop's thread, soon. Raises RuntimeError once the loop is closed."""
        self._loop.call_soon_threadsafe(job)

    @property
    def thread(self) -> threading.Thread:
        return self._thread


_shared_loop: OutboundLoop | None = None
_shared_loop_lock = threading.Lock()


def outbound_loop() -> OutboundLoop:
    """The process's outbound loop, started on the first call."""
    global _shared_loop
    with _shared_loop_lock:
        if _shared_loop is None:
            _shared_loop = OutboundLoop()
        return _shared_loop


class OutboundCall:
    """One unary call on the outbound loop, as the bridge sees it: done or not, reply or error.

    ``on_done`` runs on the loop's thread once the call is over (reply, error or cancellation).
    """

    __slots__ = ("_cancel_requested", "_done", "_error", "_loop", "_on_done", "_reply", "_task")

    def __init__(self, loop: OutboundLoop, on_done: Callable[[OutboundCall], None] | None) -> None:
        self._loop = loop
        self._on_done = on_done
        self._done = False
        self._reply = b""
        self._error: BaseException | None = None
        self._task: asyncio.Task[bytes] | None = None  # the loop thread's alone
        self._cancel_requested = False

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        """The call's error once done (None: it answered)."""
        return self._error

    def result(self) -> bytes:
        if self._error is not None:
            raise self._error
        return self._reply

    def cancel(self) -> None:
        """Cancel the call (at the server too); from any thread. No effect once it is done."""
        self._cancel_requested = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.submit(self._cancel_on_loop)

    def _cancel_on_loop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _finish(self, task: asyncio.Task[bytes]) -> None:  # the task's done-callback, on the loop's thread
        if task.cancelled():
            self._error = grpc.aio.AioRpcError(
                grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), "cancelled by the caller", None
            )
        else:
            error = task.exception()
            if error is None:
                self._reply = task.result()
            else:
                self._error = error
        self._done = True
        if self._on_done is not None:
            self._on_done(self)


class OutboundChannel:
    """A channel to one target whose calls run on the outbound loop (the pool's channel type).

    The grpc.aio channel is created on the loop's thread by the first call (grpc.aio objects
    belong to the loop they were made on), so opening one never waits; :meth:`close` closes it
    there too and never waits either.
    """

    __slots__ = ("_aio", "_calls", "_closed", "_closing", "_credentials", "_loop", "_options", "_running", "target")

    def __init__(
        self,
        target: str,
        options: ChannelOptions,
        credentials: grpc.ChannelCredentials | None = None,
        *,
        loop: OutboundLoop | None = None,
    ) -> None:
        self.target = target
        self._options = tuple(options)
        self._credentials = credentials
        self._loop = outbound_loop() if loop is None else loop
        # The loop thread's alone:
        self._aio: grpc.aio.Channel | None = None
        self._calls: dict[str, grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]] = {}
        self._running: set[asyncio.Task[bytes]] = set()  # asyncio holds tasks weakly: kept here until done
        self._closed = False
        self._closing: asyncio.Future[None] | None = None

    def start(
        self, method_path: str, request: bytes, timeout: float | None, on_done: Callable[[OutboundCall], None] | None
    ) -> OutboundCall:
        """Start a unary call (bytes in, bytes out); ``on_done`` runs on the loop's thread when it ends.

        Raises RuntimeError when the process's outbound loop is closed."""
        call = OutboundCall(self._loop, on_done)
        self._loop.submit(lambda: self._begin(call, method_path, request, timeout))
        return call

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.submit(self._close_on_loop)

    # -- on the loop's thread --

    def _channel(self) -> grpc.aio.Channel:
        if self._aio is None:
            if self._credentials is None:
                self._aio = grpc.aio.insecure_channel(self.target, options=self._options)
            else:
                self._aio = grpc.aio.secure_channel(self.target, self._credentials, options=self._options)
        return self._aio

    def _begin(self, call: OutboundCall, method_path: str, request: bytes, timeout: float | None) -> None:
        multicallable = self._calls.get(method_path)
        if multicallable is None:
            multicallable = self._calls[method_path] = self._channel().unary_unary(method_path, None, None)
        task = asyncio.ensure_future(self._await(multicallable, request, timeout))
        call._task = task
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        task.add_done_callback(call._finish)
        if call._cancel_requested or self._closed:
            task.cancel()

    @staticmethod
    async def _await(
        multicallable: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes], request: bytes, timeout_s: float | None
    ) -> bytes:
        reply: bytes = await multicallable(request, timeout=timeout_s)
        return reply

    def _close_on_loop(self) -> None:
        self._closed = True
        if self._aio is not None:
            self._closing = asyncio.ensure_future(self._aio.close(None))  # cancels the calls still running


def open_channel(
    target: str, config: ChannelPoolConfig, credentials: grpc.ChannelCredentials | None = None
) -> OutboundChannel:
    """The channel pool's factory: a channel with our options, TLS with ``credentials``, else plaintext."""
    return OutboundChannel(target, channel_options(config), credentials)


def remaining_timeout() -> float | None:
    """Seconds left before the caller's trio deadline; None when there is none."""
    deadline = trio.current_effective_deadline()
    if deadline == math.inf:  # -inf (already cancelled) is an expired deadline, not "none"
        return None
    return deadline - trio.current_time()


def rpc_error_to_transport(target: str, error: grpc.RpcError) -> TransportError:
    code = error.code()
    details = error.details() or ""
    status = _STATUS_BY_CODE.get(code)
    if status is None:
        return status_to_error(target, RpcStatus.UNKNOWN, f"{code.name}: {details}")
    return status_to_error(target, status, details)


async def wait_call(
    channel: OutboundChannel, method_path: str, request: bytes, timeout_s: float | None
) -> OutboundCall:
    """Start the call and wait until it is over; if the caller's scope is cancelled, cancel it (and
    the RPC at the server)."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    waiting = True

    def wake() -> None:  # on the trio thread
        if waiting:
            trio.lowlevel.reschedule(task)

    def on_done(_: OutboundCall) -> None:  # on the loop's thread
        with contextlib.suppress(trio.RunFinishedError):  # the trio run is over: nobody waits
            token.run_sync_soon(wake)

    call = channel.start(method_path, request, timeout_s, on_done)

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        nonlocal waiting
        if call.done():
            # The reply is already in and its wake-up is queued behind this cancellation: this
            # thread was busy (a GC pause, a long step) while the deadline passed. Keep the reply —
            # throwing it away would count the peer as failed for our own stall.
            return trio.lowlevel.Abort.FAILED
        waiting = False
        call.cancel()
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)
    return call


class GrpcRawRpc:
    """``RawRpc`` over gRPC: bytes in, bytes out, on a pinned full method path."""

    def __init__(self, leaser: ChannelLeaser[OutboundChannel]) -> None:
        self._leaser = leaser

    async def call(self, target: str, method_path: str, request: bytes) -> bytes:
        timeout = remaining_timeout()
        if timeout is not None and timeout <= 0:
            raise DeadlineExceeded(target, "deadline already passed; not sent")
        async with self._leaser.lease(target) as channel:
            call = await wait_call(channel, method_path, request, timeout)
            error = call.exception()
            if error is None:
                return call.result()
            if not isinstance(error, grpc.RpcError):
                raise error
            failure = rpc_error_to_transport(target, error)
            if isinstance(failure, Unavailable):
                self._leaser.invalidate(target, channel)
            raise failure from error

    def invalidate(self, target: str) -> None:
        self._leaser.invalidate(target)
