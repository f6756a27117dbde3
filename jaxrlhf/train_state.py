"""Train state and the jitted, mesh-sharded train step.

The state is one explicit pytree (step, params, optimizer state). `build_train_step` wraps any
loss `loss_fn(params, batch) -> (loss, metrics)` into forward + grad + optax update, jitted with
NamedSharding for the state (from the logical-axis rules) and for the batch (split over data and
fsdp), so the same code runs on one CPU or on a (data, fsdp, tensor) mesh.
"""

from __future__ import annotations

import functools
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


def split_micro_batches(tree: Any, count: int) -> Any:
    """Every [B, ...] leaf -> [count, B/count, ...]; micro-batch m holds rows m, m + count, ...

    Strided rather than contiguous: with the rows split over devices in blocks, every device
    then holds its own share of every micro-batch, so no row moves between devices.
    """

    def split(x):
        if x.shape[0] % count:
            raise ValueError(f"a batch of {x.shape[0]} rows does not split into {count} parts")
        return x.reshape(x.shape[0] // count, count, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, tree)


def merge_micro_batches(tree: Any) -> Any:
    """The inverse of `split_micro_batches`: [count, B/count, ...] -> [B, ...]."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(-1, *x.shape[2:]), tree)


def micro_batch_count(rows: int, micro_batch_size: int, rows_per_item: int = 1) -> int:
    """How many micro-batches a batch of `rows` items takes at `micro_batch_size` sequences per
    forward/backward (0 = one), each item being `rows_per_item` sequences (2 for a pair)."""
    if not micro_batch_size or rows * rows_per_item <= micro_batch_size:
        return 1
    items = micro_batch_size // rows_per_item
    if items < 1 or rows % items:
        raise ValueError(
            f"config.train.micro_batch_size={micro_batch_size} does not divide a batch of "
            f"{rows} items of {rows_per_item} sequence(s) into equal micro-batches"
        )
    return rows // items


def forward_in_micro_batches(fn: Callable, micro_batch_size: int) -> Callable:
    """fn(params, *arrays) over row-aligned [B, ...] arrays, `micro_batch_size` rows at a time
    (0 = all at once): the rows are padded to a whole number of micro-batches (padding rows are
    all-masked and dropped after), run in sequence with `lax.map`, and merged back. Jit-able;
    for forwards only (a loss needs `build_train_step`'s weighting instead)."""
    if not micro_batch_size:
        return fn

    def run(params, *arrays):
        rows = arrays[0].shape[0]
        count = -(-rows // micro_batch_size)
        if count <= 1:
            return fn(params, *arrays)
        pad = count * micro_batch_size - rows
        padded = tuple(jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in arrays)
        parts = split_micro_batches(padded, count)
        out = merge_micro_batches(jax.lax.map(lambda part: fn(params, *part), parts))
        return jax.tree.map(lambda x: x[:rows], out)

    return run


METRIC_WEIGHT_PREFIX = "weight/"


def _is_count(name: str) -> bool:
    return name.startswith(("num_", METRIC_WEIGHT_PREFIX)) or name == "weight"


def _metric_weight(name: str, metrics: dict[str, jax.Array], weight: jax.Array) -> jax.Array:
    """What metric `name` of one micro-batch is a mean over: its own count when the loss
    reports one (`weight/<name>`, e.g. Online DPO's valid_fraction is over all pairs, not the
    valid ones the loss averages), else the loss's weight."""
    return metrics.get(METRIC_WEIGHT_PREFIX + name, weight).astype(jnp.float32)


def _reduce_metric(name: str, total, value, weight):
    """Micro-batch metrics: weighted means, except maxima (max), counts (sum) and root mean
    squares (`_rms`: weighted mean of the squares, rooted by `_finish_metric`)."""
    if name.endswith("_max"):
        return jnp.maximum(total, value)
    if _is_count(name):
        return total + value
    if name.endswith("_rms"):
        return total + weight * value**2
    return total + weight * value


def _finish_metric(name: str, total, weight_sum):
    """The whole batch's value of a metric from its micro-batch reduction (0 if no weight)."""
    if name.endswith("_max") or _is_count(name):
        return total
    mean = jnp.where(weight_sum > 0, total / jnp.where(weight_sum > 0, weight_sum, 1.0), 0.0)
    return jnp.sqrt(mean) if name.endswith("_rms") else mean


def _reported(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The metrics without the per-metric weights (`weight/<name>`), which only combine parts."""
    return {k: v for k, v in metrics.items() if not k.startswith(METRIC_WEIGHT_PREFIX)}


def build_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    shardings: TrainState,
    batch_shapes: dict[str, tuple[int, ...]],
    rules=LOGICAL_RULES,
    micro_batches: int = 1,
    weight_fn: Callable[[dict[str, jax.Array]], jax.Array] | None = None,
    keep_params: bool = False,
    frozen_shardings: Any = None,
) -> Callable[..., tuple[TrainState, dict[str, jax.Array]]]:
    """jit(step) with explicit in/out shardings; the input state is donated (updated in place).
    With `keep_params` the parameters are not donated (the optimizer state still is): the step
    writes new ones and the old stay valid for whoever holds them (a publish running beside
    the step), at the cost of both copies during the step, as a copy taken before it would.

    With `micro_batches` > 1 the batch is split (`split_micro_batches`) and the gradients are
    accumulated over the parts (`accumulated_gradients`), then one optimizer step is taken: the
    step of the whole batch.

    With `frozen_shardings` the step takes a third argument, parameters that are read and never
    trained (a LoRA run's base weights: `jaxrlhf.models.lora`), placed so and never donated;
    `loss_fn(params, batch, frozen)` then differentiates `params` alone, so the gradients and the
    optimizer state hold only them.
    """
    batch_spec = {
        name: batch_sharding(mesh, len(shape), shape[0]) for name, shape in batch_shapes.items()
    }

    def step(state: TrainState, batch: dict[str, jax.Array], *frozen):
        loss = loss_fn if not frozen else functools.partial(loss_fn, frozen=frozen[0])

        def gradients(params, batch):
            with activate(mesh, rules):
                return jax.value_and_grad(loss, has_aux=True)(params, batch)

        accumulate = accumulated_gradients(gradients, weight_fn, micro_batches)
        if micro_batches > 1:
            loss, metrics, grads = accumulate(state.params, batch)
        else:
            (loss, metrics), grads = gradients(state.params, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(_reported(metrics), loss=loss, grad_norm=optax.tree.norm(grads))
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return _jit_step(step, shardings, batch_spec, NamedSharding(mesh, PartitionSpec()),
                     keep_params, frozen_shardings)  # fmt: skip


def accumulated_gradients(gradients, weight_fn, micro_batches: int):
    """(params, batch) -> (loss, metrics, grads) of the whole batch from `micro_batches` parts
    in a `lax.scan` (`gradients(params, part)` is `value_and_grad` of the loss with its
    metrics). A loss that is a mean over some unit of the batch (tokens, pairs, rows:
    `weight_fn(part)` counts them, default rows) is a mean over the whole batch, not a mean of
    per-part means: part m's loss and gradient are weighted by its share w_m / Σ w. Metrics
    are weighted the same way, or by their own count where the loss reports one as
    `weight/<name>` (maxima, counts and root mean squares `_rms` excepted), so each equals
    its whole-batch value; the `weight/*` entries are not returned."""

    def weight_of(part):
        if weight_fn is not None:
            return jnp.asarray(weight_fn(part), jnp.float32)
        return jnp.float32(next(iter(part.values())).shape[0])

    def accumulate(params, batch):
        parts = split_micro_batches(batch, micro_batches)
        first = jax.tree.map(lambda x: x[0], parts)
        (_, metric_shapes), _ = jax.eval_shape(gradients, params, first)
        init = (
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            jnp.float32(0.0),
            jnp.float32(0.0),
            {k: jnp.full((), -jnp.inf if k.endswith("_max") else 0.0, jnp.float32)
             for k in metric_shapes},
            {k: jnp.float32(0.0) for k in metric_shapes},
        )  # fmt: skip

        def body(carry, part):
            grads_sum, loss_sum, weight_sum, metric_sums, metric_weights = carry
            (loss, metrics), grads = gradients(params, part)
            weight = weight_of(part)
            grads_sum = jax.tree.map(lambda a, g: a + weight * g.astype(a.dtype), grads_sum, grads)
            weights = {k: _metric_weight(k, metrics, weight) for k in metric_sums}
            metric_sums = {
                k: _reduce_metric(k, metric_sums[k], metrics[k].astype(jnp.float32), weights[k])
                for k in metric_sums
            }
            metric_weights = {k: metric_weights[k] + weights[k] for k in metric_weights}
            carry = (grads_sum, loss_sum + weight * loss, weight_sum + weight, metric_sums,
                     metric_weights)  # fmt: skip
            return carry, None

        (grads_sum, loss_sum, weight_sum, metric_sums, metric_weights), _ = jax.lax.scan(
            body, init, parts
        )
        scale = 1.0 / jnp.maximum(weight_sum, 1e-12)  # all-zero weights: zero loss and grads
        grads = jax.tree.map(lambda g, p: (g * scale).astype(p.dtype), grads_sum, params)
        metrics = {k: _finish_metric(k, v, metric_weights[k]) for k, v in metric_sums.items()}
        return loss_sum * scale, metrics, grads

    return accumulate


def _jit_step(step, shardings: TrainState, batch_spec, replicated, keep_params: bool,
              frozen_shardings=None):  # fmt: skip
    """`step` jitted with the state donated, or (`keep_params`) all of it but the parameters;
    the frozen parameters, when given, never."""
    frozen = () if frozen_shardings is None else (frozen_shardings,)
    if not keep_params:
        return jax.jit(
            step,
            in_shardings=(shardings, batch_spec, *frozen),
            out_shardings=(shardings, replicated),
            donate_argnums=(0,),
        )

    def split_step(params, rest, batch, *held):
        return step(TrainState(step=rest[0], params=params, opt_state=rest[1]), batch, *held)

    kept = jax.jit(
        split_step,
        in_shardings=(shardings.params, (shardings.step, shardings.opt_state), batch_spec, *frozen),
        out_shardings=(shardings, replicated),
        donate_argnums=(1,),
    )
    return lambda state, batch, *held: kept(state.params, (state.step, state.opt_state), batch,
                                            *held)  # fmt: skip
