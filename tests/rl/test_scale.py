"""What lets a large config fit: micro-batches, chunked log-probs and mixed precision.

- A train step over micro-batches equals the whole-batch step for every loss (the loss is a
  mean over the whole batch's tokens / pairs / rows, not a mean of micro-batch means; so is
  every metric), also when a micro-batch has nothing to learn from; so do the SFT and
  reward-model steps, and a learner configured with `train.micro_batch_size`.
- Forwards in micro-batches (with padding rows) equal the whole-batch forward.
- Token log-probs in chunks of positions equal the unchunked ones, values and gradients.
- float32 master weights with bfloat16 compute keep an update at lr 8e-7 that bfloat16
  parameters round away.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrlhf.config import base_config, resolve, validate
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.losses import LOSSES
from jaxrlhf.models import load_pretrained, next_token_logprobs
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.objectives import build_objective
from jaxrlhf.rl.rollout import PromptItem, Rollout
from jaxrlhf.rl.tasks import Task
from jaxrlhf.sharding import make_mesh, shard_batch
from jaxrlhf.stages.reward import bradley_terry_loss
from jaxrlhf.stages.sft import nll_loss
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    forward_in_micro_batches,
    params_shardings,
    state_shardings,
)
from tests.conftest import tiny_model
from tests.losses.table_model import make_inputs

# Eight samples (2 prompts x 4), no two equal within a prompt except where a test wants a tie.
SCORES = [1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.1, 0.6]


def one_step(loss_fn, params, shardings_of, batch, micro_batches, weight_fn=None):
    """(loss, params after one SGD step) on one CPU device."""
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    params = jax.tree.map(jnp.copy, params)  # the step donates (deletes) its input state
    optimizer = optax.sgd(0.5)
    shardings = state_shardings(shardings_of(mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    shapes = {k: v.shape for k, v in batch.items()}
    step = build_train_step(loss_fn, optimizer, mesh, shardings, shapes,
                            micro_batches=micro_batches, weight_fn=weight_fn)  # fmt: skip
    state, metrics = step(state, shard_batch(batch, mesh))
    return float(metrics["loss"]), jax.device_get(state.params), jax.device_get(metrics)


def assert_same_step(before, whole, micro):
    """Equal losses and equal updates, up to float32 summation order (relative to the largest
    element of the update: the parts are summed in another order than the whole)."""
    assert micro[0] == pytest.approx(whole[0], rel=1e-5, abs=1e-6)
    leaves = zip(jax.tree.leaves(before), jax.tree.leaves(whole[1]), jax.tree.leaves(micro[1]),
                 strict=True)  # fmt: skip
    for start, a, b in leaves:
        update_whole, update_micro = np.asarray(a) - start, np.asarray(b) - start
        # (plus the rounding of the parameters themselves, which the update is added to)
        tolerance = 1e-4 * np.abs(update_whole).max() + 4e-7 * np.abs(start).max()
        np.testing.assert_allclose(update_micro, update_whole, rtol=0, atol=tolerance)


def assert_same_metrics(whole, micro):
    """Every metric of the micro-batched step is its whole-batch value (float32 sums)."""
    assert set(micro) == set(whole)
    for name in whole:
        assert micro[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-6), name


@pytest.fixture(scope="module")
def models():
    path = tiny_model("llama")
    policy, policy_params = load_pretrained(path)
    value, value_params = load_pretrained(path, head="score", seed=1)
    return path, policy, value, {"policy": policy_params, "value": value_params}


@pytest.mark.parametrize(
    "name, tie", [(name, False) for name in sorted(LOSSES)] + [("online_dpo", True), ("copg", True)]
)
def test_micro_batched_step_equals_the_whole_batch_step(name, tie, models):
    path, policy, value, params = models
    spec = LOSSES[name]
    cfg = base_config().loss_params
    cfg.kl_coef = 0.05
    scores = list(SCORES)
    if tie:  # the second prompt's samples all score alike: nothing to learn from it
        scores[4:] = [0.5] * 4
    objective = build_objective(name, policy, value if spec.needs_value_model else None, cfg, 0.7)
    batch = objective.prepare(on_policy_inputs(policy, params["policy"], scores))
    if not spec.needs_value_model:
        params = {"policy": params["policy"]}

    def shardings_of(mesh):
        out = {"policy": params_shardings(policy, mesh)}
        if "value" in params:
            out["value"] = params_shardings(value, mesh)
        return out

    items = next(iter(batch.values())).shape[0]
    whole = one_step(objective.loss_fn, params, shardings_of, batch, 1, spec.batch_weight)
    micro = one_step(objective.loss_fn, params, shardings_of, batch, items, spec.batch_weight)
    assert_same_step(params, whole, micro)
    assert_same_metrics(whole[2], micro[2])
    if tie and spec.pairwise and name != "copg":
        assert float(batch["valid"].sum()) == 1.0  # one micro-batch of weight 0 in there
    # The step did change the policy (the equality is not that of two no-ops).
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), params, whole[1]))
    assert max(moved) > 1e-6


def on_policy_inputs(policy, params, scores):
    """The hand-made rollout with the tiny policy's own log-probs as π_old (ratios start at 1,
    unclipped) and a reference a little off it."""
    inputs = make_inputs(scores, 4)
    mask = inputs.loss_mask
    own = np.asarray(next_token_logprobs(policy, params, inputs.input_ids,
                                         inputs.attention_mask, 0.7)) * mask  # fmt: skip
    noise = np.random.default_rng(4).normal(0.0, 0.2, mask.shape).astype(np.float32) * mask
    inputs.old_logprobs = inputs.sampler_logprobs = own
    inputs.ref_logprobs = own + noise
    return inputs


def test_micro_batched_supervised_steps_equal_whole_batch(models):
    path, policy, _, params = models
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 300, (8, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[::3, :4] = 0
    loss_mask = np.zeros((8, 11), np.float32)
    loss_mask[:, 6:] = 1.0
    loss_mask[1, 6:10] = 0.0  # rows of different token counts: the weighting matters
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask}

    def policy_shardings(mesh):
        return params_shardings(policy, mesh)

    tokens = lambda part: part["loss_mask"].sum()  # noqa: E731
    sft = nll_loss(policy)
    assert_same_step(
        params["policy"],
        one_step(sft, params["policy"], policy_shardings, batch, 1, tokens),
        one_step(sft, params["policy"], policy_shardings, batch, 4, tokens),
    )
    reward_model, reward_params = load_pretrained(path, head="score")
    pairs = {k: batch[k].reshape(4, 2, -1) for k in ("input_ids", "attention_mask")}
    bradley_terry = bradley_terry_loss(reward_model)

    def reward_shardings(mesh):
        return params_shardings(reward_model, mesh)

    assert_same_step(
        reward_params,
        one_step(bradley_terry, reward_params, reward_shardings, pairs, 1),
        one_step(bradley_terry, reward_params, reward_shardings, pairs, 2),
    )


def hand_rollout() -> tuple[Rollout, Task]:
    """2 prompts x 4 samples of 1 to 4 tokens (one cut short), scored by a table of responses;
    the second prompt's samples all score alike (an Online DPO tie: a micro-batch of weight 0)."""
    rng = np.random.default_rng(5)
    prompts = [PromptItem("a", (11, 12, 13), None), PromptItem("b", (14, 15), None)]
    lengths = [2, 4, 1, 3, 3, 2, 4, 1]
    samples = [
        Sample(row // 4, row % 4, tuple(int(t) for t in rng.integers(3, 300, n)),
               tuple(float(x) for x in rng.uniform(-3.0, -0.5, n)),
               "length" if row == 1 else "stop", 0)
        for row, n in enumerate(lengths)
    ]  # fmt: skip
    scores = dict(zip((s.token_ids for s in samples), [1.0, 0.0, 0.5, 0.2] + [0.3] * 4,
                      strict=True))  # fmt: skip
    task = Task("hand", [], [], pad_id=0, decode=tuple, verify=lambda _, ids: scores[ids])
    return Rollout(0, prompts, samples, 0, 0.0), task


def learner_after_one_update(path, loss: str, micro_batch_size: int, **loss_params):
    """(metrics, state before, state after) of one `Learner.learn` on `hand_rollout()`, with
    config.train.micro_batch_size = `micro_batch_size` and these loss_params."""
    config = base_config()
    config.model.path = str(path)
    config.loss = loss
    config.loss_params.kl_coef = 0.05
    config.loss_params.update(loss_params)
    config.rollout.prompts_per_batch, config.rollout.samples_per_prompt = 2, 4
    config.rollout.max_prompt_tokens, config.rollout.max_response_tokens = 4, 4
    config.train.learning_rate = 1e-3
    config.train.micro_batch_size = micro_batch_size
    validate(resolve(config))
    learner = Learner(config, path, make_mesh((1, 1, 1), jax.devices()[:1]))
    # A reference other than the policy: with the two equal (a first update), Online DPO's
    # margins are all zero up to rounding, so its accuracy (the share of positive margins)
    # would flip with the float32 summation order of the micro-batches (seen on an AMD EPYC).
    learner.ref_params = jax.tree.map(lambda p: p * 0.9, learner.ref_params)
    before = jax.device_get(learner.state)
    metrics = learner.learn(*hand_rollout())
    return metrics, before, jax.device_get(learner.state)


# The hand rollout's sampler log-probs (-3 to -0.5) sit far above the random model's (about
# -5.7), so r_t = π_learner/π_sampler is 0.005-0.07: a lower bound of 0.02 drops some tokens
# (sequences) and keeps others.
OFF_POLICY = {"old_logprobs": "learner", "is_low": 0.02, "is_high": 1.0}


@pytest.mark.slow  # two learners compiled per loss: left out of `make test-fast`
@pytest.mark.parametrize(
    "loss, loss_params",
    [("online_dpo", {}), ("ppo", {}),
     ("grpo", {"is_correction": "sequence_mask", **OFF_POLICY}),
     ("rloo", {"is_correction": "mask", **OFF_POLICY})],
    ids=["online_dpo", "ppo", "grpo-sequence_mask", "rloo-mask"],
)  # fmt: skip
def test_learner_micro_batches_from_the_config_equal_the_whole_batch(loss, loss_params, models):
    """`train.micro_batch_size=2` gives the gradient, update, loss and metrics of the whole
    batch: the key reaches the train step (2 pairs or 4 x 2 rows) and the reference, value and
    recompute forwards (2 rows at a time). With an off-policy mask, the normaliser counts the
    whole batch's kept tokens (sequences), so micro-batches that keep unequal shares still
    give the whole batch's update."""
    path = models[0]
    whole, before, whole_state = learner_after_one_update(path, loss, 0, **loss_params)
    micro, _, micro_state = learner_after_one_update(path, loss, 2, **loss_params)
    if loss_params:
        assert 0 < whole["is_kept_fraction"] < 1 and whole["is_ratio_max"] > 0
    compared = [k for k in whole if k == "loss" or k.startswith("loss/") or k == "kl"
                or k.startswith("is_")]  # fmt: skip
    assert "loss/grad_norm" in compared
    assert_same_metrics({k: whole[k] for k in compared}, {k: micro[k] for k in compared})
    # Adam's moments after one step are the (clipped) gradient and its square: equal up to
    # float32 summation order, relative to the largest element.
    moments = zip(jax.tree.leaves(whole_state.opt_state), jax.tree.leaves(micro_state.opt_state),
                  strict=True)  # fmt: skip
    for a, b in moments:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * np.abs(a).max())
    # Its update, about lr per parameter whatever the gradient, amplifies the rounding of a
    # gradient near its epsilon (1e-8): a looser bound, which a missed part still breaks (an
    # RLOO run keeping few sequences has many such gradients: one element of 16384 moved
    # 0.094 lr apart). Adam ignores the gradient's scale, so the moments above are what
    # check each part's weight.
    lr = 1e-3
    leaves = zip(jax.tree.leaves(before.params), jax.tree.leaves(whole_state.params),
                 jax.tree.leaves(micro_state.params), strict=True)  # fmt: skip
    for start, a, b in leaves:
        np.testing.assert_allclose(np.asarray(b) - start, np.asarray(a) - start, rtol=0,
                                   atol=0.15 * lr)  # fmt: skip
    moved = jax.tree.map(lambda a, b: np.abs(a - b).max(), whole_state.params, before.params)
    assert max(jax.tree.leaves(moved)) > 0.5 * lr


def test_forward_in_micro_batches_with_padding_rows(models):
    _, policy, _, params = models
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 300, (5, 10)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[2, :3] = 0

    def forward(p, i, m):
        return next_token_logprobs(policy, p, i, m, 0.7)

    whole = jax.jit(forward)(params["policy"], ids, mask)
    parts = jax.jit(forward_in_micro_batches(forward, 2))(params["policy"], ids, mask)
    assert parts.shape == (5, 9)
    np.testing.assert_allclose(parts, whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])  # tied and untied LM heads
def test_chunked_logprobs_equal_unchunked(arch):
    path = tiny_model(arch)
    whole_model, params = load_pretrained(path)
    chunked_model, _ = load_pretrained(path, logprob_chunk=5)  # 5 does not divide 15
    rng = np.random.default_rng(2)
    ids = rng.integers(3, 300, (3, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, :4] = 0

    def total(model, p):
        return (next_token_logprobs(model, p, ids, mask, 0.7) * mask[:, 1:]).sum()

    for model in (whole_model, chunked_model):
        assert model.config.logprob_chunk in (0, 5)
    whole = next_token_logprobs(whole_model, params, ids, mask, 0.7)
    chunked = next_token_logprobs(chunked_model, params, ids, mask, 0.7)
    assert chunked.shape == whole.shape == (3, 15)
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    grad_whole = jax.jit(jax.grad(lambda p: total(whole_model, p)))(params)
    grad_chunked = jax.jit(jax.grad(lambda p: total(chunked_model, p)))(params)
    for a, b in zip(jax.tree.leaves(grad_whole), jax.tree.leaves(grad_chunked), strict=True):
        # (the head's gradient sums over positions in another order: float32 rounding)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.abs(a).max())


def test_float32_master_weights_keep_small_updates():
    path = tiny_model("llama")
    mixed, mixed_params = load_pretrained(path, dtype="bfloat16", param_dtype="float32")
    pure, pure_params = load_pretrained(path, dtype="bfloat16")
    assert {x.dtype for x in jax.tree.leaves(mixed_params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(pure_params)} == {jnp.dtype("bfloat16")}
    ids = np.random.default_rng(3).integers(3, 300, (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask[:, 1:].astype(np.float32)}
    changed = {}
    for name, model, params in (("mixed", mixed, mixed_params), ("pure", pure, pure_params)):
        _, after, _ = one_step_adam(nll_loss(model), model, params, batch, 8e-7)
        kernel = "layers", "mlp", "up_proj", "kernel"
        before_leaf, after_leaf = params, after
        for key in kernel:
            before_leaf, after_leaf = before_leaf[key], after_leaf[key]
        changed[name] = float(np.mean(np.asarray(after_leaf, np.float32)
                                      != np.asarray(before_leaf, np.float32)))  # fmt: skip
    # Adam moves every weight by ~lr: float32 keeps it, bfloat16 (8 bits) rounds it away.
    assert changed["mixed"] > 0.9 and changed["pure"] < 0.01, changed
    # The forward computes in bfloat16 either way: the logits agree with float32 loosely.
    full, full_params = load_pretrained(path)
    logits32 = full.apply({"params": full_params}, ids, mask)
    logits16 = mixed.apply({"params": mixed_params}, ids, mask)
    assert logits16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(logits16, np.float32) - np.asarray(logits32)).max() < 0.1


def one_step_adam(loss_fn, model, params, batch, learning_rate):
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    params = jax.tree.map(jnp.copy, params)  # the step donates (deletes) its input state
    optimizer = optax.adam(learning_rate)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    step = build_train_step(loss_fn, optimizer, mesh, shardings,
                            {k: v.shape for k, v in batch.items()})  # fmt: skip
    state, metrics = step(state, shard_batch(batch, mesh))
    return float(metrics["loss"]), jax.device_get(state.params), metrics
