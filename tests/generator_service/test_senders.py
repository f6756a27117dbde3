"""Updates from several senders (a multi-process learner publishing with no gather) against the
real server: each sender streams its slices of the tensors, the server assembles one version.
Two and three senders swap in exactly the weights they carry; an overlap, a gap, a duplicate, a
missing sender and senders that disagree on the version are refused, every sender alike, and
the old weights keep serving the same greedy tokens."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
import numpy as np
import pytest

from jaxrlhf_wire.chunks import TensorSlice
from tests.generator_service.conftest import SENDERS_TIMEOUT_S
from tests.generator_service.test_update_weights import greedy, perturbed
from tests.generator_service.wire import chunk_messages

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def boxes(shape: tuple[int, ...], senders: int, turn: int) -> list[tuple[int, tuple, tuple]]:
    """(sender, start, extent) covering a tensor of `shape` once: a 2-D tensor's columns in
    halves, the second half's rows split among the remaining senders; a 1-D one in pieces.
    `turn` rotates which sender gets which box, so that every sender sends every kind."""
    if len(shape) == 2 and senders > 1:
        rows, cols = shape
        half = cols // 2
        out = [(0, (0, 0), (rows, half))]
        others = senders - 1
        cuts = [rows * k // others for k in range(others + 1)]
        out += [(1 + k, (cuts[k], half), (cuts[k + 1] - cuts[k], cols - half))
                for k in range(others)]  # fmt: skip
    else:
        cuts = [shape[0] * k // senders for k in range(senders + 1)]
        out = [(k, (cuts[k], *([0] * (len(shape) - 1))), (cuts[k + 1] - cuts[k], *shape[1:]))
               for k in range(senders)]  # fmt: skip
    return [((sender + turn) % senders, start, extent) for sender, start, extent in out]


def split(tensors: dict[str, np.ndarray], senders: int) -> list[list[tuple[str, TensorSlice]]]:
    """Each sender's slices of `tensors`, in the tensors' order."""
    parts: list[list[tuple[str, TensorSlice]]] = [[] for _ in range(senders)]
    for turn, (name, value) in enumerate(tensors.items()):
        for sender, start, extent in boxes(value.shape, senders, turn):
            index = tuple(slice(s, s + n) for s, n in zip(start, extent, strict=True))
            parts[sender].append((name, TensorSlice(value.shape, start, value[index])))
    return parts


def send(client, parts, versions, num_tensors, chunk_bytes=1 << 14, num_senders=None,
         update_ids=None):  # fmt: skip
    """Every sender's stream at once (one thread each); each one's response or RpcError.
    `update_ids`: each sender's WeightChunk.update_id (none: empty)."""
    num_senders = len(parts) if num_senders is None else num_senders
    update_ids = update_ids or [""] * len(parts)

    def stream(sender: int):
        chunks = chunk_messages(parts[sender], versions[sender], chunk_bytes, num_tensors,
                                    num_senders=num_senders, sender=sender,
                                    update_id=update_ids[sender])  # fmt: skip
        try:
            return client.stub.UpdateWeights(chunks, timeout=120)
        except grpc.RpcError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        return list(pool.map(stream, range(len(parts))))


@pytest.mark.parametrize("senders", [2, 3])
def test_senders_assemble_one_version(client, served, reference, senders):
    new = perturbed(served.tensors, seed=200 + senders)
    version = client.status().policy_version + 1
    parts = split(new, senders)
    assert all(parts), "every sender sends something"
    update_id = f"senders-{senders}"
    outcomes = send(client, parts, [version] * senders, len(new),
                    update_ids=[update_id] * senders)  # fmt: skip
    for outcome in outcomes:
        assert not isinstance(outcome, grpc.RpcError), outcome.details()
    served.record(version, new)
    assert client.status().update_id == update_id
    assert {o.policy_version for o in outcomes} == {version}
    # The same answer to every sender: all the bytes, of every sender.
    assert {o.num_bytes for o in outcomes} == {sum(v.nbytes for v in new.values())}
    assert len({o.seconds for o in outcomes}) == 1
    tokens, versions = greedy(client)
    assert versions == {version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in served.initial_prompts]


def _overlap(parts, version):
    name, piece = parts[0][0]
    start = tuple(s + 1 for s in piece.start)  # inside sender 0's first box, one row/col in
    index = tuple(slice(s, s + 1) for s in start)
    whole = np.zeros(piece.shape, piece.data.dtype)
    parts[1].append((name, TensorSlice(piece.shape, start, whole[index])))
    return parts, [version, version], None, None


def _gap(parts, version):
    parts[1].pop()  # sender 1's last box never comes: part of a tensor stays unsent
    return parts, [version, version], None, None


def _duplicate(parts, version):
    parts[1].append(parts[0][-1])  # sender 1 sends one of sender 0's boxes again
    return parts, [version, version], None, None


def _missing_sender(parts, version):
    return parts[:1], [version], 2, None  # announced as 2 senders; only sender 0 ever comes


def _version_mismatch(parts, version):
    return parts, [version, version + 1], None, None


def _update_id_mismatch(parts, version):
    return parts, [version, version], None, ["one update", "another update"]


REFUSED = {
    "overlap": (_overlap, grpc.StatusCode.INVALID_ARGUMENT, "overlaps the slice"),
    "gap": (_gap, grpc.StatusCode.DATA_LOSS, "incomplete"),
    "duplicate": (_duplicate, grpc.StatusCode.INVALID_ARGUMENT, "duplicated data"),
    # Transient: the learner's pool fails the replica and brings it back.
    "missing sender": (_missing_sender, grpc.StatusCode.ABORTED, "sender(s) [1] of 2"),
    "version mismatch": (_version_mismatch, grpc.StatusCode.INVALID_ARGUMENT, "disagree"),
    "update_id mismatch": (_update_id_mismatch, grpc.StatusCode.INVALID_ARGUMENT, "disagree"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_bad_multi_sender_update_is_refused_for_all_and_changes_nothing(client, served, case):
    build, code, message = REFUSED[case]
    before = greedy(client)
    version = client.status().policy_version
    parts, versions, num_senders, update_ids = build(
        split(perturbed(served.tensors, seed=210), 2), version + 1
    )
    started = time.monotonic()
    outcomes = send(client, parts, versions, len(served.tensors), num_senders=num_senders,
                    update_ids=update_ids)  # fmt: skip
    for outcome in outcomes:
        assert isinstance(outcome, grpc.RpcError), f"{case}: a sender's update was taken"
        assert outcome.code() == code, outcome.details()
        assert message in outcome.details()
    if case == "missing sender":
        assert time.monotonic() - started >= SENDERS_TIMEOUT_S * 0.9
    status = client.status()
    assert (status.policy_version, status.serving) == (version, True)
    assert greedy(client) == before
    # And the next update, from two senders, goes through.
    new = perturbed(served.tensors, seed=211)
    outcomes = send(client, split(new, 2), [version + 1] * 2, len(new))
    assert all(not isinstance(o, grpc.RpcError) for o in outcomes), outcomes
    served.record(version + 1, new)


def test_a_sender_cancelled_while_another_still_sends_refuses_the_update_for_both(client, served):
    """Sender 0 sends all of its part, then its call's deadline passes while sender 1's stream
    has not ended. The update is refused for both, even though sender 1's stream then ends
    complete (it was once swapped in then, with the update's lock already released), and the
    old weights keep serving."""
    before = greedy(client)
    version = client.status().policy_version
    new = perturbed(served.tensors, seed=213)
    parts = split(new, 2)
    first_answered = threading.Event()

    def chunks(sender):
        return chunk_messages(parts[sender], version + 1, 1 << 14, len(new), num_senders=2,
                                  sender=sender)  # fmt: skip

    def held_open():  # all of sender 1's chunks; the stream ends after sender 0 was answered
        yield from chunks(1)
        first_answered.wait(timeout=60)
        time.sleep(0.5)

    def call(sender, stream, timeout):
        try:
            return client.stub.UpdateWeights(stream, timeout=timeout)
        except grpc.RpcError as error:
            return error
        finally:
            if sender == 0:
                first_answered.set()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        second = pool.submit(call, 1, held_open(), 120)
        first = pool.submit(call, 0, chunks(0), 8)
        outcomes = [first.result(), second.result()]
    assert isinstance(outcomes[0], grpc.RpcError), outcomes[0]
    assert outcomes[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED, outcomes[0].details()
    assert isinstance(outcomes[1], grpc.RpcError), "the refused update was swapped in"
    assert outcomes[1].code() == grpc.StatusCode.ABORTED, outcomes[1].details()
    assert "sender 0's call was cancelled" in outcomes[1].details()
    status = client.status()
    assert (status.policy_version, status.serving) == (version, True)
    assert greedy(client) == before
    outcomes = send(client, split(new, 2), [version + 1] * 2, len(new))  # the next one goes in
    assert all(not isinstance(o, grpc.RpcError) for o in outcomes), outcomes
    served.record(version + 1, new)
