"""The asynchronous path, fed exactly the rollouts of a synchronous run, makes the same updates.

A synchronous run (max_staleness=0) records every batch it was served. An asynchronous run
(max_staleness=1: batch i+1 is requested while batch i trains, on weights one version older)
is then served those same batches by `ReplayGenerator`. Everything that differs between the two
modes in the learner — when batches are requested and admitted, which version they need, when
weights are published and under which version, which batch is paired with which prompts, the
reference and the behaviour log-probs — must then make no difference: the published weights
are equal bit for bit, version by version, and so is every step's loss. What remains between
sync and async runs is the true cost of stale samples.
"""

from __future__ import annotations

import numpy as np
import pytest
import transformers

from jaxrlhf.config.checks import resolve
from jaxrlhf.rl.trainer import run_rlhf
from tests.rl.jax_generator import JaxGenerator
from tests.rl.test_learning import learning_config, target_task


class RecordingGenerator(JaxGenerator):
    """Samples as JaxGenerator and keeps every seeded batch it served, by seed."""

    def __init__(self, *args):
        super().__init__(*args)
        self.batches: dict[int, list] = {}

    def generate(self, prompts, sampling, on_admitted=None, min_version=None):
        samples = super().generate(prompts, sampling, on_admitted)
        self.batches[sampling["seed"]] = (list(prompts), samples)
        return samples


class ReplayGenerator(JaxGenerator):
    """Serves the recorded batches, matched by seed (and checked against the prompts asked)."""

    def __init__(self, recorded: dict[int, tuple], *args):
        super().__init__(*args)
        self.recorded = recorded

    def generate(self, prompts, sampling, on_admitted=None, min_version=None):
        recorded_prompts, samples = self.recorded[sampling["seed"]]
        assert list(prompts) == recorded_prompts, "the batch asks for other prompts"
        if on_admitted is not None:
            on_admitted()
        return samples


def run(generator, model_dir, output_dir, task, loss, max_staleness, mini_batches=0,
        **loss_params):  # fmt: skip
    config = learning_config(output_dir, loss, 6, 1e-2, **loss_params)
    config.max_staleness = max_staleness
    config.num_mini_batches = mini_batches  # > 0: publish every N updates (staleness N - 1)
    resolve(config)  # as `jaxrlhf.main` reads it
    result = run_rlhf(config, model_dir, task, generator, lambda message: None)
    return result.metrics


@pytest.mark.slow  # two whole runs per loss (sync, then replayed async)
@pytest.mark.parametrize(
    "loss, loss_params",
    [("online_dpo", {}), ("ppo", {"old_logprobs": "learner", "truncated_is_cap": 2.0})],
)
def test_async_path_replays_the_sync_updates(loss, loss_params, tiny_llama, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    task = target_task(tokenizer)
    ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    recorder = RecordingGenerator(tiny_llama, *ids)
    sync = run(recorder, tiny_llama, tmp_path / "sync", task, loss, 0, **loss_params)
    replay = ReplayGenerator(recorder.batches, tiny_llama, *ids)
    asyn = run(replay, tiny_llama, tmp_path / "async", task, loss, 1, **loss_params)

    assert [r["staleness_max"] for r in sync] == [0] * 6
    # The replayed batches carry the sync tags, one version newer than async mode requires.
    assert sorted(replay.published) == sorted(recorder.published) == list(range(1, 7))
    for version, tensors in recorder.published.items():
        for name, array in tensors.items():
            np.testing.assert_array_equal(replay.published[version][name], array, err_msg=name)
    for key in ("loss", "reward_mean", "kl", "loss/grad_norm"):
        assert [r[key] for r in asyn] == [r[key] for r in sync], key
    # And the sync run did learn something, so the equality is not that of two no-ops.
    assert not np.array_equal(recorder.published[6]["model.norm.weight"],
                              recorder.published[1]["model.norm.weight"])  # fmt: skip


@pytest.mark.slow  # two whole runs (sync, then replayed with N = 3)
def test_online_dpo_on_n_mini_batches_replays_the_sync_updates(tiny_llama, tmp_path):
    """N = 3 mini-batches a publish (`num_mini_batches`, as claim (b) runs them), fed the sync
    run's batches: the same 6 updates (published weights at versions 3 and 6 equal bit for bit,
    every step's loss equal). Online DPO's pairs, reference log-probs and the split of a
    generation round into updates are the same at N = 3 as at N = 1; only which policy sampled
    the pairs differs when it samples them itself."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    task = target_task(tokenizer)
    ids = (tokenizer.eos_token_id, tokenizer.pad_token_id)
    recorder = RecordingGenerator(tiny_llama, *ids)
    sync = run(recorder, tiny_llama, tmp_path / "sync", task, "online_dpo", 0)
    replay = ReplayGenerator(recorder.batches, tiny_llama, *ids)
    rounds = run(replay, tiny_llama, tmp_path / "n3", task, "online_dpo", 0, mini_batches=3)

    # (The replayed samples carry the sync run's version tags, so staleness reads 0 here.)
    assert sorted(replay.published) == [3, 6]  # one publish a round of 3 updates
    for version in (3, 6):
        for name, array in recorder.published[version].items():
            np.testing.assert_array_equal(replay.published[version][name], array, err_msg=name)
    for key in ("loss", "reward_mean", "loss/accuracy", "loss/grad_norm"):
        assert [r[key] for r in rounds] == [r[key] for r in sync], key
