"""Loss metrics under micro-batches equal their whole-batch values, against numpy.

`build_train_step` with micro-batches weights each part's metrics by what the metric is a mean
over. Online DPO's `valid_fraction` is a mean over all pairs (not the valid ones the loss is a
mean over), CoPG's `accuracy` one over the pairs with unequal rewards, and its `residual_rms` a
root mean square: with micro-batches of unequal valid counts, weighting them like the loss
gives other numbers than the whole batch. The batches here are sequence log-probs plus a
learnable shift, so every expected value is numpy written out from the losses' docstrings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxrlhf.losses import copg_loss, online_dpo_loss
from jaxrlhf.sharding import make_mesh, shard_batch
from jaxrlhf.train_state import build_train_step, create_train_state, state_shardings

BETA = 0.2
PAIRS = 8
# Valid pairs by row. Micro-batches are strided (part m holds rows m, m + parts, ...): with two
# parts, part 0 (rows 0, 2, 4, 6) holds 1 valid pair and part 1 holds 3; with four, one part
# holds none.
VALID = np.array([1, 1, 0, 1, 0, 0, 0, 1], np.float32)


def step_metrics(loss_fn, batch, micro_batches):
    """The metrics of one train step of `loss_fn` over `batch`, in `micro_batches` parts."""
    mesh = make_mesh((1, 1, 1), jax.devices()[:1])
    params = {"shift": jnp.zeros((), jnp.float32)}
    optimizer = optax.sgd(0.1)
    shardings = state_shardings({"shift": NamedSharding(mesh, PartitionSpec())}, optimizer,
                                params, mesh)  # fmt: skip
    state = create_train_state(params, optimizer, shardings)
    shapes = {k: v.shape for k, v in batch.items()}
    step = build_train_step(
        loss_fn, optimizer, mesh, shardings, shapes, micro_batches=micro_batches,
        weight_fn=lambda part: part["valid"].sum(),  # the losses are means over valid pairs
    )  # fmt: skip
    _, metrics = step(state, shard_batch(batch, mesh))
    return {k: float(v) for k, v in jax.device_get(metrics).items()}


def pair_batch(rewards: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    batch = {name: rng.normal(-4.0, 1.0, PAIRS).astype(np.float32)
             for name in ("first", "second", "ref_first", "ref_second")}  # fmt: skip
    batch["valid"] = VALID
    if rewards:
        # Ties (no order) on rows 0, 2 and 4: part 0 of two holds no valid ordered pair (its
        # one valid pair is a tie), part 1 three.
        batch["reward_first"] = np.array([1, 1, 0.5, 0, 0, 1, 0.2, 0.7], np.float32)
        batch["reward_second"] = np.array([1, 0, 0.5, 1, 0, 0.4, 0.9, 0.1], np.float32)
    return batch


def expected_online_dpo(batch) -> dict[str, float]:
    """online_dpo_loss's docstring over the whole batch, in float64."""
    b = {k: v.astype(np.float64) for k, v in batch.items()}
    valid = b["valid"] > 0
    chosen = BETA * (b["first"] - b["ref_first"])
    rejected = BETA * (b["second"] - b["ref_second"])
    h = (chosen - rejected) / BETA
    return {
        "loss": np.mean(np.log1p(np.exp(-BETA * h))[valid]),
        "accuracy": np.mean((h > 0)[valid]),
        "margins": np.mean((chosen - rejected)[valid]),
        "chosen_rewards": np.mean(chosen[valid]),
        "rejected_rewards": np.mean(rejected[valid]),
        "valid_fraction": np.mean(valid),
    }


def expected_copg(batch) -> dict[str, float]:
    """copg_loss's docstring over the whole batch, in float64."""
    b = {k: v.astype(np.float64) for k, v in batch.items()}
    valid = b["valid"] > 0
    reward_gap = b["reward_first"] - b["reward_second"]
    implicit_gap = BETA * ((b["first"] - b["ref_first"]) - (b["second"] - b["ref_second"]))
    residual = reward_gap - implicit_gap
    ordered = valid & (reward_gap != 0)
    return {
        "loss": np.mean(residual[valid] ** 2) / (4 * BETA),
        "reward_gap": np.mean(np.abs(reward_gap)[valid]),
        "implicit_gap": np.mean(np.abs(implicit_gap)[valid]),
        "residual_rms": np.sqrt(np.mean(residual[valid] ** 2)),
        "accuracy": np.mean((np.sign(implicit_gap) == np.sign(reward_gap))[ordered]),
    }


def online_dpo_fn(params, batch):
    return online_dpo_loss(batch["first"] + params["shift"], batch["second"], batch["ref_first"],
                           batch["ref_second"], BETA, valid=batch["valid"])  # fmt: skip


def copg_fn(params, batch):
    return copg_loss(batch["first"] + params["shift"], batch["second"], batch["ref_first"],
                     batch["ref_second"], batch["reward_first"], batch["reward_second"], BETA,
                     valid=batch["valid"])  # fmt: skip


@pytest.mark.parametrize("micro_batches", [1, 2, 4])
@pytest.mark.parametrize(
    "loss_fn, rewards, expected",
    [(online_dpo_fn, False, expected_online_dpo), (copg_fn, True, expected_copg)],
    ids=["online_dpo", "copg"],
)
def test_metrics_are_whole_batch_values(loss_fn, rewards, expected, micro_batches):
    batch = pair_batch(rewards)
    want = expected(batch)
    got = step_metrics(loss_fn, batch, micro_batches)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    # The per-metric weights only combine parts; they are not reported.
    assert not [name for name in got if name.startswith("weight/")]


def test_the_parts_are_uneven():
    """The cases above would not tell the weightings apart if every part held alike."""
    batch = pair_batch(rewards=True)
    parts = [batch["valid"][m::2] for m in range(2)]
    assert [p.sum() for p in parts] == [1, 3]
    ordered = (batch["valid"] > 0) & (batch["reward_first"] != batch["reward_second"])
    assert [ordered[m::2].sum() for m in range(2)] == [0, 3]
