"""Train state and the jitted, mesh-sharded train step.

The state is one explicit pytree (step, params, optimizer state). `build_train_step` wraps any
loss `loss_fn(params, batch) -> (loss, metrics)` into forward + grad + optax update, jitted with
NamedSharding for the state (from the logical-axis rules) and for the batch (split over data and
fsdp), so the same code runs on one CPU or on a (data, fsdp, tensor) mesh.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlhf.models.transformer import Transformer, abstract_params
from jaxrlhf.sharding import (
    LOGICAL_RULES,
    activate,
    batch_sharding,
    optimizer_state_shardings,
    param_logical_axes,
    tree_shardings,
)

LossFn = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, dict[str, jax.Array]]]


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def params_shardings(model: Transformer, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedSharding of every parameter of `model` on `mesh`, by the logical-axis rules."""
    abstract = abstract_params(model)
    return tree_shardings(nn.meta.unbox(abstract), param_logical_axes(abstract), mesh, rules)


def state_shardings(
    params_sharding: Any, optimizer: optax.GradientTransformation, params: Any, mesh: Mesh
) -> TrainState:
    abstract_opt = jax.eval_shape(optimizer.init, params)
    return TrainState(
        step=NamedSharding(mesh, PartitionSpec()),
        params=params_sharding,
        opt_state=optimizer_state_shardings(abstract_opt, params_sharding, mesh),
    )


def create_train_state(
    params: Any, optimizer: optax.GradientTransformation, shardings: TrainState
) -> TrainState:
    """Places params on the mesh and initialises the optimizer state already sharded."""
    params = jax.device_put(params, shardings.params)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings.opt_state)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), shardings.step)
    return TrainState(step=step, params=params, opt_state=opt_state)


def build_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    shardings: TrainState,
    batch_shapes: dict[str, tuple[int, ...]],
    rules=LOGICAL_RULES,
) -> Callable[[TrainState, dict[str, jax.Array]], tuple[TrainState, dict[str, jax.Array]]]:
    """jit(step) with explicit in/out shardings; the input state is donated (updated in place)."""
    batch_spec = {
        name: batch_sharding(mesh, len(shape), shape[0]) for name, shape in batch_shapes.items()
    }
    replicated = NamedSharding(mesh, PartitionSpec())

    def step(state: TrainState, batch: dict[str, jax.Array]):
        with activate(mesh, rules):
            (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return jax.jit(
        step,
        in_shardings=(shardings, batch_spec),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
