"""The streamed weight transport against loopback test doubles (`weight_receivers`): a broadcast
to more replicas than any fixed call pool, and no thread left behind by a refused update."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.fleet.transport import StreamTransport, WeightUpdate
from tests.fleet.weight_receivers import WeightReceivers

# Many more chunks than a replica's feed holds ahead (4), so that every call must keep reading.
CHUNK_BYTES = 1024


def random_tensors(count: int, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"model.layers.{i}.w": rng.normal(size=shape).astype(np.float32) for i in range(count)}


def send(transport, clients, tensors, version: int, timeout: float) -> dict:
    return transport.send(
        clients, lambda: iter(tensors.items()), WeightUpdate(version, len(tensors)), timeout
    )


@pytest.mark.timeout(120)
def test_a_broadcast_to_24_replicas_delivers_every_byte_to_each():
    """The stream once ran 16 calls at a time: the 17th replica's feed filled, the producer
    waited on it and the 16 running calls waited on the producer until their deadline."""
    tensors = random_tensors(4, (32, 64))  # 32 KiB: 32 chunks
    total = sum(a.nbytes for a in tensors.values())
    transport = StreamTransport(chunk_bytes=CHUNK_BYTES)
    with WeightReceivers(24, tensors) as receivers:
        clients = [GeneratorClient(target) for target in receivers.targets]
        try:
            outcomes = send(transport, clients, tensors, 7, timeout=20.0)
        finally:
            transport.close()
            for client in clients:
                client.close()
    failed = {c.target: o.code().name for c, o in outcomes.items() if isinstance(o, grpc.RpcError)}
    assert not failed, f"{len(failed)} of 24 replicas failed: {failed}"
    assert list(outcomes) == clients
    assert {(o.policy_version, o.num_tensors, o.num_bytes) for o in outcomes.values()} == {
        (7, 4, total)
    }


def wait_for_thread_count(count: int, timeout: float) -> int:
    """Polls until at most `count` threads run or `timeout` passes; the number running then."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


class EndSignallingClient(GeneratorClient):
    """Sets `ended` once an UpdateWeights call returned or raised."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self.ended = threading.Event()

    def update_weights_encoded(self, chunks, timeout=None):
        try:
            return super().update_weights_encoded(chunks, timeout)
        finally:
            self.ended.set()


@pytest.mark.timeout(120)
def test_refused_updates_leave_no_thread_behind():
    """A replica that refuses at the first chunk ends its call while gRPC's request thread waits
    in the feed for a chunk the learner is still converting (held here until the call ended);
    the feed once dropped what came next without waking that thread."""
    tensors = random_tensors(64, (16, 16))  # 64 tensors of one chunk each

    def converted_after_the_call_ended():
        items = iter(tensors.items())
        yield next(items)
        assert client.ended.wait(timeout=20.0)
        yield from items

    transport = StreamTransport(chunk_bytes=CHUNK_BYTES)
    with WeightReceivers(1, tensors) as receivers:
        client = EndSignallingClient(receivers.targets[0])
        try:
            # gRPC's own threads for this channel start now, not in the count below.
            (accepted,) = send(transport, [client], tensors, 1, timeout=20.0).values()
            assert accepted.policy_version == 1
            before = threading.active_count()
            for _ in range(20):  # version 1 again: not newer, refused at its first chunk
                client.ended.clear()
                outcomes = transport.send(
                    [client], converted_after_the_call_ended, WeightUpdate(1, len(tensors)), 20.0
                )
                (refused,) = outcomes.values()
                assert isinstance(refused, grpc.RpcError)
                assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
            after = wait_for_thread_count(before, timeout=10.0)
        finally:
            transport.close()
            client.close()
    # (Fewer is fine: a thread of the accepted update may still have been ending at `before`.)
    assert after <= before, [t.name for t in threading.enumerate()]
