"""gRPC adapter: ``RawRpc`` over real channels leased from the channel pool.

Bridge (measured in bench/bench_grpc_bridge.py, see docs/design.md): the sync stub's
``.future()``, whose done-callback wakes the waiting trio task through the trio token
(``run_sync_soon``); a trio cancellation cancels the future, which cancels the RPC at the
server — unless the reply is already in (then it is kept; see ``wait_future``). It kept the
raw client's concurrent throughput where grpc.aio inside trio-asyncio, a blocking call in
``trio.to_thread`` and persistent threads consuming single-threaded streams each lost a
quarter or more (their sequential latency was within ±0.1 ms of it), and it needs no second
event loop.

Every call passes ``timeout=`` equal to the caller's remaining trio deadline (Python gRPC
does not propagate deadlines by itself). gRPC's own retries are disabled on our channels:
retries, where wanted, belong to the callers (one retry owner).
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import grpc
import trio

from router.config import ChannelPoolConfig
from router.transport.errors import NotSent, RpcStatus, TransportError, Unavailable, status_to_error
from router.transport.ports import LEAST_IN_TURN_CALL_S, ChannelLeaser, InTurnCall, InTurnReply

# grpc codes our RpcStatus does not name map to UNKNOWN; the original name is kept in the detail.
_STATUS_BY_CODE = {code: RpcStatus[code.name] for code in grpc.StatusCode if code.name in RpcStatus.__members__}


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


def open_channel(
    target: str, config: ChannelPoolConfig, credentials: grpc.ChannelCredentials | None = None
) -> grpc.Channel:
    """The channel pool's factory: a channel with our options, TLS with ``credentials``, else plaintext."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=channel_options(config))
    return grpc.insecure_channel(target, options=channel_options(config))


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


async def wait_future(future: grpc.Future[bytes]) -> None:
    """Wait until ``future`` is done; if the caller's scope is cancelled, cancel it (and the RPC)."""
    token = trio.lowlevel.current_trio_token()
    task = trio.lowlevel.current_task()
    waiting = True

    def wake() -> None:  # on the trio thread
        if waiting:
            trio.lowlevel.reschedule(task)

    def on_done(_: grpc.Future[bytes]) -> None:  # on a grpc thread (or here, if already done)
        with contextlib.suppress(trio.RunFinishedError):  # the trio run is over: nobody waits
            token.run_sync_soon(wake)

    def abort(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
        nonlocal waiting
        if future.done():
            # The reply is already in and its wake-up is queued behind this cancellation: this
            # thread was busy (a GC pause, a long step) while the deadline passed. Keep the reply —
            # throwing it away would count the peer as failed for our own stall.
            return trio.lowlevel.Abort.FAILED
        waiting = False
        future.cancel()
        return trio.lowlevel.Abort.SUCCEEDED

    future.add_done_callback(on_done)
    await trio.lowlevel.wait_task_rescheduled(abort)


# Threads that start calls for the event loop (see ``GrpcRawRpc``): a start takes a thread for
# well under a millisecond, so a few serve any rate; a start finding them all busy waits its turn.
CALL_STARTERS = 4

# Threads for batches of calls made in turn, trio's default limiter not shared: a DNS lookup that
# hangs (httpx resolves a scheduler's name on that limiter's threads) must not leave a batch waiting
# for a thread while requests wait on its flights. One batch at a time is the prober's rule; the rest
# is for rounds still finishing a hung worker's call.
IN_TURN_THREADS = 4


@dataclass(slots=True)
class _ChannelCalls:
    """Per channel: its multi-callables by path, and the calls of ours in flight on it."""

    by_path: dict[str, grpc.UnaryUnaryMultiCallable[bytes, bytes]] = field(default_factory=dict)
    in_flight: int = 0

    def multi_callable(self, channel: grpc.Channel, method_path: str) -> grpc.UnaryUnaryMultiCallable[bytes, bytes]:
        call = self.by_path.get(method_path)
        if call is None:  # identity serializers: bytes both ways
            call = self.by_path[method_path] = channel.unary_unary(method_path, None, None)
        return call


class GrpcRawRpc:
    """``RawRpc`` over gRPC: bytes in, bytes out, on a pinned full method path.

    ``start_off_loop``: grpcio starts a thread of its own for a call made on a channel with no call
    in flight, and ``Thread.start`` blocks its caller until that thread holds the GIL, which on a
    busy process is milliseconds. So the first call on an idle channel is started on a starter
    thread and the event loop waits for it at a checkpoint; a call on a channel already carrying one
    of ours (grpcio's thread is running) starts inline. Off (the default), every call starts on the
    event loop: the handoff to a starter thread and back waits for the GIL twice, which costs more
    than the stall it saves once the routing thread is CPU-bound (docs/design.md §6).
    A background call (``call(..., background=True)``: the prober's refresh polls and health probes,
    which no request waits for) is started off the loop on an idle channel either way.
    """

    def __init__(self, leaser: ChannelLeaser[grpc.Channel], *, start_off_loop: bool) -> None:
        self._leaser = leaser
        self._start_off_loop = start_off_loop
        self._starters = trio.CapacityLimiter(CALL_STARTERS)
        self._in_turn_threads = trio.CapacityLimiter(IN_TURN_THREADS)
        # Building a multi-callable costs more than a small call's own Python: one per channel and
        # path, dropped with its channel.
        self._channels: weakref.WeakKeyDictionary[grpc.Channel, _ChannelCalls] = weakref.WeakKeyDictionary()

    def _calls_on(self, channel: grpc.Channel) -> _ChannelCalls:
        calls = self._channels.get(channel)
        if calls is None:
            calls = self._channels[channel] = _ChannelCalls()
        return calls

    async def _start(
        self,
        calls: _ChannelCalls,
        channel: grpc.Channel,
        method_path: str,
        request: bytes,
        rpc_timeout_s: float | None,
        off_loop: bool,
    ) -> grpc.Future[bytes]:
        call = calls.multi_callable(channel, method_path)
        if not off_loop or calls.in_flight > 0:
            return call.future(request, timeout=rpc_timeout_s)
        # Not abandoned on cancel: the start is short, and the future it returns must reach
        # ``wait_future``, whose cancellation cancels the RPC.
        return await trio.to_thread.run_sync(
            partial(call.future, request, timeout=rpc_timeout_s), limiter=self._starters
        )

    async def call(
        self,
        target: str,
        method_path: str,
        request: bytes,
        *,
        on_sent: Callable[[], None] | None = None,
        sent_timeout_s: float | None = None,
        background: bool = False,
    ) -> bytes:
        """``on_sent``: called once the call has started (its request handed to grpc). A caller
        cancelled before that (waiting for the channel or for a start thread) sent nothing.
        ``background``: no request waits for the reply, so a call on an idle channel is started on a
        starter thread whatever ``start_off_loop`` says: the thread grpcio starts for it would hold
        the event loop, and every request on it, for as long as the process's other threads keep the
        GIL (milliseconds under a shed storm)."""
        timeout = remaining_timeout()
        if timeout is not None and timeout <= 0:
            raise NotSent(target, "deadline already passed; not sent")
        async with self._leaser.lease(target) as channel:
            if timeout is not None:
                # A cold target's lease waited for its channel to open: the server gets what is left.
                timeout = remaining_timeout()
                if timeout is not None and timeout <= 0:
                    raise NotSent(target, "deadline passed while the channel opened; not sent")
            calls = self._calls_on(channel)
            # A caller whose bound moves to the sending gives the peer's time itself: what its scope left
            # before (a wait for the channel) would cut the call short on grpc's own deadline.
            rpc_timeout_s = timeout if sent_timeout_s is None else sent_timeout_s
            future = await self._start(
                calls, channel, method_path, request, rpc_timeout_s, self._start_off_loop or background
            )
            if on_sent is not None:
                on_sent()
            calls.in_flight += 1
            try:
                await wait_future(future)
            finally:
                calls.in_flight -= 1
            error = future.exception()
            if error is None:
                reply: bytes = future.result()
                return reply
            if not isinstance(error, grpc.RpcError):
                raise error
            raise self._failure(target, channel, error) from error

    async def call_in_turn(self, calls: Sequence[InTurnCall], within_s: float) -> list[InTurnReply]:
        """Blocking calls one after another on one worker thread: a blocking call waits on a
        completion queue of its own, where ``.future()`` on an idle channel makes grpcio start a
        thread. Not abandoned on cancel: the thread would go on using channels whose leases ended,
        and it finishes within ``within_s`` anyway. No thread free within ``within_s``: no call is
        made (each reply None)."""
        if not calls:
            return []
        started = time.monotonic()  # the thread's clock: the batch's time counts from here, leases included
        async with contextlib.AsyncExitStack() as leases:
            made: list[tuple[grpc.Channel, grpc.UnaryUnaryMultiCallable[bytes, bytes], bytes]] = []
            # The leases within the allowance too: a cold one waits for the pool's task (restarting,
            # or its inbox full of other leases), and the round must end however long that takes.
            failed: TransportError | None = None
            with trio.move_on_after(within_s):
                for call in calls:
                    try:
                        channel = await leases.enter_async_context(self._leaser.lease(call.target))
                    except TransportError as exc:  # its channel could not be opened: that call's failure
                        failed = exc
                        break
                    made.append(
                        (channel, self._calls_on(channel).multi_callable(channel, call.method_path), call.request)
                    )
            if len(made) < len(calls):  # no call made; the one whose lease failed fails, the rest get None
                after_s = time.monotonic() - started
                return [
                    InTurnReply(failed if i == len(made) and failed is not None else None, after_s)
                    for i in range(len(calls))
                ]
            outcomes: list[tuple[bytes | grpc.RpcError | None, float, float | None]] | None = None
            # Cancellation reaches only the wait for a thread: once started, the batch runs out.
            # A cold lease may have taken the whole allowance (the pool's task restarting): then no
            # thread is waited for, and no call made.
            with trio.move_on_after(max(0.0, within_s - (time.monotonic() - started))):
                outcomes = await trio.to_thread.run_sync(
                    partial(_blocking_in_turn, [(multi, request) for _, multi, request in made], started, within_s),
                    limiter=self._in_turn_threads,
                )
            if outcomes is None:
                return [InTurnReply(None, time.monotonic() - started) for _ in calls]
        return [
            InTurnReply(
                self._failure(call.target, channel, outcome) if isinstance(outcome, grpc.RpcError) else outcome,
                ended_after_s,
                began_after_s,
            )
            for call, (channel, _, _), (outcome, ended_after_s, began_after_s) in zip(
                calls, made, outcomes, strict=True
            )
        ]

    def _failure(self, target: str, channel: grpc.Channel, error: grpc.RpcError) -> TransportError:
        """The call's failure; an unreachable peer also forgets that exact channel."""
        failure = rpc_error_to_transport(target, error)
        if isinstance(failure, Unavailable):
            self._leaser.invalidate(target, channel)
        return failure

    def invalidate(self, target: str) -> None:
        self._leaser.invalidate(target)


def _blocking_in_turn(
    calls: Sequence[tuple[grpc.UnaryUnaryMultiCallable[bytes, bytes], bytes]], started: float, within_s: float
) -> list[tuple[bytes | grpc.RpcError | None, float, float | None]]:
    """On a worker thread: each call with what is left of ``within_s`` from ``started``
    (``time.monotonic()``; None once too little is left), when it ended and when it began, in seconds
    from then (None: not made)."""
    ends_at = started + within_s
    outcomes: list[tuple[bytes | grpc.RpcError | None, float, float | None]] = []
    for multi, request in calls:
        began = time.monotonic()
        left = ends_at - began
        if left < LEAST_IN_TURN_CALL_S:
            outcomes.append((None, time.monotonic() - started, None))
            continue
        outcome: bytes | grpc.RpcError
        try:
            outcome = multi(request, timeout=left)
        except grpc.RpcError as exc:
            outcome = exc
        outcomes.append((outcome, time.monotonic() - started, began - started))
    return outcomes
