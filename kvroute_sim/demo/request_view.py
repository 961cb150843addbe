"""What the request-aware baselines see: the cluster at the request's arrival, and the request.

A ``RequestView`` is a ``policies.ClusterView`` that also knows the request being decided, can
answer exactly what the request's TTFT would be on each worker (the simulator's own look-ahead,
changing nothing), and counts each worker's requests in flight.
"""

from __future__ import annotations

from typing import Protocol

from kvroute_sim.demo.baselines import ClusterView
from kvroute_sim.demo.workload import DemoRequest
from kvroute_sim.sim.worker import PlannedTask


class RequestView(ClusterView, Protocol):
    @property
    def request(self) -> DemoRequest:
        """The request being decided."""
        ...

    def ttft_if_routed(self, worker: int) -> float:
        """The request's exact simulated TTFT (s) if routed to ``worker`` now."""
        ...

    def plan_if_routed(self, worker: int) -> PlannedTask:
        """When the request's prefill would start and end (simulated s) if routed to ``worker`` now."""
        ...

    def requests_in_flight(self, worker: int) -> int:
        """Requests routed to ``worker`` that have not finished (queued, in prefill or decoding)."""
        ...


class RequestBaselinePicker(Protocol):
    """A baseline that needs the request itself (its prompt, its exact cost on each worker)."""

    @property
    def name(self) -> str: ...

    def choose(self, keys: object, view: RequestView) -> int: ...
