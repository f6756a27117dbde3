"""The device mesh and the one table that maps logical axis names to mesh axes.

Parameters and activations are annotated with logical names (`embed`, `mlp`, `heads`, ...);
`LOGICAL_RULES` maps each to mesh axes (`data`, `fsdp`, `tensor`). A dimension that a mesh axis
does not divide evenly stays replicated on that axis (e.g. 2 KV heads on a tensor axis of 8), so
any model runs on any mesh; the rules describe the sharding wherever the sizes allow it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes. Parameter axes first, then activation axes (prefixed "act_"): the
# embedding dimension of the weights is split over `fsdp` (ZeRO-3 style) while the residual stream
# keeps it whole, because the batch is already split over `data` and `fsdp`.
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("qkv", None),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),  # a LoRA factor's rank dim; its other dim follows the kernel's rule
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh. One entry may be -1: it takes the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape needs 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {shape}")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(
            f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices, but {len(devices)} are "
            f"available (set one axis to -1 to use them all)"
        )
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    shape: Sequence[int],
    mesh: Mesh,
    rules: Sequence[tuple[str, Any]] = LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array of `shape` whose dims carry `logical_axes`.

    A mesh axis is used at most once per array, size-1 mesh axes are dropped, and mesh axes that
    do not divide the dimension are dropped from the end until the rest does.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(logical_axes, shape, strict=True):
        target = table.get(name) if name is not None else None
        if name is not None and name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_RULES")
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
        while axes and size % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar(
    "jaxrlhf_sharding", default=None
)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Iterator[None]:
    """Makes `constrain` shard activations on `mesh` while tracing the enclosed code."""
    token = _ACTIVE.set((mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint on an activation; a no-op when no mesh is active."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(logical_axes, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def param_logical_axes(abstract_variables: Any) -> Any:
    """Tree of logical-axis tuples from `jax.eval_shape(model.init, ...)['params']`."""
    specs = nn.get_partition_spec(abstract_variables)
    return jax.tree.map(
        lambda spec: tuple(spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def tree_shardings(
    abstract_tree: Any, logical_axes_tree: Any, mesh: Mesh, rules=LOGICAL_RULES
) -> Any:
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs) given their logical axes."""
    return jax.tree.map(
        lambda axes, leaf: NamedSharding(mesh, logical_to_spec(axes, leaf.shape, mesh, rules)),
        logical_axes_tree,
        abstract_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def optimizer_state_shardings(abstract_opt_state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optax state: every sub-tree shaped like the params (Adam's mu and nu, ...)
    is sharded like the params; everything else (step counts) is replicated."""
    params_def = jax.tree.structure(params_shardings)
    replicated = NamedSharding(mesh, PartitionSpec())

    def is_params_like(node: Any) -> bool:
        try:
            return jax.tree.structure(node) == params_def
        except Exception:  # noqa: BLE001 - any non-matching node is simply not params-like
            return False

    return jax.tree.map(
        lambda node: params_shardings if is_params_like(node) else replicated,
        abstract_opt_state,
        is_leaf=is_params_like,
    )


def batch_sharding(mesh: Mesh, ndim: int, batch_size: int) -> NamedSharding:
    """Split the leading (batch) dimension over data and fsdp; other dims replicated."""
    spec = logical_to_spec(
        ("batch",) + (None,) * (ndim - 1), (batch_size,) + (1,) * (ndim - 1), mesh
    )
    return NamedSharding(mesh, spec)


def shard_batch(batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Places a host batch on the mesh, batch dimension split over (data, fsdp).

    In a multi-process run each process passes its own slice of the global batch.
    """
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        global_batch = value.shape[0] * jax.process_count()
        sharding = batch_sharding(mesh, value.ndim, global_batch)
        out[name] = jax.make_array_from_process_local_data(sharding, value)
    return out


def initialize_distributed(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    """Starts JAX's multi-controller runtime; on a cluster JAX can infer all three arguments.

    CPU collectives go through gloo (the CPU backend has none of its own across processes);
    accelerators keep their own (NCCL on GPUs).
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if coordinator_address:
        kwargs = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    jax.distributed.initialize(**kwargs)
