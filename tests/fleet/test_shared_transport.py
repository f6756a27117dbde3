"""The shared-file transport against the real service's handler (`GeneratorServicer` on a real
gRPC server on 127.0.0.1; its engine replaced by a stub that reads what the file holds): a
learner on this host swaps the file in; the same call, seen by the handler as coming from a peer
off this host, is refused, since the file it names is not in reach of a remote peer.

No traffic leaves loopback: the remote peer is the handler's view of the call (a context whose
`peer()` names a documentation address, TEST-NET-3), not a connection from another address.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from generator_service.engine import SwapTimes
from generator_service.server import GeneratorServicer, add_generator_service
from generator_service.updates.adapter import update_specs
from generator_service.updates.tensors import TensorSpec
from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.fleet.transport import SharedFileTransport, WeightUpdate

REMOTE_PEER = "ipv4:203.0.113.9:40000"


class SeenFrom:
    """A call's server context whose peer is `peer`; everything else is the real context's."""

    def __init__(self, context, peer: str) -> None:
        self._context, self._peer = context, peer

    def peer(self) -> str:
        return self._peer

    def __getattr__(self, name):
        return getattr(self._context, name)


class ServicerSeenFromElsewhere(GeneratorServicer):
    """The real handler, told that the shared-file call came from `REMOTE_PEER` once armed."""

    remote = False

    async def UpdateWeightsShared(self, request, context):
        if self.remote:
            context = SeenFrom(context, REMOTE_PEER)
        return await super().UpdateWeightsShared(request, context)


class StubEngine:
    """What `UpdateWeightsShared` asks of the engine; `swap_weights` records the tensors it was
    pointed at, read from the learner's file."""

    def __init__(self, update_dir: str, tensors: dict[str, np.ndarray]) -> None:
        self.update_dir = update_dir
        self.weight_specs = {
            name: TensorSpec(name, tuple(array.shape), "F32") for name, array in tensors.items()
        }
        self.weight_specs_error = ""
        self.policy_version = 0
        self.serving = True
        self.update_id = ""
        self.config = SimpleNamespace(lora=False)  # a full-weights server
        self.swapped: list[tuple[int, dict[str, np.ndarray]]] = []

    def update_specs(self, lora) -> dict[str, TensorSpec]:
        """The tensors an update must carry (the engine's: a full-weights server's)."""
        return update_specs(self.weight_specs, lora, max_lora_rank=0)

    async def swap_weights(self, path, preloaded, policy_version, allow_rollback=False,
                           preload_id=0, update_id="", lora=None) -> SwapTimes:  # fmt: skip
        read = {
            t.name: np.fromfile(path, np.float32, int(np.prod(t.shape)), offset=t.position)
            .reshape(t.shape)
            for t in preloaded
        }  # fmt: skip
        self.swapped.append((policy_version, read))
        self.policy_version, self.update_id = policy_version, update_id
        return SwapTimes()


class ServiceOnAllInterfaces:
    """The service's handler on a real aio server on 127.0.0.1, on a loop of its own."""

    def __init__(self, engine: StubEngine) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="service")
        self._thread.start()
        self.port = self._call(self._start(engine))

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)

    async def _start(self, engine: StubEngine) -> int:
        from grpc_health.v1 import health

        self._server = grpc.aio.server()
        self.servicer = ServicerSeenFromElsewhere(engine, health.aio.HealthServicer())
        add_generator_service(self.servicer, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def close(self) -> None:
        self._call(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


@pytest.mark.timeout(60)
def test_the_service_takes_a_shared_file_from_this_host_only(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.normal(size=(8, 4)).astype(np.float32),
        "model.norm.weight": rng.normal(size=(4,)).astype(np.float32),
    }
    engine = StubEngine(str(tmp_path), tensors)
    service = ServiceOnAllInterfaces(engine)
    transport = SharedFileTransport(
        str(tmp_path), [(n, a.shape, a.dtype) for n, a in tensors.items()]
    )
    client = GeneratorClient(f"127.0.0.1:{service.port}")
    try:
        service.servicer.remote = True
        update = WeightUpdate(1, len(tensors))
        (refused,) = transport.send([client], lambda: iter(tensors.items()), update, 20.0).values()
        assert engine.swapped == []
        # The same file, the same version, from this host: the layout was fine, the peer was not.
        service.servicer.remote = False
        (swapped,) = transport.send([client], None, update, 20.0).values()
    finally:
        transport.close()
        client.close()
        service.close()
    assert isinstance(refused, grpc.RpcError), refused
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only accepted from this host" in refused.details()
    assert REMOTE_PEER in refused.details()
    assert swapped.policy_version == 1 and swapped.num_tensors == 2
    ((version, read),) = engine.swapped
    assert version == 1 and read.keys() == tensors.keys()
    for name, array in tensors.items():
        np.testing.assert_array_equal(read[name], array)
