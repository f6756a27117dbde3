"""GeneratorPool.publish_weights fanning one update out to several replicas: the suite's real
server beside stand-ins (replicas.py), a replica dying mid-stream, the learner's stream failing."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.generator_service.replicas import DyingReplica, RecordingReplica
from tests.generator_service.test_update_weights import greedy, perturbed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHUNK_BYTES = 1 << 14  # many chunks per tensor: the fan-out's queues fill and drain


@pytest.fixture(scope="module")
def recording_replica(tiny_llama):
    from generator_service.updates.tensors import expected_tensors

    replica = RecordingReplica(expected_tensors(tiny_llama))
    yield replica
    replica.stop()


def make_pool(*targets, retries=5, backoff_seconds=1.0):
    from jaxrlhf.fleet.pool import GeneratorPool

    return GeneratorPool(
        list(targets), retries=retries, backoff_seconds=backoff_seconds, chunk_bytes=CHUNK_BYTES
    )


def publish(pool, tensors: dict[str, np.ndarray], version: int):
    return pool.publish_weights(lambda: iter(tensors.items()), len(tensors), version)


def test_one_update_reaches_every_replica_intact(client, served, reference, recording_replica):
    new = perturbed(served.tensors, seed=200)
    version = served.policy_version + 1
    recording_replica.engine.policy_version = served.policy_version
    pool = make_pool(client.target, recording_replica.address)
    try:
        stats = publish(pool, new, version)
        served.record(version, new)
    finally:
        pool.close()
    assert stats.policy_version == version and stats.attempts == 1
    assert stats.num_bytes == sum(value.nbytes for value in new.values())
    assert client.status().policy_version == version
    tokens, versions = greedy(client)
    assert versions == {version}
    assert tokens == [reference.greedy(new, prompt, 12) for prompt in served.initial_prompts]
    received = recording_replica.received(version)
    assert list(received) == list(new)  # the learner's order, kept
    for name, value in new.items():
        assert received[name] == ("float32", value.tobytes()), name


def test_a_replica_dying_mid_stream_is_failed_by_name_while_the_others_swap(client, served):
    new = perturbed(served.tensors, seed=201)
    version = served.policy_version + 1
    dying = DyingReplica(after=3)
    pool = make_pool(client.target, dying.address, retries=1, backoff_seconds=0.1)
    started = time.monotonic()
    try:
        stats = publish(pool, new, version)
        served.record(version, new)
        states = {r.target: r.state for r in pool.replicas}
        errors = {r.target: r.error for r in pool.replicas}
        counted = pool.metrics()
    finally:
        pool.close()
        dying.stop()
    elapsed = time.monotonic() - started
    # The publish goes on with the live replica; the dead one is failed, by name.
    assert stats.swapped == (client.target,) and stats.failed == (dying.address,)
    assert states == {client.target: "live", dying.address: "failed"}
    assert "UNAVAILABLE" in errors[dying.address]
    assert counted["generators_live"] == 1 and counted["failures"] == 1
    assert counted["publish_retries"] == 1  # UNAVAILABLE once: sent again, then failed
    assert elapsed < 60
    status = client.status()
    assert status.policy_version == version and status.serving


def test_a_publish_that_no_replica_takes_is_an_error():
    from jaxrlhf.fleet.pool import GeneratorError

    dying = DyingReplica(after=2)
    pool = make_pool(dying.address, retries=1, backoff_seconds=0.1)
    tensors = {"w": np.zeros((256, 256), np.float32)}  # 16 chunks: it dies at the 2nd
    try:
        with pytest.raises(GeneratorError, match=r"reached none of 1 generator\(s\)"):
            publish(pool, tensors, 1)
        assert pool.metrics()["publish_retries"] == 1
    finally:
        pool.close()
        dying.stop()


def test_the_learner_stream_failing_cancels_every_replica_and_changes_nothing(
    client, served, recording_replica
):
    before = greedy(client)
    version = served.policy_version
    recording_replica.engine.policy_version = version
    swaps = len(recording_replica.engine.swaps)
    tensors = perturbed(served.tensors, seed=202)

    def broken_stream():
        for index, item in enumerate(tensors.items()):
            if index == len(tensors) // 2:
                raise ValueError("conversion failed on the learner")
            yield item

    pool = make_pool(client.target, recording_replica.address)
    try:
        with pytest.raises(ValueError, match="conversion failed on the learner"):
            pool.publish_weights(broken_stream, len(tensors), version + 1)
    finally:
        pool.close()
    assert client.status().policy_version == version
    assert len(recording_replica.engine.swaps) == swaps
    assert greedy(client) == before
