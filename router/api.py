"""The public API: ``async with open_router(config) as r: decision = await r.route(request)``."""

from __future__ import annotations

from router.config import KvrouteConfig
from router.supervisor import RouterHandle, open_router
from router.types import Reason, Role, RouteDecision, RouterClosed, RouteRequest, RouteSource, WorkerAddr

__all__ = [
    "KvrouteConfig",
    "Reason",
    "Role",
    "RouteDecision",
    "RouteRequest",
    "RouteSource",
    "RouterClosed",
    "RouterHandle",
    "WorkerAddr",
    "open_router",
]
