"""Orbax round trip of a sharded train state on disk."""

import jax
import numpy as np
import optax

from jaxrlhf.checkpointing import Checkpointer
from jaxrlhf.models import load_pretrained
from jaxrlhf.sharding import make_mesh
from jaxrlhf.train_state import create_train_state, params_shardings, state_shardings
from tests.conftest import tiny_model


def test_sharded_state_round_trips_exactly(tmp_path):
    mesh = make_mesh((2, 2, 2))
    model, params = load_pretrained(tiny_model("llama"), mesh=mesh)
    optimizer = optax.adamw(1e-3)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    grads = jax.tree.map(lambda p: p * 0.01, state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    state = state.replace(
        params=optax.apply_updates(state.params, updates), opt_state=opt_state, step=state.step + 1
    )
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=5)
    assert ckpt.save(1, state, {"policy_version": 1, "data_position": 8}, force=True)
    assert not ckpt.save(2, state, {"policy_version": 2})  # not due: every 5 steps
    ckpt.close()

    fresh = create_train_state(params, optimizer, shardings)
    reader = Checkpointer(tmp_path / "ckpt", save_every=5)
    assert reader.latest_step() == 1
    restored, meta = reader.restore(None, fresh)
    assert meta == {"policy_version": 1, "data_position": 8}
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
