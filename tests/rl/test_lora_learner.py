"""A LoRA run's learner (`config.model.lora.rank` > 0): the state, the gradients and the
optimizer hold the adapters alone; the base never changes; the reference is the base itself
(adapters off, no copy); a publish sends the merged weights, which equal the adapted model.
On the tiny Llama, one update of `Learner.learn` on the hand-made rollout of test_scale."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrlhf.config import base_config
from jaxrlhf.config.checks import resolve, validate
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models import mapping
from jaxrlhf.rl.learner import Learner
from jaxrlhf.sharding import make_mesh
from tests.models.test_parity import padded_batch
from tests.rl.test_scale import hand_rollout


def lora_config(path, loss="rloo", rank=4):
    config = base_config()
    config.model.path = str(path)
    config.model.lora.rank = rank
    config.loss = loss
    config.loss_params.kl_coef = 0.05
    config.rollout.prompts_per_batch, config.rollout.samples_per_prompt = 2, 4
    config.rollout.max_prompt_tokens, config.rollout.max_response_tokens = 4, 4
    config.train.learning_rate = 1e-2
    validate(resolve(config))
    return config


def leaves(tree) -> dict[str, tuple]:
    return {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("loss", ["rloo", "online_dpo"])
def test_a_lora_update_trains_the_adapters_alone(tiny_llama, loss):
    learner = Learner(
        lora_config(tiny_llama, loss), tiny_llama, make_mesh((1, 1, 1), jax.devices()[:1])
    )
    adapter = mapping.flatten(jax.device_get(learner.state.params["policy"]))
    assert adapter and all(lora_lib.is_factor(p) for p in adapter)
    assert len(adapter) == 2 * len(lora_lib.TARGETS)  # every target's A and B
    # Adam's moments are the adapter's shapes, nothing of the base.
    moments = [s for s in leaves(learner.state.opt_state).values() if s != ()]
    assert sorted(moments) == sorted([v.shape for v in adapter.values()] * 2)
    base_before = jax.device_get(learner.frozen["policy"])
    learner.learn(*hand_rollout())
    after = mapping.flatten(jax.device_get(learner.state.params["policy"]))
    moved = [p for p in adapter if not np.array_equal(adapter[p], after[p])]
    assert moved, "the update left every factor as it was"
    assert any(p.endswith("lora_b") for p in moved)  # B leaves zero: the adapter now acts
    base_after = jax.device_get(learner.frozen["policy"])
    assert jax.tree.all(jax.tree.map(np.array_equal, base_before, base_after))
    # The reference is the base, the very arrays (no copy), through the base model.
    assert learner.ref_params is learner.frozen["policy"]
    assert learner.ref_logprobs is not learner.logprobs


def test_the_published_weights_are_the_adapted_model(tiny_llama):
    learner = Learner(lora_config(tiny_llama), tiny_llama, make_mesh((1, 1, 1), jax.devices()[:1]))
    learner.learn(*hand_rollout())
    ids, mask = padded_batch(learner.policy.config.vocab_size)
    adapted = learner.policy.apply({"params": learner.policy_params()}, ids, mask)
    merged = learner.published()
    plain = learner.base_policy.apply({"params": merged}, ids, mask)
    real = mask.astype(bool)
    assert np.abs(np.asarray(adapted) - np.asarray(plain))[real].max() <= 1e-4
    # and the base's own logits differ: the published weights carry the update
    base = learner.base_policy.apply({"params": learner.frozen["policy"]}, ids, mask)
    assert np.abs(np.asarray(base) - np.asarray(plain))[real].max() > 1e-3
    on_host = lora_lib.merged(learner.policy.config, jax.device_get(learner.policy_params()))
    same = jax.tree.map(lambda a, b: np.allclose(a, b, atol=1e-6), on_host, jax.device_get(merged))
    assert jax.tree.all(same)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model.lora.rank", -1, "must be an integer >= 0"),
        ("model.lora.targets", ("q_proj", "qkv"), "name one or more of"),
        ("loss", "ppo", "a loss with a value model"),
        ("stage", "sft", "LoRA is for the rlhf stage"),
    ],
)
def test_bad_lora_settings_are_refused_in_one_line(tiny_llama, key, value, message):
    config = lora_config(tiny_llama)
    section, _, name = key.rpartition(".")
    (config if not section else config.model.lora)[name] = value
    with pytest.raises(ValueError, match=message):
        validate(resolve(config))


@pytest.mark.parametrize("transport", ["auto", "stream", "shared"])
def test_adapters_go_to_lora_generators_over_any_weight_transport(tiny_llama, transport):
    """generator.swap_mode="lora" takes every weight transport (the shared file carries
    adapters too); it still needs a LoRA rank a server can be started with."""
    config = lora_config(tiny_llama)
    config.generator.swap_mode, config.generator.weight_transport = "lora", transport
    validate(resolve(config))
    for rank in (0, 1024):
        config.model.lora.rank = rank
        with pytest.raises(ValueError, match='swap_mode="lora" serves LoRA adapters'):
            validate(resolve(config))


def test_a_lora_checkpoint_resumes_the_adapters_and_their_optimizer(tiny_llama, tmp_path):
    """An Orbax checkpoint of a LoRA run holds the adapters and Adam's state for them; a new
    learner on the same base restores them exactly, and its next update equals the first
    learner's."""
    from jaxrlhf.checkpointing import Checkpointer

    config = lora_config(tiny_llama)
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    first = Learner(config, tiny_llama, mesh)
    first.learn(*hand_rollout())
    saver = Checkpointer(tmp_path / "checkpoints", 1)
    saver.save(1, first.state, {"step": 1}, force=True)
    saver.close()
    config.seed += 1  # a new adapter's init would differ: the restored one must win
    second = Learner(config, tiny_llama, mesh)
    reader = Checkpointer(tmp_path / "checkpoints", 1)
    second.state, meta = reader.restore(None, second.state)
    reader.close()
    assert meta["step"] == 1
    same = jax.tree.map(np.array_equal, jax.device_get(first.state), jax.device_get(second.state))
    assert jax.tree.all(same)
    first.learn(*hand_rollout())
    second.learn(*hand_rollout())
    same = jax.tree.map(np.array_equal, jax.device_get(first.state), jax.device_get(second.state))
    assert jax.tree.all(same)


def test_a_lora_checkpoint_refuses_another_base_before_restoring(tiny_llama, tmp_path):
    """The checkpoint's metadata names its base (`Learner.lora_base`: the folder's digest). A
    learner on a base whose files differ (one weight changed), or one training the whole
    policy, is refused by `check_lora_base` with a message naming both, before any restore."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from jaxrlhf.checkpointing import Checkpointer
    from jaxrlhf.rl.trainer import check_lora_base

    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    first = Learner(lora_config(tiny_llama), tiny_llama, mesh)
    saver = Checkpointer(tmp_path / "checkpoints", 1)
    saver.save(1, first.state, {"step": 1, "lora_base": first.lora_base}, force=True)
    saver.close()
    meta = Checkpointer(tmp_path / "checkpoints", 1).meta()
    assert meta["lora_base"]["digest"] == first.lora_base["digest"]
    check_lora_base(meta, first)  # the same base: accepted

    other = tmp_path / "other-base"
    shutil.copytree(tiny_llama, other)
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.ones_like(tensors[name])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    moved = Learner(lora_config(other), other, mesh)
    with pytest.raises(ValueError, match="trained on the base .* differs .*resume with that base"):
        check_lora_base(meta, moved)
    whole = lora_config(tiny_llama, rank=0)
    with pytest.raises(ValueError, match="trained LoRA adapters and this run trains the whole"):
        check_lora_base(meta, Learner(whole, tiny_llama, mesh))


def test_evaluate_restores_a_lora_checkpoint_as_the_merged_policy(tiny_llama, tmp_path):
    """`jaxrlhf.evaluate` on a LoRA run's checkpoint (its config's `model.lora`): the adapters
    restored and merged into the base are the weights the run published."""
    from jaxrlhf.checkpointing import Checkpointer
    from jaxrlhf.evaluate import checkpoint_policy

    config = lora_config(tiny_llama)
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    learner = Learner(config, tiny_llama, mesh)
    learner.learn(*hand_rollout())
    saver = Checkpointer(tmp_path / "checkpoints", 1)
    saver.save(1, learner.state, {"step": 1}, force=True)
    saver.close()
    model, params = checkpoint_policy(config, tiny_llama, tmp_path / "checkpoints" / "1", mesh)
    assert not model.config.lora_rank
    want = jax.device_get(learner.published())
    same = jax.tree.map(np.array_equal, want, jax.device_get(params))
    assert jax.tree.all(same)
    assert not jax.tree.all(jax.tree.map(np.array_equal, want, jax.device_get(
        learner.frozen["policy"])))  # fmt: skip
