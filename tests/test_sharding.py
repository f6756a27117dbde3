"""The sharded train step on 8 fake CPU devices equals the single-device step."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrlhf.models import load_pretrained
from jaxrlhf.sharding import logical_to_spec, make_mesh, shard_batch
from jaxrlhf.stages.sft import nll_loss
from jaxrlhf.train_state import (
    build_train_step,
    create_train_state,
    params_shardings,
    state_shardings,
)
from tests.conftest import tiny_model


def sharding_model():
    # 8 query heads (shardable 8-way) and 4 KV heads (replicated when tensor=8).
    return tiny_model("llama", name="llama-8heads", num_attention_heads=8, num_key_value_heads=4)


def make_batch():
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": rng.integers(3, 384, (8, 16)).astype(np.int32),
        "attention_mask": np.ones((8, 16), np.int32),
    }
    batch["attention_mask"][::2, :4] = 0
    batch["loss_mask"] = batch["attention_mask"][:, 1:].astype(np.float32)
    return batch


def run_steps(model_dir, mesh_shape, devices, local_batch, steps=2):
    """Loads the model sharded on a mesh and takes `steps` AdamW steps on the same batch.

    `local_batch` is this process's slice of the global batch (all of it in one process).
    """
    mesh = make_mesh(mesh_shape, devices)
    model, params = load_pretrained(model_dir, mesh=mesh)
    # eps well above float noise: Adam would otherwise blow near-zero gradients (whose sign is
    # rounding noise) up to full-size updates, which no two reduction orders agree on.
    optimizer = optax.adamw(1e-2, eps=1e-4)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    state = create_train_state(params, optimizer, shardings)
    global_shapes = {
        k: (v.shape[0] * jax.process_count(),) + v.shape[1:] for k, v in local_batch.items()
    }
    step = build_train_step(nll_loss(model), optimizer, mesh, shardings, global_shapes)
    losses = []
    for _ in range(steps):
        state, metrics = step(state, shard_batch(local_batch, mesh))
        losses.append(float(metrics["loss"]))
    return state, losses


def train_losses(model_dir, mesh_shape, devices, local_batch):
    """(losses, sum of |params| after the steps) — comparable across processes and meshes."""
    state, losses = run_steps(model_dir, mesh_shape, devices, local_batch)
    total = jax.jit(lambda p: sum(jnp.abs(x).sum() for x in jax.tree.leaves(p)))(state.params)
    return losses, float(total)


@pytest.fixture(scope="module")
def reference():
    return run_steps(sharding_model(), (1, 1, 1), jax.devices()[:1], make_batch())


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 1, 8), (2, 2, 2), (8, 1, 1)])
def test_sharded_step_equals_single_device(reference, mesh_shape):
    assert len(jax.devices()) == 8
    ref_state, ref_losses = reference
    state, losses = run_steps(sharding_model(), mesh_shape, jax.devices(), make_batch())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    for got, want in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)
    # The parameters really are sharded as the rules say.
    attn = state.params["layers"]["attn"]
    data, fsdp, tensor = mesh_shape
    q_spec = attn["q_proj"]["kernel"].sharding.spec  # [layers, embed, heads, head_dim]
    assert tuple(q_spec) == (
        None,
        "fsdp" if fsdp > 1 else None,
        "tensor" if tensor > 1 else None,
        None,
    )
    k_spec = attn["k_proj"]["kernel"].sharding.spec  # 4 KV heads split 2 ways, not 8
    assert k_spec[2] == ("tensor" if tensor == 2 else None)
    emb = state.params["embedding"]
    assert emb.sharding.shard_shape(emb.shape) == (384 // tensor, 128 // fsdp)
    mu = state.opt_state[0].mu["layers"]["mlp"]["up_proj"]["kernel"]
    assert mu.sharding == state.params["layers"]["mlp"]["up_proj"]["kernel"].sharding


def test_logical_rules_fall_back_when_not_divisible():
    mesh = make_mesh((2, 2, 2), jax.devices())
    assert logical_to_spec(("batch", "length"), (8, 5), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch",), (2,), mesh) == P("data")
    assert logical_to_spec(("kv_heads", "embed"), (3, 64), mesh) == P(None, "fsdp")
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh((2, 2, 4), jax.devices())
    assert make_mesh((-1, 2, 1)).shape["data"] == 4


def test_activation_constraint_is_noop_without_mesh():
    from jaxrlhf.sharding import constrain

    x = jnp.ones((4, 3))
    assert constrain(x, ("batch", None)) is x


def test_two_processes_match_single_device(reference, tmp_path):
    """jax.distributed over 2 processes x 2 CPU devices (gloo), mesh (1, 2, 2), half the batch
    per process: the same losses and parameters as one device with the whole batch."""
    import json
    import socket
    import subprocess
    import sys

    from tests.conftest import REPO

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model_dir = str(sharding_model())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distributed_worker", str(port), str(i), model_dir],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    ref_state, ref_losses = reference
    ref_total = float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(ref_state.params)))
    for result in results:
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=1e-5)
        np.testing.assert_allclose(result["checksum"], ref_total, rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", [(1, 8, 1), (1, 1, 8), (1, 2, 4), (8, 1, 1)])
def test_each_tensor_is_sliced_once_as_the_shards_lie(mesh_shape):
    """`iter_hf_slices` (publishing with no gather): the slices put together are exactly the
    tensors `iter_hf_tensors` gathers, every element sent once, none gathered."""
    from jaxrlhf.models import iter_hf_slices, iter_hf_tensors, slice_plan
    from jaxrlhf_wire.chunks import TensorSlice

    mesh = make_mesh(mesh_shape, jax.devices()[:8])
    model, params = load_pretrained(sharding_model(), mesh=mesh)
    whole = dict(iter_hf_tensors(model, params))
    plan = slice_plan(model, params)
    assert plan.senders == (0,) and all(owners for owners in plan.owners.values())
    built = {name: np.zeros_like(value) for name, value in whole.items()}
    sent = {name: np.zeros(value.shape, np.int32) for name, value in whole.items()}
    count = 0
    for name, piece in iter_hf_slices(model, params, plan=plan):
        assert isinstance(piece, TensorSlice) and piece.shape == whole[name].shape
        index = tuple(slice(s, s + n) for s, n in zip(piece.start, piece.data.shape, strict=True))
        built[name][index] = piece.data
        sent[name][index] += 1
        count += 1
    for name in whole:
        assert (sent[name] == 1).all(), name
        np.testing.assert_array_equal(built[name], whole[name], err_msg=name)
    if mesh_shape == (8, 1, 1):  # replicated everywhere: one slice per tensor
        assert count == len(whole)
    else:
        assert count > len(whole)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 2, 4)])
def test_tensors_are_published_layer_by_layer(mesh_shape):
    """The export order (`mapping.export_order`): the embedding, then each layer's tensors
    together, layer after layer, then the rest; the same for whole tensors (cast or not), the
    slices of a sharded model and the specs a shared file is laid out by. (The generator stages
    a layer once all of its tensors have come.)"""
    import re

    from jaxrlhf.models import hf_tensor_specs, iter_hf_slices, iter_hf_tensors

    mesh = make_mesh(mesh_shape, jax.devices()[: int(np.prod(mesh_shape))])
    model, params = load_pretrained(sharding_model(), mesh=mesh)
    names = [name for name, _ in iter_hf_tensors(model, params)]
    assert [name for name, _ in iter_hf_tensors(model, params, "bfloat16")] == names
    assert [name for name, _, _ in hf_tensor_specs(model, params, "bfloat16")] == names
    sliced = [name for name, _ in iter_hf_slices(model, params)]
    assert [n for i, n in enumerate(sliced) if i == 0 or sliced[i - 1] != n] == names
    layers = [int(m.group(1)) if (m := re.search(r"\.layers\.(\d+)\.", n)) else None
              for n in names]  # fmt: skip
    inside = [layer for layer in layers if layer is not None]
    assert inside == sorted(inside) and len(set(inside)) == model.config.num_layers > 1
    first, last = layers.index(0), len(layers) - 1 - layers[::-1].index(inside[-1])
    assert all(layer is not None for layer in layers[first : last + 1])
    assert names[0] == "model.embed_tokens.weight" and "model.norm.weight" in names[last + 1 :]


def test_a_shard_that_a_reshape_would_split_is_not_a_box():
    from jaxrlhf.models.mapping import KERNEL, KERNEL_FROM_HEADS, VECTOR

    shape = (16, 4, 8)  # a q kernel: embed, heads, head_dim
    assert KERNEL.hf_box((0, 2, 0), (16, 2, 8), shape) == ((16, 0), (16, 16))  # heads 2-3
    assert KERNEL.hf_box((8, 0, 0), (8, 4, 8), shape) == ((0, 8), (32, 8))  # embed half
    assert KERNEL.hf_box((0, 0, 4), (16, 4, 4), shape) is None  # head_dim halves: strided
    assert KERNEL_FROM_HEADS.hf_box((1, 0, 0), (1, 8, 16), (4, 8, 16)) == ((0, 8), (16, 8))
    assert VECTOR.hf_box((0, 4), (4, 4), (4, 8)) is None
    assert VECTOR.hf_box((2, 0), (2, 8), (4, 8)) == ((16,), (16,))


def test_a_step_that_keeps_its_parameters_leaves_them_valid_and_steps_the_same():
    """`keep_params` (a publish in the background reads the parameters beside the next step):
    the parameters the step read stay valid and unchanged; the step is the donating one's."""
    mesh = make_mesh((1, 2, 1), jax.devices()[:2])
    model, params = load_pretrained(sharding_model(), mesh=mesh)
    optimizer = optax.adamw(1e-2, eps=1e-4)
    shardings = state_shardings(params_shardings(model, mesh), optimizer, params, mesh)
    batch = make_batch()
    shapes = {k: v.shape for k, v in batch.items()}
    results = {}
    for keep in (True, False):  # the donating step last: it may delete `params` themselves
        state = create_train_state(params, optimizer, shardings)
        before = state.params
        step = build_train_step(nll_loss(model), optimizer, mesh, shardings, shapes,
                                keep_params=keep)  # fmt: skip
        after, _ = step(state, shard_batch(batch, mesh))
        leaf = jax.tree.leaves(before)[0]
        assert leaf.is_deleted() != keep
        if keep:
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(jax.tree.leaves(params)[0]))
        results[keep] = [np.asarray(x) for x in jax.tree.leaves(after.params)]
    for donated, kept in zip(results[False], results[True], strict=True):
        np.testing.assert_array_equal(donated, kept)
