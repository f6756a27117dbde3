"""A resumed run samples only from weights of its own history (issue 44, item 1).

A run killed after it published version 4 leaves its generators serving 4; its last checkpoint
(update 2, with `sync_every` 4) recorded the learner at version 2 and version 0 published. The
resumed run's learner is at 2: a sample of version 4 comes from weights it never had. The test
resumes the real loop's start (`begin`, the continuous producer, `trainer.next_batch`) against
a replica left serving 4, and checks the batches the learner gets; and that a batch with a token
newer than the learner is refused wherever it comes from, naming the batch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import transformers

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.publisher import Publisher
from jaxrlhf.rl.rollout import PromptItem, Rollout
from jaxrlhf.rl.trainer import begin, make_producer, next_batch
from jaxrlhf.sharding import make_mesh
from tests.generator_service.replicas import FakeGenerator
from tests.rl.test_learning import learning_config, target_task

pytestmark = pytest.mark.timeout(300)


def test_a_resumed_continuous_run_never_samples_from_the_killed_runs_newer_weights(
    tiny_llama, tmp_path
):
    config = learning_config(tmp_path, "rloo", 8, 1e-3)
    config.rollout.continuous = True
    config.num_mini_batches, config.sync_every, config.max_staleness = 0, 4, 3
    config.rollout.samples_per_prompt, config.rollout.prompts_per_batch = 2, 4
    config.resume = True
    learner = Learner(config, tiny_llama, make_mesh(tuple(config.mesh.shape)))
    checkpointer = Checkpointer(tmp_path / "checkpoints", 2)
    meta = {"step": 2, "policy_version": 2, "served_version": 0, "base_version": 0,
            "seed": config.seed, "evaluated_at_start": {}, "pending_rollouts": []}  # fmt: skip
    checkpointer.save(2, learner.state, meta, force=True)
    checkpointer.close()

    left_over = FakeGenerator(version=4, capacity=64, workers=16)  # what the killed run left
    pool = GeneratorPool([left_over.address], probe_interval=0.1, no_replica_timeout=30.0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    producer = None
    try:
        checkpointer = Checkpointer(tmp_path / "checkpoints", 2)
        start = begin(config, learner, pool, tiny_llama, checkpointer, lambda message: None)
        producer = make_producer(config, target_task(tokenizer), pool, start)
        # Batches 2 and 3 need version 0 (bound 3): nothing of the schedule waits for them.
        batches = [next_batch(start.publisher, producer) for _ in range(2)]
    finally:
        if producer is not None:
            producer.close()
        pool.close()
        left_over.stop()
    assert [b.batch_index for b in batches] == [2, 3]
    newest = max(v for b in batches for s in b.samples for v in s.token_versions)
    assert newest <= 2, f"the learner at version 2 got samples of version {newest}"
    # The replica was rolled back to the checkpoint's weights before anything sampled.
    assert left_over.version == 2 and left_over.updates == 1


def _rollout(index: int, versions: tuple[int, ...]) -> Rollout:
    sample = Sample(0, 0, (5,) * len(versions), (0.0,) * len(versions), "length",
                    versions[0], versions)  # fmt: skip
    return Rollout(index, [PromptItem("p", (1,), None)], [sample], 0, 0.1)


@pytest.mark.parametrize("versions, newest", [((3, 3), None), ((3, 4), 4), ((5, 5), 5)])
def test_a_batch_with_a_token_newer_than_the_learner_is_refused_naming_it(versions, newest):
    """The learner at version 3 takes a batch whose tokens are of `versions` (a sample that
    spans a swap has the newer one last)."""
    producer = SimpleNamespace(next=lambda timeout: _rollout(7, versions))
    publisher = Publisher(None, None, None, 0, 3, 3)
    if newest is None:
        assert next_batch(publisher, producer).batch_index == 7
        return
    with pytest.raises(RuntimeError, match=rf"batch 7 has tokens of policy version {newest}, "
                       r"newer than the learner's 3"):  # fmt: skip
        next_batch(publisher, producer)
