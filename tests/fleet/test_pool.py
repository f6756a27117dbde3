"""GeneratorPool without a vLLM engine: failover keeps every (prompt, sample) exactly once, the
`min_version` filter, a replica left NOT_SERVING by a failed swap rejoining, and the learner
rejoining replicas between two publishes.

The replicas are gRPC servers on 127.0.0.1 in this process (tests/generator_service/replicas.py):
`FakeGenerator` answers Generate (and dies part-way when told), `RecordingReplica` runs the
service's real UpdateWeights/GetStatus code on an engine stand-in that records the bytes.
"""

from __future__ import annotations

import collections
import re
import threading
import time

import numpy as np
import pytest

from jaxrlhf.fleet.lifecycle import FAILED, REJOINING, Lifecycle, Replica
from jaxrlhf.fleet.pool import GeneratorError, GeneratorPool
from jaxrlhf.fleet.rpc.client import GeneratorClient
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.rollout import check_complete
from tests.generator_service.replicas import FakeGenerator, RecordingReplica

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[3, 4], [5], [6, 7, 8], [9], [10, 11], [12]]


def sample(prompt: int, k: int) -> Sample:
    return Sample(prompt, k, (1,), (0.0,), "length", 0)


def full_batch(prompts: int, n: int) -> list[Sample]:
    return [sample(p, k) for p in range(prompts) for k in range(n)]


def test_check_complete_accepts_every_prompt_with_its_n_samples_in_any_order():
    check_complete(0, full_batch(3, 2)[::-1], prompts=3, n=2)


@pytest.mark.parametrize(
    ("samples", "counts"),
    [
        (full_batch(3, 2)[:-1], "1 (prompt, sample) missing, 0 twice and 0 unknown"),
        (full_batch(3, 2) + [sample(1, 0)], "0 (prompt, sample) missing, 1 twice and 0 unknown"),
        (
            full_batch(3, 2) + [sample(3, 0), sample(0, 2)],
            "0 (prompt, sample) missing, 0 twice and 2 unknown",
        ),
        # A duplicate standing in for a lost sample: as many samples as expected.
        (full_batch(3, 2)[:-1] + [sample(0, 0)], "1 (prompt, sample) missing, 1 twice"),
    ],
    ids=["missing", "duplicated", "unknown", "duplicate-for-missing"],
)
def test_check_complete_names_what_is_off(samples, counts):
    with pytest.raises(RuntimeError, match=rf"batch 7 came back with {re.escape(counts)}"):
        check_complete(7, samples, prompts=3, n=2)


@pytest.fixture
def fakes():
    """FakeGenerators built from the test's parameters; stopped after it."""
    made: list[FakeGenerator] = []

    def make(**options) -> FakeGenerator:
        made.append(FakeGenerator(**options))
        return made[-1]

    yield make
    for fake in made:
        fake.stop()


def make_pool(*targets, **options) -> GeneratorPool:
    pool = GeneratorPool(list(targets), probe_interval=0.1, **options)
    pool.wait_until_serving(timeout=30)
    return pool


def test_generate_loses_and_doubles_no_sample_when_replicas_die_mid_call(fakes):
    # 6 prompts x 2 samples over 3 replicas, 2 prompts each, sent sample-major. A dies after 3
    # completions: its first prompt complete, its second with sample 0 only. B dies after 1:
    # its first prompt with sample 0 only, its second with none. C answers all.
    a, b, c = fakes(tag=1.0, die_after=3), fakes(tag=2.0, die_after=1), fakes(tag=3.0)
    pool = make_pool(a.address, b.address, c.address)
    try:
        samples = pool.generate(PROMPTS, dict(n=2, max_tokens=1))
        counts = pool.metrics()
    finally:
        pool.close()
    assert a.dead and b.dead and not c.dead
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (p, k) for p in range(len(PROMPTS)) for k in range(2)
    ]
    for s in samples:  # each sample is its own prompt's
        assert s.token_ids == (*PROMPTS[s.prompt_index], s.sample_index)
    # Prompt 0, finished by A before it died, is kept; a prompt left unfinished is regenerated
    # whole by the replica still live (its partial samples dropped, never mixed in).
    answered_by = {p: {s.logprobs[0] for s in samples if s.prompt_index == p} for p in range(6)}
    assert answered_by == {0: {1.0}, 1: {3.0}, 2: {3.0}, 3: {3.0}, 4: {3.0}, 5: {3.0}}
    assert c.calls == [["0", "1"], ["0", "1", "2"]]  # its share, then the three failed over
    assert (counts["failures"], counts["failovers"], counts["generators_live"]) == (2, 1, 1)


def test_generate_gives_no_work_to_a_replica_serving_an_older_version(fakes):
    old, new = fakes(version=1, tag=1.0), fakes(version=2, tag=2.0)
    pool = make_pool(old.address, new.address)
    try:
        samples = pool.generate(PROMPTS, dict(n=2, max_tokens=1), min_version=2)
        unfiltered = pool.generate(PROMPTS, dict(n=2, max_tokens=1))
    finally:
        pool.close()
    assert old.calls == [[str(i) for i in range(3)]]  # the unfiltered call only, half the prompts
    assert {s.policy_version for s in samples} == {2} and {s.logprobs[0] for s in samples} == {2.0}
    assert {s.policy_version for s in unfiltered} == {1, 2}


def test_generate_waits_for_a_new_enough_replica_and_then_says_which_are_too_old(fakes):
    old = fakes(version=1)
    pool = make_pool(old.address, no_replica_timeout=0.5)
    admitted = []
    try:
        with pytest.raises(GeneratorError, match=r"no generator replica live at version >= 2 "
                           r"for 0\.5 s: .*live, version 1"):  # fmt: skip
            pool.generate(PROMPTS, dict(n=1, max_tokens=1), min_version=2,
                          on_admitted=lambda: admitted.append(True))  # fmt: skip
    finally:
        pool.close()
    assert old.calls == []
    # No replica could take the batch: it is "admitted" at once, so that the learner (which
    # waits for admission before it publishes) can publish or bring a replica back meanwhile.
    assert admitted == [True]


@pytest.fixture
def recording(tiny_llama):
    from generator_service.updates.tensors import expected_tensors

    replica = RecordingReplica(expected_tensors(tiny_llama))
    yield replica
    replica.stop()


def wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def model_tensors(tiny_llama) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(tiny_llama / "model.safetensors")


def test_a_replica_left_not_serving_by_a_failed_swap_rejoins_with_the_full_weights(
    recording, tiny_llama
):
    tensors = model_tensors(tiny_llama)
    recording.engine.fail_swaps = 1
    pool = make_pool(recording.address, transport="stream", retries=0)
    try:
        # Its only replica fails the swap: not an error, since it still answers (it gets the
        # weights when it rejoins) ...
        stats = pool.publish_weights(lambda: iter(tensors.items()), len(tensors), 1)
        assert stats.swapped == () and not recording.engine.serving
        # ... which it does once the prober sees it answer NOT_SERVING: it then takes the full
        # update of the current version, and serves again.
        wait_for(pool.needs_weights)
        pool.publish_weights(lambda: iter(tensors.items()), len(tensors), 1, rejoining_only=True)
        counts = pool.metrics()
    finally:
        pool.close()
    assert recording.engine.serving and recording.engine.policy_version == 1
    assert {name: data for name, (_, data) in recording.received(1).items()} == {
        name: array.tobytes() for name, array in tensors.items()
    }
    assert (counts["failures"], counts["rejoins"], counts["generators_live"]) == (1, 1, 1)


class WaitingProducer:
    """The rollout producer as the loop sees it: a batch (`next`) or a checkpoint's batches
    (`snapshot`) come once a replica is live (as `generate` waits for one); gives up after
    `limit` seconds of polling."""

    def __init__(self, pool: GeneratorPool, limit: float = 10.0):
        self.pool, self.deadline = pool, time.monotonic() + limit

    def next(self, timeout: float):
        """An empty batch, once generation resumed."""
        from jaxrlhf.rl.rollout import Rollout

        return Rollout(0, [], [], 0, 0.0) if self.generated(timeout) else None

    def snapshot(self, version: int, timeout: float):
        return self.generated(timeout)

    def generated(self, timeout: float | None = None):
        until = time.monotonic() + (timeout if timeout is not None else 3600)
        while time.monotonic() < until:
            if self.pool.metrics()["generators_live"]:
                return "generated"
            if time.monotonic() > self.deadline:
                raise RuntimeError("no replica came back: generation cannot resume")
            time.sleep(0.05)
        raise TimeoutError


@pytest.mark.parametrize("waiting_for", ["batch", "checkpoint", "evaluation"])
def test_replicas_rejoin_between_two_publishes_with_the_learners_weights_and_version(
    recording, tiny_llama, waiting_for
):
    # Whatever the learner waits for that needs generation (the next batch, the batches a
    # checkpoint holds, an evaluation's responses) rejoins replicas meanwhile: only the learner
    # publishes, so waiting without rejoining was a deadlock (seen in the soak: a checkpoint
    # while every replica was down).
    import jax

    from configs.tiny import get_config
    from jaxrlhf.models import iter_hf_tensors
    from jaxrlhf.rl.learner import Learner
    from jaxrlhf.rl.publisher import Publisher
    from jaxrlhf.rl.trainer import checkpoint_batches, next_batch
    from jaxrlhf.sharding import make_mesh

    config = get_config()
    config.sync_every, config.max_staleness = 2, 1
    learner = Learner(config, tiny_llama, make_mesh(tuple(config.mesh.shape)))
    dtype = config.model.dtype
    pool = make_pool(recording.address, transport="stream", retries=0)
    try:
        # The last publish, version 3, fails on the only replica (which is left NOT_SERVING) ...
        recording.engine.fail_swaps = 1
        publisher = Publisher(learner, pool, dtype, base_version=0, version=3, served=3)
        publisher.send()
        # ... and the learner takes one more update before it answers again: version 4, not
        # published (sync_every = 2). Its weights are no longer those of version 3.
        policy = jax.tree.map(lambda p: p * 1.5, learner.state.params["policy"])
        learner.state = learner.state.replace(params={**learner.state.params, "policy": policy})
        publisher.version = 4
        producer = WaitingProducer(pool)
        if waiting_for == "batch":
            got = "generated" if next_batch(publisher, producer).batch_index == 0 else None
        elif waiting_for == "checkpoint":
            got = checkpoint_batches(publisher, producer)
        else:
            got = publisher.in_background(producer.generated)
        assert got == "generated"
    finally:
        pool.close()
    params = learner.state.params["policy"]
    expected = {name: np.asarray(t).tobytes() for name, t in
                iter_hf_tensors(learner.policy, params, dtype)}  # fmt: skip
    assert recording.engine.policy_version == 4 and recording.engine.serving
    assert {name: data for name, (_, data) in recording.received(4).items()} == expected


def test_the_lifecycle_restarts_a_dead_replica_of_the_run_within_its_bound(fakes):
    """Probed dead, a replica the run started is restarted (after its back-off of 5 s), answers
    at its new address and waits for the weights; once it took them it is live. A replica at its
    restart bound that does not answer can no longer come back."""
    dead = fakes()
    address = dead.address
    dead.stop()
    fresh = fakes()
    restarted, logs = [], []
    counters: collections.Counter[str] = collections.Counter()

    def restart(target: str) -> str:
        restarted.append(target)
        return fresh.address

    replica = Replica(GeneratorClient(address), version=3)
    lifecycle = Lifecycle([replica], threading.Condition(), counters, GeneratorClient,
                          status_timeout=1.0, probe_interval=0.1, restart=restart,
                          max_restarts=1, log=logs.append)  # fmt: skip
    try:
        lifecycle.fail(replica, "Generate: UNAVAILABLE")
        assert lifecycle.may_come_back()  # it may still be restarted
        wait_for(lambda: replica.state == REJOINING)
        assert replica.version == 0  # what the fresh replica serves, as it answered
        lifecycle.join(replica, 4)
        fresh.stop()
        lifecycle.fail(replica, "Generate: UNAVAILABLE")
        time.sleep(0.5)
        assert not lifecycle.may_come_back()  # restarted once already, and silent
    finally:
        lifecycle.close()
    assert restarted == [address] and replica.target == fresh.address
    assert (replica.state, replica.version) == (FAILED, 4)
    assert dict(counters) == {"failures": 2, "restarts": 1, "rejoins": 1}
    assert any("restart 1 of at most 1" in line for line in logs)


def test_a_replica_that_answers_again_serving_another_model_does_not_rejoin(fakes):
    """A LoRA run's adapters apply to one base: a replica that comes back serving another
    model folder (or dtype, swap mode, largest adapter rank) than the pool saw at the start
    stays failed, said once in the log; back on its model, it rejoins."""
    replica_server = fakes()
    replica_server.model = "/models/base"
    pool = GeneratorPool([replica_server.address], probe_interval=0.1, log=(logs := []).append)
    try:
        pool.wait_until_serving()
        (replica,) = pool.replicas
        assert replica.identity == ("/models/base", "", "drain", 0)
        pool.lifecycle.fail(replica, "Generate: UNAVAILABLE")
        replica_server.model = "/models/other"
        time.sleep(0.5)  # several probes
        assert replica.state == FAILED
        assert sum("does not rejoin" in line for line in logs) == 1
        assert "/models/other" in next(line for line in logs if "does not rejoin" in line)
        replica_server.model = "/models/base"
        wait_for(lambda: replica.state == REJOINING)
    finally:
        pool.close()
