"""A replica is never trusted by the version it reports, and evaluations are placed by the
weights the fleet serves (issue 59, items 3 and 4).

A run killed after it published version `left` leaves its replicas serving that version. The
resumed run (`trainer.begin`, from a checkpoint at version 2) rolls them back to the
checkpoint's weights; replica B goes down during that rollback, keeps the killed run's weights,
and answers again later reporting `left`:

- the same version as the learner's (3): it was taken as live without an update, serving the
  killed run's weights under this run's number;
- a newer one (4): the learner's next publish was refused (FAILED_PRECONDITION) and the run
  ended with a GeneratorError.

Either way it must get the learner's weights (rollback allowed) before it serves a sample, and
the run goes on. The replicas are `FakeGenerator`s (no model); the learner is the real one on
the tiny Llama, so `begin` and the publisher run as in a run.

An evaluation between two publishes of a resumed run (`sync_every` 4, resumed at update 2)
measures the checkpoint's weights, which `begin` sent: 2 updates, not the 0 of the last publish
the schedule released; and a replica that rejoined meanwhile serves the learner's.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import grpc
import pytest
import transformers

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.rl.evaluator import Evaluator
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.trainer import begin
from jaxrlhf.sharding import make_mesh
from tests.generator_service.replicas import FakeGenerator
from tests.rl.test_learning import learning_config, target_task

pytestmark = pytest.mark.timeout(300)

CHECKPOINT_VERSION = 2  # the learner's version at the checkpoint the run resumes from


class FallingReplica(FakeGenerator):
    """A FakeGenerator that goes down at its next weight update once `falls` is set: the update
    ends UNAVAILABLE, its weights stay what they were, and it answers nothing (GetStatus
    included) until the test sets `dead` back to False."""

    falls = False

    def _update_weights(self, chunks, context):
        if self.falls:
            self.falls, self.dead = False, True
            context.abort(grpc.StatusCode.UNAVAILABLE, "the replica went down mid-update")
        return super()._update_weights(chunks, context)


def wait_for(condition, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def learner(tiny_llama, tmp_path_factory):
    config = learning_config(tmp_path_factory.mktemp("learner"), "rloo", 8, 1e-3)
    return Learner(config, tiny_llama, make_mesh(tuple(config.mesh.shape)))


def resumed_config(tmp_path, learner, sync_every: int, served: int):
    """The config of a run resuming from a checkpoint at update 2 (version 2), the last publish
    of its schedule being `served`; the checkpoint is written."""
    config = learning_config(tmp_path, "rloo", 8, 1e-3)
    config.num_mini_batches, config.sync_every = 0, sync_every
    config.max_staleness = max(1, sync_every - 1)
    config.rollout.samples_per_prompt, config.rollout.prompts_per_batch = 2, 4
    config.resume = True
    checkpointer = Checkpointer(tmp_path / "checkpoints", 2)
    meta = {"step": 2, "policy_version": CHECKPOINT_VERSION, "served_version": served,
            "base_version": 0, "seed": config.seed, "evaluated_at_start": {},
            "pending_rollouts": []}  # fmt: skip
    checkpointer.save(2, learner.state, meta, force=True)
    checkpointer.close()
    return config


def resume(config, learner, pool, tiny_llama, tmp_path):
    checkpointer = Checkpointer(tmp_path / "checkpoints", 2)
    try:
        return begin(config, learner, pool, tiny_llama, checkpointer, lambda message: None)
    finally:
        checkpointer.close()


@pytest.mark.parametrize(
    "left, path",
    [(3, "publish"), (3, "rejoin"), (4, "publish")],
    ids=["same-version-at-a-publish", "same-version-rejoin", "newer-version-at-a-publish"],
)
def test_a_replica_that_missed_the_resume_rollback_gets_the_weights_before_it_serves(
    left, path, learner, tiny_llama, tmp_path
):
    """B misses `begin`'s rollback to version 2 and answers again reporting `left`. It rejoins
    at the learner's next due publish of version 3 (`publish`), or, answering again only after
    it, at the next wait (`rejoin`: `Publisher.wait`'s publish of version 3 to rejoining
    replicas). It must take version 3 with an update of its own, and serve only after it."""
    config = resumed_config(tmp_path, learner, sync_every=1, served=CHECKPOINT_VERSION)
    a, b = FakeGenerator(version=left, tag=1.0), FallingReplica(version=left, tag=2.0)
    updates_at_call: list[int] = []
    b.hold = lambda tokens: updates_at_call.append(b.updates)
    pool = GeneratorPool([a.address, b.address], retries=1, backoff_seconds=0.05,
                         probe_interval=0.05, no_replica_timeout=30.0)  # fmt: skip
    try:
        b.falls = True
        publisher = resume(config, learner, pool, tiny_llama, tmp_path).publisher
        assert (a.version, a.updates, b.version, b.updates) == (2, 1, left, 0)
        if path == "publish":
            b.dead = False
            wait_for(pool.needs_weights)  # B answers again, reporting `left`
            publisher.after_update(config, None)  # version 3, due: to A and B
        else:
            publisher.after_update(config, None)  # version 3, to A alone (B is down)
            b.dead = False
            wait_for(pool.needs_weights)

            def poll(timeout: float) -> str:
                if pool.metrics()["generators_live"] < 2:
                    time.sleep(timeout)
                    raise TimeoutError
                return "both live"

            assert publisher.wait(poll) == "both live"
        samples = pool.generate([[5, 6], [7], [8, 9], [10]], {"n": 2, "max_tokens": 1})
        publisher.after_update(config, None)  # the run goes on: version 4, to both
    finally:
        pool.close()
        a.stop()
        b.stop()
    assert publisher.version == 4 and (a.version, b.version) == (4, 4)
    # B took version 3 from this run (the update A took), then 4.
    assert b.updates == 2 and b.update_id == a.update_id
    # It served nothing before that update: every call came after it, at version 3.
    assert updates_at_call and all(count >= 1 for count in updates_at_call)
    assert {s.policy_version for s in samples} == {3}
    assert {s.logprobs[0] for s in samples} == {1.0, 2.0}  # both replicas answered
    assert pool.metrics()["rejoins"] == 1


@pytest.mark.parametrize("rejoined", [False, True], ids=["resumed", "rejoined-meanwhile"])
def test_an_evaluation_after_a_resume_between_two_publishes_is_placed_by_the_served_weights(
    rejoined, learner, tiny_llama, tmp_path
):
    """Resumed at update 2 with `sync_every` 4 (the schedule's last publish: the start, version
    0), the fleet serves the checkpoint's weights (version 2, `begin`'s rollback) until the
    publish after update 4. The evaluation after update 3 measured 2 updates; with the only
    replica failed and back meanwhile, the learner's 3 (it rejoins with them). The one after
    update 6 measured 4."""
    config = resumed_config(tmp_path, learner, sync_every=4, served=0)
    config.eval.every = 3
    task = target_task(transformers.AutoTokenizer.from_pretrained(tiny_llama))
    replica = FakeGenerator(version=4)  # what the killed run left
    pool = GeneratorPool([replica.address], probe_interval=0.05, no_replica_timeout=30.0)
    try:
        publisher = resume(config, learner, pool, tiny_llama, tmp_path).publisher
        assert replica.version == CHECKPOINT_VERSION
        evaluator = Evaluator(config, task, publisher, None)
        publisher.after_update(config, None)  # update 3: not published
        if rejoined:
            pool.lifecycle.fail(pool.replicas[0], "Generate: UNAVAILABLE (a test's)")
        after_3 = evaluator.during(3)
        publisher.after_update(config, None)  # update 4: published
        publisher.after_update(config, None)  # update 5
        publisher.after_update(config, None)  # update 6
        after_6 = evaluator.during(6)
    finally:
        pool.close()
        replica.stop()
    assert "eval_accuracy" in after_3 and "eval_accuracy" in after_6
    assert after_3["evaluated_updates"] == (3 if rejoined else 2)
    assert after_6["evaluated_updates"] == 4


@pytest.mark.parametrize(
    "versions, placed",
    [
        (frozenset({7}), {"evaluated_updates": 2}),
        (frozenset({7, 8}), {"evaluated_updates": 2, "evaluated_updates_newest": 3}),
        (frozenset(), {"evaluated_updates": 1}),
    ],
    ids=["one-version", "mixed", "none-generated"],
)
def test_an_evaluation_is_placed_by_the_versions_of_its_responses(versions, placed):
    """Base 5, the schedule's last publish 6: responses of 7 measured 2 updates; of 7 and 8 (a
    replica rejoined between two publishes with the learner's), the oldest, naming the newest;
    none generated, the schedule's."""
    cfg = SimpleNamespace(eval=SimpleNamespace(test=False))
    task = SimpleNamespace(verifiable=True, eval_prompts=[])
    publisher = SimpleNamespace(base_version=5, served=6)
    assert Evaluator(cfg, task, publisher, None).placed(versions) == placed
