"""Server side of the gRPC transport: raw-bytes unary handlers on pinned full method paths.

Used by the simulated peers and the sidecar. Handlers are synchronous and run on the
server's thread pool; a handler raises ``PeerAbort`` to end the call with a gRPC status
(the same convention as the in-memory adapter). Servers bind ``127.0.0.1:0`` by default
and report the port they got.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import trio

from router.targets import format_target
from router.transport.errors import PeerAbort

UnaryBytesHandler = Callable[[bytes, grpc.ServicerContext], bytes]


def _aborting(handler: UnaryBytesHandler) -> UnaryBytesHandler:
    def behaviour(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return handler(request, context)
        except PeerAbort as abort:
            context.abort(grpc.StatusCode[abort.status.name], abort.details)

    return behaviour


if TYPE_CHECKING:  # generic only in the stubs
    _GenericRpcHandler = grpc.GenericRpcHandler[bytes, bytes]
else:
    _GenericRpcHandler = grpc.GenericRpcHandler


class _RawMethodHandlers(_GenericRpcHandler):
    def __init__(self, routes: Mapping[str, UnaryBytesHandler]) -> None:
        for path in routes:
            if not (path.startswith("/") and path.count("/") == 2):
                raise ValueError(f"method path {path!r} is not a full '/package.Service/Method' path")
        # Identity (de)serializers: handlers see and return raw bytes.
        self._handlers = {
            path: grpc.unary_unary_rpc_method_handler(_aborting(h)) for path, h in routes.items()
        }

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        return self._handlers.get(handler_call_details.method)


def method_handlers(routes: Mapping[str, UnaryBytesHandler]) -> grpc.GenericRpcHandler[bytes, bytes]:
    """A generic handler serving ``routes`` (full method path → handler); other paths are UNIMPLEMENTED."""
    return _RawMethodHandlers(routes)


@dataclass(frozen=True, slots=True)
class GrpcServer:
    """A started server and the address it bound."""

    server: grpc.Server
    executor: ThreadPoolExecutor
    host: str
    port: int

    @property
    def target(self) -> str:
        return format_target(self.host, self.port)

    def stop(self) -> None:
        """Cancel in-flight RPCs and stop at once (does not wait for handler threads to return)."""
        self.server.stop(grace=None)
        self.executor.shutdown(wait=False)


def start_grpc_server(
    routes: Mapping[str, UnaryBytesHandler],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    credentials: grpc.ServerCredentials | None = None,
) -> GrpcServer:
    """Bind ``host:port`` (0 = any free port) and start serving ``routes`` (TLS with ``credentials``)."""
    executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvroute-grpc-server")
    # so_reuseport off: a second server must not silently share an explicit port.
    server = grpc.server(executor, handlers=[method_handlers(routes)], options=[("grpc.so_reuseport", 0)])
    address = format_target(host, port)
    try:
        if credentials is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        executor.shutdown(wait=False)
        raise OSError(f"cannot bind gRPC server to {format_target(host, port)}: {exc}") from exc
    server.start()
    return GrpcServer(server, executor, host, bound)


async def serve_grpc(
    routes: Mapping[str, UnaryBytesHandler],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 16,
    task_status: trio.TaskStatus[GrpcServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled: ``server = await nursery.start(serve_grpc, routes)``; see ``server.target``."""
    running = start_grpc_server(routes, host=host, port=port, max_workers=max_workers)
    try:
        task_status.started(running)
        await trio.sleep_forever()
    finally:
        running.stop()
