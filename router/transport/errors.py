"""One small error hierarchy for every remote call, whatever the adapter."""

from __future__ import annotations

import enum

from router.types import cut_text

# An error's detail is kept to this many characters: it often holds a peer's own text (a status's
# message, a field's value, a host) of any length, and it reaches logs, decisions, /readyz and
# /debug/actors.
MAX_PEER_TEXT_CHARS = 1024


class RpcStatus(enum.Enum):
    """The gRPC status codes an adapter can see (names match grpc.StatusCode)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14


class PeerAbort(Exception):
    """Raised by a server-side handler (simulated peers) to end a call with a gRPC status."""

    def __init__(self, status: RpcStatus, details: str = "") -> None:
        super().__init__(f"{status.name}: {details}")
        self.status = status
        self.details = details


class TransportError(Exception):
    """A remote call failed. ``target`` names the peer; ``kind`` is a metric label."""

    kind = "error"

    def __init__(self, target: str, detail: str) -> None:
        detail = cut_text(detail, MAX_PEER_TEXT_CHARS)
        super().__init__(f"{target}: {detail}")
        self.target = target
        self.detail = detail


class Unavailable(TransportError):
    """The peer could not be reached (refused, reset, not serving, unknown target)."""

    kind = "unavailable"


class DeadlineExceeded(TransportError):
    """The call did not finish within the caller's deadline."""

    kind = "deadline"


class NotSent(DeadlineExceeded):
    """The caller's deadline had passed before the call could be sent: the peer never saw it."""


class GarbledReply(TransportError):
    """The reply could not be decoded or broke the wire contract; ``detail`` names the field."""

    kind = "garbled"


class RemoteError(TransportError):
    """The peer answered with an error: a gRPC status or an application error code."""

    kind = "remote_error"

    def __init__(self, target: str, detail: str, code: int, code_name: str) -> None:
        super().__init__(target, f"{code_name} ({code}): {detail}")
        self.code = code
        self.code_name = code_name


class NotLeader(RemoteError):
    """KVCM answered SERVER_NOT_LEADER: the cached leader is stale."""

    kind = "not_leader"


def status_to_error(target: str, status: RpcStatus, details: str) -> TransportError:
    """Map a failed gRPC status to our hierarchy (one place for both adapters)."""
    if status is RpcStatus.UNAVAILABLE:
        return Unavailable(target, details or "unavailable")
    if status is RpcStatus.DEADLINE_EXCEEDED:
        return DeadlineExceeded(target, details or "deadline exceeded")
    return RemoteError(target, details, status.value, f"grpc:{status.name}")
