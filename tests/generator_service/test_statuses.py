"""What the service answers when an update does not go through, and which update it serves: the
service's own handler (`GeneratorServicer`) behind a real gRPC server on 127.0.0.1, on an engine
stand-in (`RecordingReplica`: no vLLM; the same rules meet the real engine in test_senders.py,
test_shared_weights.py and test_in_flight.py).

- A stall is transient: senders of an update that never come, a progressive shared file whose
  count stands still. It is answered ABORTED (the learner's pool then fails the replica and
  brings it back, instead of ending the run), naming what stalled, for how long, and that the
  served weights are unchanged.
"""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import numpy as np
import pytest

from generator_service.weights import TensorSpec
from jaxrlhf_wire.chunks import TensorSlice, iter_weight_chunks

pytestmark = pytest.mark.timeout(120)

TENSORS = {
    "model.embed_tokens.weight": np.arange(24, dtype=np.float32).reshape(6, 4),
    "model.norm.weight": np.ones(4, np.float32),
}
SPECS = {name: TensorSpec(name, value.shape, "F32") for name, value in TENSORS.items()}
SENDERS_TIMEOUT_S = 0.5


@pytest.fixture
def replica():
    from tests.generator_service.replicas import RecordingReplica

    replica = RecordingReplica(SPECS, senders_timeout=SENDERS_TIMEOUT_S)
    yield replica
    replica.stop()


@pytest.fixture
def client(replica):
    from jaxrlhf.rpc import GeneratorClient

    with GeneratorClient(replica.address) as client:
        yield client


def _parts(senders: int) -> list[list[tuple[str, TensorSlice]]]:
    """Each sender's rows of every tensor."""
    parts: list[list[tuple[str, TensorSlice]]] = [[] for _ in range(senders)]
    for name, value in TENSORS.items():
        cuts = [value.shape[0] * k // senders for k in range(senders + 1)]
        for sender in range(senders):
            start = (cuts[sender],) + (0,) * (value.ndim - 1)
            piece = value[cuts[sender] : cuts[sender + 1]]
            parts[sender].append((name, TensorSlice(value.shape, start, piece)))
    return parts


def _send(client, version: int, update_ids, num_senders: int | None = None) -> list:
    """Streams `version` from one sender per entry of `update_ids` (that sender's update_id),
    at once; each one's response or RpcError."""
    num_senders = len(update_ids) if num_senders is None else num_senders
    parts = _parts(num_senders)

    def stream(sender: int):
        chunks = iter_weight_chunks(parts[sender], version, 16, len(TENSORS),
                                    num_senders=num_senders, sender=sender,
                                    update_id=update_ids[sender])  # fmt: skip
        try:
            return client.stub.UpdateWeights(chunks, timeout=60)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(len(update_ids)) as pool:
        return list(pool.map(stream, range(len(update_ids))))


def _refused_alike(outcomes: list, code: grpc.StatusCode) -> str:
    """The one message every sender was refused with, `code`."""
    for outcome in outcomes:
        assert isinstance(outcome, grpc.RpcError), f"an update was taken: {outcome}"
        assert outcome.code() == code, (outcome.code(), outcome.details())
    (message,) = {outcome.details() for outcome in outcomes}
    return message


def test_senders_that_never_come_are_a_transient_refusal(client, replica):
    outcomes = _send(client, 1, ["u", "u"], num_senders=3)  # sender 2 never comes
    message = _refused_alike(outcomes, grpc.StatusCode.ABORTED)
    assert f"sender(s) [2] of 3 of policy_version 1 never came within {SENDERS_TIMEOUT_S:g} s" in (
        message)  # fmt: skip
    assert "the served weights are unchanged" in message and "may be sent again" in message
    assert (client.status().policy_version, replica.engine.swaps) == (0, [])


def test_a_progressive_count_that_stands_still_is_a_transient_refusal(client, replica):
    from jaxrlhf.rpc.shared import SharedWeightsFile

    specs = [(name, value.shape, value.dtype) for name, value in TENSORS.items()]
    with SharedWeightsFile(replica.engine.staging_dir, specs) as shared:
        shared.begin_progress()
        shared._count(1)  # then nothing
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            client.update_weights_shared(shared.request(1, progressive=True), timeout=60)
    assert time.monotonic() - started >= SENDERS_TIMEOUT_S
    assert refused.value.code() == grpc.StatusCode.ABORTED, refused.value.details()
    message = refused.value.details()
    assert f"gained no tensor for {SENDERS_TIMEOUT_S:g} s (1 of 2 written)" in message
    assert "the served weights are unchanged" in message and "may be sent again" in message
    assert (client.status().policy_version, replica.engine.swaps) == (0, [])
