"""Server-side decoding of requests (the mirror of router.wire.decode's client side)."""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from router.transport.errors import PeerAbort, RpcStatus

MessageT = TypeVar("MessageT", bound=Message)


def parse_request(message_type: type[MessageT], data: bytes) -> MessageT:
    """Parse a request or end the call with INVALID_ARGUMENT naming the message."""
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise PeerAbort(RpcStatus.INVALID_ARGUMENT, f"{message_type.__name__}: undecodable ({exc})") from exc
    return msg
