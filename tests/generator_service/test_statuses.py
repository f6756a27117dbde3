"""What the service answers when an update does not go through, and which update it serves: the
service's own handler (`GeneratorServicer`) behind a real gRPC server on 127.0.0.1, on an engine
stand-in (`RecordingReplica`: no vLLM; the same rules meet the real engine in test_senders.py,
test_shared_weights.py and test_in_flight.py).

- A stall is transient: senders of an update that never come, a progressive shared file whose
  count stands still. It is answered ABORTED (the learner's pool then fails the replica and
  brings it back, instead of ending the run), naming what stalled, for how long, and that the
  served weights are unchanged.
- An unexpected failure in the server answers every sender of the update alike, INTERNAL, with
  a message that names the problem and none of the server's internals (exception classes,
  their messages, paths): those go to the server's log.
- GetStatus.update_id names the update that put the served weights in place: empty for the
  weights the server started with, after an update sent without one, and after a swap that
  left the weights unknown; a refused update leaves it as it was.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import grpc
import numpy as np
import pytest

from generator_service import failpoints
from generator_service.updates.tensors import TensorSpec
from jaxrlhf_wire.chunks import TensorSlice
from tests.generator_service.wire import chunk_messages

pytestmark = pytest.mark.timeout(120)

TENSORS = {
    "model.embed_tokens.weight": np.arange(24, dtype=np.float32).reshape(6, 4),
    "model.norm.weight": np.ones(4, np.float32),
}
SPECS = {name: TensorSpec(name, value.shape, "F32") for name, value in TENSORS.items()}
SENDERS_TIMEOUT_S = 0.5
# What a status must not show of the server: an exception's class, a failpoint's message, a
# path of the server's.
INTERNALS = re.compile(r"\b[A-Z]\w*(Error|Exception)\b|failpoint|Traceback|/tmp/|/dev/shm/")


@pytest.fixture
def replica():
    from tests.generator_service.replicas import RecordingReplica

    replica = RecordingReplica(SPECS, senders_timeout=SENDERS_TIMEOUT_S)
    yield replica
    replica.stop()


@pytest.fixture
def client(replica):
    from jaxrlhf.fleet.rpc import GeneratorClient

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
        chunks = chunk_messages(parts[sender], version, 16, len(TENSORS),
                                    num_senders=num_senders, sender=sender,
                                    update_id=update_ids[sender])  # fmt: skip
        try:
            return client.stub.UpdateWeights(chunks, timeout=60)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(len(update_ids)) as pool:
        return list(pool.map(stream, range(len(update_ids))))


def _taken(outcomes: list) -> None:
    for outcome in outcomes:
        assert not isinstance(outcome, grpc.RpcError), outcome.details()


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
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    specs = [(name, value.shape, value.dtype) for name, value in TENSORS.items()]
    with SharedWeightsFile(replica.engine.update_dir, specs) as shared:
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


def test_an_unexpected_failure_answers_every_sender_alike_without_internals(
    client, replica, tmp_path, monkeypatch
):
    """A failpoint raises where nothing is expected to (in the last sender's call, before the
    swap): before, that sender's call ended UNKNOWN ("Unexpected <class '...FailpointError'>")
    and the other's INTERNAL ("FailpointError: failpoint update_weights 1 fail")."""
    armed = tmp_path / "failpoints"
    armed.write_text("update_weights 1 fail\n")
    monkeypatch.setenv(failpoints.ENV, str(armed))
    message = _refused_alike(_send(client, 1, ["u", "u"]), grpc.StatusCode.INTERNAL)
    assert not armed.exists(), "the failpoint never fired"
    assert not INTERNALS.search(message), message
    assert "internal error" in message and "server's log" in message
    assert "the served weights (policy_version 0) are unchanged" in message
    status = client.status()
    assert (status.policy_version, status.serving) == (0, True)
    _taken(_send(client, 1, ["u", "u"]))  # and the next update goes through
    assert client.status().policy_version == 1


def _shared_update(client, replica, version: int, update_id: str):
    from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile

    specs = [(name, value.shape, value.dtype) for name, value in TENSORS.items()]
    with SharedWeightsFile(replica.engine.update_dir, specs) as shared:
        shared.write(TENSORS.items())
        request = shared.request(version)
        request.update_id = update_id
        return client.update_weights_shared(request, timeout=60)


def test_the_status_names_the_update_that_put_the_served_weights_in_place(client, replica):
    def served() -> tuple[int, str]:
        status = client.status()
        return status.policy_version, status.update_id

    assert served() == (0, "")  # the weights it started with
    _taken(_send(client, 1, ["one"]))
    assert served() == (1, "one")
    _taken(_send(client, 2, ["two", "two", "two"]))  # three senders, one update
    assert served() == (2, "two")
    _shared_update(client, replica, 3, "three")
    assert served() == (3, "three")
    _taken(_send(client, 4, [""]))  # sent without one
    assert served() == (4, "")
    _taken(_send(client, 5, ["five"]))
    refused = _send(client, 5, ["stale"])[0]  # not newer: refused, nothing changes
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert served() == (5, "five")
    replica.engine.fail_swaps = 1  # the next swap fails half-way: the weights are unknown
    failed = _send(client, 6, ["six"])[0]
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert not client.status().serving and served() == (5, "")
    _taken(_send(client, 6, ["six again"]))
    assert served() == (6, "six again") and client.status().serving


def test_an_update_whose_streams_or_chunks_disagree_on_its_id_is_refused(client):
    message = _refused_alike(_send(client, 1, ["a", "b"]), grpc.StatusCode.INVALID_ARGUMENT)
    assert "update_id 'b'" in message and "its senders disagree" in message
    chunks = list(chunk_messages(TENSORS, 1, 16, update_id="a"))
    chunks[-1].update_id = "b"
    with pytest.raises(grpc.RpcError) as refused:
        client.stub.UpdateWeights(iter(chunks), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "update_id 'b'" in refused.value.details()
    assert client.status().policy_version == 0


def test_a_generate_call_failing_unexpectedly_names_no_internals():
    """What the engine raised that nobody expected: the call ends INTERNAL without its class or
    message (before: "RuntimeError: ... /dev/shm/..."); a request the engine refuses keeps the
    engine's reason, which is about the request."""
    from vllm.exceptions import VLLMClientError

    from generator_service.calls import _first_error

    unexpected = _first_error(RuntimeError("mmap of /dev/shm/jaxrlhf-weights-1-x.bin failed"))
    assert unexpected.code == grpc.StatusCode.INTERNAL
    assert not INTERNALS.search(unexpected.message), unexpected.message
    assert "internal error" in unexpected.message and "server's log" in unexpected.message
    refused = _first_error(ExceptionGroup("call", [VLLMClientError("temperature 2.5 > 2")]))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature 2.5 > 2" in refused.message
