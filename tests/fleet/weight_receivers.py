"""A test double of the generator service for the learner's weight transports: real gRPC servers
(grpc.aio, all on one event-loop thread of their own), one per "replica", on loopback ports.

It implements UpdateWeights as the real service's contract says, decoding every chunk with
protobuf's own parser (not the hand-written codec under test) and comparing the reassembled bytes
with the tensors the test sent; like the real service it refuses a version that is not newer
than the one it holds, at the first chunk. GetStatus reports a serving, draining replica. With a
`token`, the service's own `TokenAuthInterceptor` guards every call, and the metadata each call
carried is recorded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping

import grpc
import numpy as np

from generator_service.auth import TokenAuthInterceptor
from jaxrlhf_wire import AUTH_HEADER
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2


class WeightReceivers:
    """`count` loopback replicas expecting `tensors` (name -> array); `targets` to dial them."""

    def __init__(
        self, count: int, tensors: Mapping[str, np.ndarray], token: str | None = None
    ) -> None:
        self.expected = {name: np.ascontiguousarray(a).tobytes() for name, a in tensors.items()}
        self.versions = [0] * count  # the version each replica holds
        self.auth_headers: list[str | None] = []  # what each call carried, in arrival order
        self._token = token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="receivers")
        self._thread.start()
        ports = self._call(self._start(count))
        self.targets = [f"127.0.0.1:{port}" for port in ports]

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _start(self, count: int) -> list[int]:
        self._servers = [self._server(index) for index in range(count)]
        ports = [server.add_insecure_port("127.0.0.1:0") for server in self._servers]
        for server in self._servers:
            await server.start()
        return ports

    def _server(self, index: int) -> grpc.aio.Server:
        """Replica `index`'s server (not started)."""
        interceptors = [TokenAuthInterceptor(self._token)] if self._token else []
        server = grpc.aio.server(interceptors=interceptors)

        async def update_weights(chunks, context):
            return await self._update_weights(index, chunks, context)

        async def status(request, context):
            return await self._status(index, context)

        handlers = {
            "UpdateWeights": grpc.stream_unary_rpc_method_handler(
                update_weights,
                request_deserializer=generator_pb2.WeightChunk.FromString,
                response_serializer=generator_pb2.UpdateWeightsResponse.SerializeToString,
            ),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                status,
                request_deserializer=generator_pb2.GetStatusRequest.FromString,
                response_serializer=generator_pb2.GeneratorStatus.SerializeToString,
            ),
        }
        generic = grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
        server.add_generic_rpc_handlers((generic,))
        return server

    def _record(self, context) -> None:
        self.auth_headers.append(dict(context.invocation_metadata()).get(AUTH_HEADER))

    async def _status(self, index: int, context) -> generator_pb2.GeneratorStatus:
        self._record(context)
        return generator_pb2.GeneratorStatus(
            serving=True, policy_version=self.versions[index], swap_mode="drain"
        )

    async def _update_weights(
        self, index: int, chunks, context
    ) -> generator_pb2.UpdateWeightsResponse:
        self._record(context)
        held = self.versions[index]
        received: dict[str, bytearray] = {}
        version = None
        async for chunk in chunks:
            if chunk.policy_version <= held and not chunk.allow_rollback:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"policy_version {chunk.policy_version} is not newer than {held}",
                )
            version = chunk.policy_version
            data = received.setdefault(chunk.name, bytearray())
            if chunk.offset != len(data):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{chunk.name}: gap")
            data += chunk.data
        if received != self.expected:
            wrong = sorted(n for n in self.expected if received.get(n) != self.expected[n])
            await context.abort(grpc.StatusCode.DATA_LOSS, f"bytes differ: {wrong}")
        self.versions[index] = version
        return generator_pb2.UpdateWeightsResponse(
            policy_version=version,
            num_tensors=len(received),
            num_bytes=sum(len(data) for data in received.values()),
        )

    def close(self) -> None:
        for server in self._servers:
            self._call(server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def __enter__(self) -> WeightReceivers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
