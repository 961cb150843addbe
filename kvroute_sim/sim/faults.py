"""What the simulated servers share: fault vocabulary, the per-call plan, change wake-ups, call counts.

A simulated peer (a KVCM replica or a worker) is a ``SimEndpoint``: for each call the
server asks it for a ``CallPlan`` (abort, hang or delay — decided from the fault knobs
and the time passed in), executes the plan with its own primitives (trio sleeps in
memory, thread waits under gRPC), then asks for the reply bytes. Knob changes notify
subscribers, so a hung call re-plans when its fault is cleared.

Thread safety: everything here may be called from gRPC server threads and from the
trio thread at once; shared state is guarded by ``threading.Lock`` and callbacks run
outside the lock.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from router.transport.errors import PeerAbort, RpcStatus


class Garble(enum.Enum):
    """A reply that breaks the wire contract."""

    UNDECODABLE = "undecodable"  # bytes that do not parse as the reply message
    CONTRACT = "contract"  # parses, but a field breaks the contract (bad port, negative count)


def check_garble(garbled: object) -> None:
    """A fault's ``garbled`` knob names how the reply breaks, or is None; anything else (``True``, a
    string) is refused, naming the field, rather than read as no fault at all."""
    if garbled is not None and not isinstance(garbled, Garble):
        raise ValueError(f"garbled: must be a Garble ({', '.join(g.name for g in Garble)}) or None, got {garbled!r}")


# A length-delimited field 1 claiming 127 bytes with none following: every reply message rejects it.
UNDECODABLE_REPLY = b"\x0a\x7f"


@dataclass(frozen=True, slots=True)
class CallPlan:
    """How the server handles one call before producing its reply."""

    abort: PeerAbort | None = None  # end the call with this gRPC status
    hang: bool = False  # accept and never answer until the knob changes or the caller goes away
    delay_s: float = 0.0  # answer after this long

    @classmethod
    def dead(cls, details: str) -> CallPlan:
        return cls(abort=PeerAbort(RpcStatus.UNAVAILABLE, details))


ANSWER_NOW = CallPlan()


class SimEndpoint(Protocol):
    """One simulated server's behaviour, independent of the transport that carries it."""

    @property
    def methods(self) -> frozenset[str]:
        """The pinned method paths served; others are UNIMPLEMENTED."""
        ...

    @property
    def stats(self) -> CallStats: ...

    def plan(self, method_path: str, now: float) -> CallPlan: ...

    def answer(self, method_path: str, request: bytes, now: float) -> bytes:
        """The reply bytes; raises ``PeerAbort`` for a request that cannot be answered."""
        ...

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call ``wake`` (on the thread that changes a knob) after every knob change; returns unsubscribe."""
        ...


class ChangeNotifier:
    """Wake-ups for calls hung on a fault; one per simulated peer (or cluster)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        self._subscribers: dict[int, Callable[[], None]] = {}  # at most one per hung in-flight call

    def subscribe(self, wake: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            key = self._next_id
            self._next_id += 1
            self._subscribers[key] = wake

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers.pop(key, None)

        return unsubscribe

    def notify(self) -> None:
        with self._lock:
            wakes = list(self._subscribers.values())
        for wake in wakes:
            wake()


@dataclass(frozen=True, slots=True)
class MethodStats:
    calls: int
    in_flight: int
    peak_in_flight: int


class CallStats:
    """Calls served per method path, with in-flight and peak in-flight counts (for tests and benches).

    With a ``parent``, every call is also counted there: e.g. one ``CallStats`` for a whole
    fleet of workers gives the peak concurrency across all of them.
    """

    def __init__(self, methods: frozenset[str], parent: CallStats | None = None) -> None:
        self._parent = parent
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._calls = dict.fromkeys(methods, 0)
        self._in_flight = dict.fromkeys(methods, 0)
        self._peak = dict.fromkeys(methods, 0)
        self._waiting = 0  # threads in wait_in_flight: only they need a notify (counted under the lock)

    def begin(self, method_path: str) -> None:
        with self._lock:
            self._calls[method_path] += 1
            n = self._in_flight[method_path] + 1
            self._in_flight[method_path] = n
            self._peak[method_path] = max(self._peak[method_path], n)
            if self._waiting:
                self._changed.notify_all()
        if self._parent is not None:
            self._parent.begin(method_path)

    def end(self, method_path: str) -> None:
        with self._lock:
            self._in_flight[method_path] -= 1
            if self._waiting:
                self._changed.notify_all()
        if self._parent is not None:
            self._parent.end(method_path)

    def wait_in_flight(self, method_path: str, count: int, timeout_s: float) -> bool:
        """Block until ``count`` calls of ``method_path`` are in flight; False on timeout.

        For tests of real servers (run it in ``trio.to_thread.run_sync``): e.g. a hung call
        has reached the server (count 1), or its handler saw the caller go away (count 0).
        """
        with self._lock:
            self._waiting += 1
            try:
                return self._changed.wait_for(lambda: self._in_flight[method_path] == count, timeout_s)
            finally:
                self._waiting -= 1

    def get(self, method_path: str) -> MethodStats:
        with self._lock:
            return MethodStats(
                self._calls[method_path], self._in_flight[method_path], self._peak[method_path]
            )

    def reset(self) -> None:
        """Zero the counts and peaks (in-flight counts stay: those calls are still running)."""
        with self._lock:
            for method in self._calls:
                self._calls[method] = 0
                self._peak[method] = self._in_flight[method]
