"""Who may call the service: loopback by default, a shared secret (and optional TLS) beyond it.

The token travels as `authorization: Bearer <token>` call metadata. Health checks stay open so
that an orchestrator can probe the server without holding the secret; everything else, server
reflection included, needs the token whenever one is configured.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

import grpc

from jaxrlhf_wire import AUTH_HEADER
from jaxrlhf_wire.hosts import is_loopback_host as is_loopback  # the one loopback rule

AUTH_TOKEN_ENV = "JAXRLHF_GENERATOR_AUTH_TOKEN"
_OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


def resolve_auth_token(host: str, cli_token: str | None) -> str | None:
    """The token to enforce: the flag, else the environment; required off loopback."""
    token = cli_token or os.environ.get(AUTH_TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        raise ValueError(
            f"binding {host} (not loopback) requires a shared secret: pass --auth-token or set "
            f"{AUTH_TOKEN_ENV}"
        )
    return token


def server_credentials(
    cert_path: str | None, key_path: str | None
) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files, or None for plaintext; both paths or neither."""
    if not cert_path and not key_path:
        return None
    if not (cert_path and key_path):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    with open(key_path, "rb") as key_file, open(cert_path, "rb") as cert_file:
        return grpc.ssl_server_credentials([(key_file.read(), cert_file.read())])


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that answers UNAUTHENTICATED."""

    async def abort(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_streaming(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kwargs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(abort, **kwargs)


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` (constant-time comparison)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_METHOD_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        supplied = metadata.get(AUTH_HEADER)
        if supplied is None:
            return _deny(handler, f"missing '{AUTH_HEADER}: Bearer <token>' metadata")
        if isinstance(supplied, str):
            supplied = supplied.encode()
        if not hmac.compare_digest(supplied, self._expected):
            return _deny(handler, "wrong auth token")
        return handler
