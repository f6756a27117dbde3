"""The RLHF loop (`run_rlhf`) with the in-process `JaxGenerator`: resuming between two publishes
(sync_every > 1) is exact, and the per-step record says what the generator returned (the
samples, and the versions of their tokens across in-flight swaps)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import transformers

from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.trainer import run_rlhf
from tests.rl.exact import assert_same_state, checkpoint_steps, records
from tests.rl.jax_generator import JaxGenerator
from tests.rl.test_learning import learning_config, target_task
from tests.rl.test_rollout import within

RUN_S = 600.0  # a run still going after this is stuck (the checkpoint hang of issue 18)


class Stop(Exception):
    """Ends a run at a chosen point, as a kill would."""


class StoppingGenerator(JaxGenerator):
    """Serves `stop_at` (as the killed run's generator would keep doing), then stops the run."""

    def __init__(self, stop_at: int, *args):
        super().__init__(*args)
        self.stop_at = stop_at

    def publish_weights(self, *args, **kwargs):
        stats = super().publish_weights(*args, **kwargs)
        if self.version == self.stop_at:
            self.stop_at = None
            raise Stop(f"stopped after publishing version {self.version}")
        return stats


@pytest.fixture(scope="module")
def setup(tiny_llama):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    return tiny_llama, target_task(tokenizer), (tokenizer.eos_token_id, tokenizer.pad_token_id)


def mini_batch_config(output_dir, resume: bool = False):
    """6 updates in the paper's off-policy test bed with N = 4 mini-batches (publishes after
    updates 4 and 6), a checkpoint every 2 updates: the one at 2 falls between two publishes.
    Each batch is trained on twice (train.updates_per_batch), through a token mask on the
    learner's recompute (loss_params.is_correction)."""
    config = learning_config(output_dir, "rloo", 6, 1e-2, old_logprobs="learner",
                             is_correction="mask")  # fmt: skip
    config.train.updates_per_batch = 2
    config.num_mini_batches = 0
    config.sync_every, config.max_staleness = 4, 3
    config.checkpoint.every = 2
    config.resume = resume
    return config


@pytest.mark.slow  # compiles and trains two whole runs: left out of `make test-fast`
def test_resume_between_publishes_is_bit_exact(setup, tmp_path):
    """Checkpoint at update 2 (the generator serves version 0, the learner is at 2), stopped
    after publishing 4, resumed: the final train state equals an uninterrupted run's bit for
    bit, every step's record matches, and the resumed run published the checkpoint's weights
    (version 2) at once, then versions 4 and 6.
    The uninterrupted run publishes in its steps, the others in the background
    (`generator.publish_in_background`): that changes no sample, no update and no weight."""
    model_dir, task, ids = setup
    full = JaxGenerator(model_dir, *ids)
    config = mini_batch_config(tmp_path / "full")
    config.generator.publish_in_background = False
    within(RUN_S, lambda: run_rlhf(config, model_dir, task, full, lambda message: None))
    assert sorted(full.published) == [4, 6]

    stopped = StoppingGenerator(4, model_dir, *ids)
    with pytest.raises(Stop):
        within(RUN_S, lambda: run_rlhf(mini_batch_config(tmp_path / "run"), model_dir, task,
                                       stopped, lambda message: None))  # fmt: skip
    assert checkpoint_steps(tmp_path / "run")[-1] == 2  # (and 4 never written)
    stopped.published.clear()
    log = []
    within(RUN_S, lambda: run_rlhf(mini_batch_config(tmp_path / "run", resume=True), model_dir,
                                   task, stopped, log.append))  # fmt: skip
    assert "resumed from step 2 (policy version 2)" in log
    # The resume rolls back what the stopped run left on the generator (its version 4) to the
    # checkpoint's own weights, as version 2; then 4 and 6 as in the uninterrupted run.
    assert sorted(stopped.published) == [2, 4, 6]
    for version in (4, 6):
        for name, array in full.published[version].items():
            np.testing.assert_array_equal(stopped.published[version][name], array, name)
    assert_same_state(tmp_path / "full", tmp_path / "run", 6)
    assert records(tmp_path / "run") == records(tmp_path / "full")
    # (and the weights moved between the two publishes: the equality is not that of no-ops)
    assert not np.array_equal(full.published[6]["model.norm.weight"],
                              full.published[4]["model.norm.weight"])  # fmt: skip


class InFlightGenerator(JaxGenerator):
    """As if every batch's weights were swapped in flight to the next version halfway through
    the first sample of each prompt (the next version: at most the one the learner trains the
    batch from, base + index). Starts at version base − 1, as an earlier run left it (the run
    then publishes its initial weights as `base`). Keeps what it returned, by batch."""

    def __init__(self, seed: int, base: int, *args):
        super().__init__(*args)
        self.seed, self.base, self.version = seed, base, base - 1
        self.returned: dict[int, list[Sample]] = {}

    def generate(self, prompts, sampling, on_admitted=None, min_version=None):
        samples = super().generate(prompts, sampling, on_admitted, min_version)
        index = sampling["seed"] - self.seed * 1_000_003
        self.returned[index] = [self._swapped(s, min(s.policy_version + 1, self.base + index))
                                for s in samples]  # fmt: skip
        return self.returned[index]

    @staticmethod
    def _swapped(sample: Sample, later: int) -> Sample:
        if sample.sample_index != 0:
            return sample
        half = (len(sample.token_ids) + 1) // 2
        versions = (sample.policy_version,) * half + (later,) * (len(sample.token_ids) - half)
        return dataclasses.replace(sample, token_policy_versions=versions)


def test_step_records_say_what_the_generator_returned(setup, tmp_path):
    """One step off-policy with in-flight swaps: each record lists the samples that came back,
    and its mixed-version share and token staleness are those of the returned tokens, counted
    here from their lengths (batch i ≥ 1 sampled on version i − 1, swapped to i, numbered
    from the run's base version)."""
    model_dir, task, ids = setup
    config = learning_config(tmp_path, "rloo", 3, 1e-2)
    generator = InFlightGenerator(config.seed, 3, model_dir, *ids)
    result = within(RUN_S, lambda: run_rlhf(config, model_dir, task, generator,
                                            lambda message: None))  # fmt: skip
    assert sorted(generator.published) == [3, 4, 5, 6]
    for index, record in enumerate(result.metrics):
        assert record["policy_version"] == 3 + index + 1
        returned = generator.returned[index]
        assert record["samples_returned"] == [
            [record["prompt_ids"][s.prompt_index], s.sample_index] for s in returned
        ]
        lengths = [len(s.token_ids) for s in returned]
        if index == 0:  # sampled on version 0, trained from 0: nothing to swap to
            assert record["mixed_version_fraction"] == record["token_staleness_mean"] == 0
            continue
        firsts = [len(s.token_ids) for s in returned if s.sample_index == 0]
        old_tokens = sum(lengths) - sum(length // 2 for length in firsts)
        assert record["mixed_version_fraction"] == sum(n >= 2 for n in firsts) / len(returned)
        assert record["token_staleness_mean"] == pytest.approx(old_tokens / sum(lengths))
        assert record["staleness_max"] == record["token_staleness_max"] == 1
    assert any(r["mixed_version_fraction"] > 0 for r in result.metrics)


def test_a_run_can_leave_the_returned_samples_out_of_its_records(setup, tmp_path):
    """`train.log_samples_returned=False` (committed experiment records): the rest stays."""
    model_dir, task, ids = setup
    config = learning_config(tmp_path, "rloo", 1, 1e-2)
    config.train.log_samples_returned = False
    generator = JaxGenerator(model_dir, *ids)
    result = within(RUN_S, lambda: run_rlhf(config, model_dir, task, generator, lambda m: None))
    (record,) = result.metrics
    assert "samples_returned" not in record and len(record["prompt_ids"]) == record["prompts"]
