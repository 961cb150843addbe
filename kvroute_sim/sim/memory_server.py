"""In-memory server: a ``SimEndpoint`` as a ``MemoryNetwork`` handler, faults on trio time.

Time is ``trio.current_time()`` (MockClock in tests) unless a ``clock`` is given (a replay that
holds the simulation's time at each arrival while the router decides). Faults run on trio time
either way. A hang waits for a knob change
(then re-plans) or for the caller's cancel scope; a delay is a ``trio.sleep``; dead and
unknown methods raise ``PeerAbort`` (UNAVAILABLE / UNIMPLEMENTED), which the network
maps to the same errors the gRPC adapter raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import trio

from kvroute_sim.sim.faults import CallPlan, SimEndpoint
from router.transport.errors import PeerAbort, RpcStatus
from router.transport.memory_adapter import Handler


def memory_handler(endpoint: SimEndpoint, clock: Callable[[], float] | None = None) -> Handler:
    """``MemoryNetwork.serve(target, memory_handler(endpoint))``; ``clock``: what the answer reads as now."""
    read_clock = clock or trio.current_time

    async def handle(method_path: str, request: bytes) -> bytes:
        if method_path not in endpoint.methods:
            raise PeerAbort(RpcStatus.UNIMPLEMENTED, f"unknown method {method_path}")
        endpoint.stats.begin(method_path)
        try:
            plan = await _plan_past_hangs(endpoint, method_path)
            if plan.abort is not None:
                raise plan.abort
            if plan.delay_s > 0:
                await trio.sleep(plan.delay_s)
            else:
                await trio.lowlevel.checkpoint()
            return endpoint.answer(method_path, request, read_clock())
        finally:
            endpoint.stats.end(method_path)

    return handle


async def _plan_past_hangs(endpoint: SimEndpoint, method_path: str) -> CallPlan:
    """The call's plan once no hang applies; waits (without polling) for knob changes meanwhile."""
    plan = endpoint.plan(method_path, trio.current_time())
    if not plan.hang:
        return plan  # the common case: no subscription, no event
    token = trio.lowlevel.current_trio_token()
    while True:  # subscribed before each re-plan, so a change made in between is not missed
        changed = trio.Event()
        unsubscribe = endpoint.subscribe(_waker(token, changed))
        try:
            plan = endpoint.plan(method_path, trio.current_time())
            if not plan.hang:
                return plan
            await changed.wait()
        finally:
            unsubscribe()


def _waker(token: trio.lowlevel.TrioToken, event: trio.Event) -> Callable[[], None]:
    """Knobs may change on any thread: set ``event`` through the trio token."""

    def wake() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(event.set)

    return wake
