"""Loading Hugging Face checkpoints into Flax parameters and exporting them back.

Both directions go through the tables in `jaxrlhf.models.mapping`. Export is a stream of
(HF name, numpy array) pairs produced one tensor at a time: `save_pretrained` writes it to
safetensors, the weight-sync client sends it to the generator.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrlhf.distributed import to_host
from jaxrlhf.models import mapping
from jaxrlhf.models.config import ModelConfig, config_from_hf, config_to_hf
from jaxrlhf.models.safetensors_io import DTYPE_NAMES, SafetensorsFile, numpy_dtype, write_file
from jaxrlhf.models.transformer import Transformer, abstract_params
from jaxrlhf.sharding import param_logical_axes, tree_shardings

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


# The files of a hub model that loading reads (what `resolve_model_path` downloads).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]


def resolve_model_path(path_or_name: str | os.PathLike) -> Path:
    """A local folder as is; otherwise a hub name, fetched with huggingface_hub (needs network)."""
    path = Path(path_or_name)
    if path.is_dir():
        return path
    if path.exists() or str(path_or_name).startswith((".", "/")):
        raise FileNotFoundError(f"model folder {path} does not exist or is not a folder")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(path_or_name), allow_patterns=HUB_PATTERNS))


def read_config(path: str | os.PathLike) -> ModelConfig:
    folder = resolve_model_path(path)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder")
    return config_from_hf(json.loads(config_file.read_text()))


def _open_checkpoint(folder: Path) -> dict[str, SafetensorsFile]:
    """HF tensor name -> the (memory-mapped) file holding it; single file or sharded index."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: SafetensorsFile(folder / name) for name in sorted(set(weight_map.values()))}
        return {tensor: files[file] for tensor, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{folder} has neither model.safetensors nor model.safetensors.index.json "
            "(PyTorch .bin checkpoints are not supported: re-save with safe_serialization=True)"
        )
    handle = SafetensorsFile(single)
    return {name: handle for name in handle.names()}


def make_model(
    config: ModelConfig,
    dtype: str = "float32",
    remat: bool = False,
    contraction_block: int = 0,
    param_dtype: str | None = None,
    logprob_chunk: int = 0,
) -> Transformer:
    """The Flax model for `config`, computing in `dtype` with parameters in `param_dtype`
    (default: `dtype`); `contraction_block` > 0: see `layers.contract` (CPU fp32);
    `logprob_chunk` > 0: see `layers.target_logprobs`."""
    compute = jnp.dtype(numpy_dtype(dtype))
    stored = jnp.dtype(numpy_dtype(param_dtype or dtype))
    config = dataclasses.replace(
        config, contraction_block=contraction_block, logprob_chunk=logprob_chunk
    )
    return Transformer(config, dtype=compute, param_dtype=stored, remat=remat)


def load_pretrained(
    path: str | os.PathLike,
    dtype: str = "float32",
    head: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    remat: bool = False,
    seed: int = 0,
    contraction_block: int = 0,
    param_dtype: str | None = None,
    logprob_chunk: int = 0,
) -> tuple[Transformer, dict]:
    """Loads a Hugging Face folder (or hub name) into (model, params).

    The model computes in `dtype`; its parameters are held in `param_dtype` (default: `dtype`),
    e.g. float32 master weights for a bfloat16 policy that trains at a small learning rate.

    `contraction_block` > 0 splits float32 matmuls into blocks for torch-level accuracy on CPU,
    at a speed cost (see `jaxrlhf.models.layers.contract`).

    `head` switches the head: "score" turns a causal LM into a reward/value model (the score
    weights start random with std 0.02 unless the checkpoint has them), "lm" the reverse is not
    allowed. With `mesh`, each parameter is placed sharded by the logical-axis rules as it is read.
    """
    folder = resolve_model_path(path)
    config = read_config(folder)
    if head is not None and head != config.head:
        if head == "lm":
            raise ValueError(f"{folder} holds a scalar-head model; it has no LM head to load")
        config = config.with_head(head)
    model = make_model(config, dtype, remat, contraction_block, param_dtype, logprob_chunk)
    files = _open_checkpoint(folder)
    params = params_from_hf(
        model, {name: functools.partial(f.get, name) for name, f in files.items()},
        param_dtype or dtype,
        mesh=mesh, seed=seed, source=str(folder),
    )  # fmt: skip
    return model, params


def params_from_hf(
    model: Transformer,
    tensors: Mapping[str, np.ndarray | Callable[[], np.ndarray]],
    dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    seed: int = 0,
    source: str = "the tensors",
) -> dict:
    """Flax params of `model` from HF-layout tensors (name -> array, or a function reading it).

    The inverse of `iter_hf_tensors`; params in `dtype` (default: the model's param_dtype).
    Every tensor the model needs must be there with the exact
    shape, and none may be left over (ValueError naming it); a missing `score` head starts
    random (std 0.02, `seed`). With `mesh`, each parameter is placed sharded as it is made.
    """
    config = model.config
    abstract = abstract_params(model)
    unboxed = nn.meta.unbox(abstract)
    flax_shapes = {p: tuple(a.shape) for p, a in mapping.flatten(unboxed).items()}
    shardings = None
    if mesh is not None:
        shardings = mapping.flatten(tree_shardings(unboxed, param_logical_axes(abstract), mesh))
    np_dtype = numpy_dtype(dtype or jnp.dtype(model.param_dtype).name)
    used: set[str] = set()
    flat_params: dict[str, Any] = {}
    for rule in mapping.bound_rules(config, list(flax_shapes)):
        shape = flax_shapes[rule.flax]
        layer_shape = shape[1:] if rule.per_layer else shape
        names = mapping.hf_names(rule, config.num_layers)
        missing = [n for n in names if n not in tensors]
        if missing and rule.flax == "score":
            rng = np.random.default_rng(seed)
            value = (rng.standard_normal(shape) * 0.02).astype(np_dtype)
        elif missing:
            raise ValueError(f"{source}: checkpoint lacks tensor {missing[0]} (for {rule.flax})")
        else:
            parts = []
            for name in names:
                hf_array = tensors[name]
                hf_array = np.asarray(hf_array() if callable(hf_array) else hf_array)
                expected = rule.layout.hf_shape(layer_shape)
                if hf_array.shape != expected:
                    raise ValueError(
                        f"{source}: tensor {name} has shape {hf_array.shape}, expected {expected}"
                    )
                parts.append(rule.layout.to_flax(hf_array, layer_shape).astype(np_dtype))
                used.add(name)
            value = np.stack(parts) if rule.per_layer else parts[0]
        if shardings is not None:
            flat_params[rule.flax] = jax.device_put(value, shardings[rule.flax])
        else:
            flat_params[rule.flax] = jnp.asarray(value)
    unused = [
        n
        for n in tensors
        if n not in used
        and not mapping.IGNORED_HF.match(n)
        and not (config.head == "score" and n in ("lm_head.weight", "embed_out.weight"))
    ]
    if unused:
        raise ValueError(f"{source}: checkpoint tensors not used by the model: {unused[:5]}")
    return mapping.unflatten(flat_params)


def _on_one_cpu(array: jax.Array) -> bool:
    devices = array.sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def iter_hf_tensors(
    model: Transformer, params: dict, dtype: str | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (HF name, array) for every tensor of the HF layout, one tensor at a time.

    The arrays may be strided views (a kernel is its Flax array transposed): consumers copy
    each once, into a message, a file or a mapped region. Never a second copy of the model: a
    parameter on one CPU device is read in place (cast first, when `dtype` differs), any other
    one (sharded, or on an accelerator) is cast on its devices and copied to the host one
    per-layer slice at a time (`to_host`), the previous slice released first: a process of a
    multi-process learner holds its own shards plus about one tensor.
    """
    flat = mapping.flatten(params)
    np_dtype = numpy_dtype(dtype) if dtype else None
    rules = mapping.bound_rules(model.config, list(flat))
    views: dict[str, np.ndarray] = {}  # a leaf on one CPU device, as it is: its buffer
    for rule, layer, name in mapping.export_order(rules, model.config.num_layers):
        leaf = flat[rule.flax]
        cast = np_dtype is not None and leaf.dtype != np_dtype
        if _on_one_cpu(leaf) and not cast:
            whole = views.get(rule.flax)
            if whole is None:
                whole = views[rule.flax] = np.asarray(leaf)
            host = whole if layer is None else whole[layer]
        elif layer is not None:
            # this layer only, cast on the devices (half the bytes to move for bf16)
            host = to_host(_layer_as(leaf, layer, np_dtype if cast else None))
        else:
            host = to_host(leaf.astype(np_dtype) if cast else leaf)
        yield name, rule.layout.to_hf(host)
        del host


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple, tuple]:
    """(first index, extent) per dimension of a shard's index into an array of `shape`."""
    start = tuple(0 if part.start is None else part.start for part in index)
    stop = tuple(
        dim if part.stop is None else part.stop for part, dim in zip(index, shape, strict=True)
    )
    return start, tuple(b - a for a, b in zip(start, stop, strict=True))


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """Who sends what when every process publishes its own part (`iter_hf_slices`): per Flax
    leaf, the devices whose shard of it is sent (one per distinct shard over all processes: the
    lowest device id that holds it: process 0 always sends some of each), or None for a leaf
    whose shards are not boxes of its HF tensors; and the processes that send, in order."""

    owners: dict[str, frozenset | None]
    senders: tuple[int, ...]

    @property
    def gathered(self) -> list[str]:
        """The leaves whose shards are not boxes of their HF tensors."""
        return [leaf for leaf, owners in self.owners.items() if owners is None]

    def sender(self, process: int) -> int | None:
        """`process`'s index among the senders (None: it sends nothing)."""
        return self.senders.index(process) if process in self.senders else None


def slice_plan(model: Transformer, params: dict) -> SlicePlan:
    """The `SlicePlan` of `params` (the same on every process: read from the shardings)."""
    flat = mapping.flatten(params)
    owners: dict[str, frozenset | None] = {}
    senders = {0} if jax.process_count() == 1 else set()
    for rule in mapping.bound_rules(model.config, list(flat)):
        leaf = flat[rule.flax]
        layer_shape = tuple(leaf.shape[1:] if rule.per_layer else leaf.shape)
        first: dict[tuple, jax.Device] = {}
        boxes_ok = True
        for device, index in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
            start, extent = _box(index, tuple(leaf.shape))
            key = (start, extent)
            if key not in first or device.id < first[key].id:
                first[key] = device
            inner = (start[1:], extent[1:]) if rule.per_layer else (start, extent)
            boxes_ok = boxes_ok and rule.layout.hf_box(*inner, layer_shape) is not None
        if boxes_ok:
            owners[rule.flax] = frozenset(first.values())
            senders.update(device.process_index for device in first.values())
        else:
            owners[rule.flax] = None
    return SlicePlan(owners, tuple(sorted(senders)))


def iter_hf_slices(
    model: Transformer, params: dict, dtype: str | None = None, plan: SlicePlan | None = None
) -> Iterator[tuple[str, Any]]:
    """This process's part of every HF tensor, for publishing with no gather: (HF name,
    `TensorSlice`) for each shard this process's devices own (`SlicePlan`), a layer at a time,
    tensor by tensor in `iter_hf_tensors`' order. Together, the processes' slices cover every
    tensor exactly once.

    No collective and no whole tensor: a shard on a CPU device is read in place (a view of its
    buffer), any other one is copied to the host a layer's shard at a time, cast on its device
    first when `dtype` differs. Raises ValueError for a leaf whose shards are not boxes of
    the HF tensor (`SlicePlan.gathered`): such a model is published gathered.
    """
    from jaxrlhf_wire.chunks import TensorSlice

    plan = slice_plan(model, params) if plan is None else plan
    flat = mapping.flatten(params)
    np_dtype = numpy_dtype(dtype) if dtype else None
    rules = mapping.bound_rules(model.config, list(flat))
    for rule in rules:
        if plan.owners[rule.flax] is None:
            raise ValueError(
                f"parameter {rule.flax}: its shards are not boxes of HF tensor(s) "
                f"{mapping.hf_names(rule, model.config.num_layers)[0]}... (a reshape merges "
                "dimensions they split); publish it gathered"
            )
    shards_of: dict[str, list] = {}  # each leaf's shards this process sends, in box order
    for rule, i, name in mapping.export_order(rules, model.config.num_layers):
        leaf = flat[rule.flax]
        cast = np_dtype is not None and leaf.dtype != np_dtype
        owners = plan.owners[rule.flax]
        layer_shape = tuple(leaf.shape[1:] if rule.per_layer else leaf.shape)
        hf_shape = rule.layout.hf_shape(layer_shape)
        shards = shards_of.get(rule.flax)
        if shards is None:
            shards = [shard for shard in leaf.addressable_shards if shard.device in owners]
            shards.sort(key=lambda shard: _box(shard.index, tuple(leaf.shape)))
            shards_of[rule.flax] = shards
        for shard in shards:
            start, extent = _box(shard.index, tuple(leaf.shape))
            if rule.per_layer:
                if not start[0] <= i < start[0] + extent[0]:
                    continue
                layer, start, extent = i - start[0], start[1:], extent[1:]
            else:
                layer = None
            hf_start, _ = rule.layout.hf_box(start, extent, layer_shape)
            host = _shard_on_host(shard.data, layer, np_dtype if cast else None)
            yield name, TensorSlice(hf_shape, hf_start, rule.layout.to_hf(host))
            del host


def _shard_on_host(data: jax.Array, layer: int | None, dtype) -> np.ndarray:
    """One device's shard (its `layer`, if stacked) on the host, cast to `dtype` (None: as
    it is): a view of a CPU buffer when nothing is to be cast, else a copy of that part."""
    if dtype is None and _on_one_cpu(data):
        whole = np.asarray(data)
        return whole if layer is None else whole[layer]
    if layer is None:
        return np.asarray(data.astype(dtype) if dtype is not None else data)
    return np.asarray(_layer_as(data, layer, dtype))


def _layer_as(array: jax.Array, layer: int, dtype) -> jax.Array:
    """Layer `layer` of a stacked array, cast to `dtype` (None: as it is), in one program on
    its devices: the cast reads the layer in place, no copy of the layer comes first."""
    return _layer_program(None if dtype is None else np.dtype(dtype).name)(array, layer)


@functools.cache
def _layer_program(dtype: str | None):
    def take(array, layer):
        part = jax.lax.dynamic_index_in_dim(array, layer, keepdims=False)
        return part if dtype is None else part.astype(dtype)

    return jax.jit(take)


def hf_tensor_specs(
    model: Transformer, params: dict, dtype: str | None = None
) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(name, shape, dtype) of each tensor `iter_hf_tensors` yields, in the same order."""
    flat = mapping.flatten(params)
    shapes = {path: tuple(leaf.shape) for path, leaf in flat.items()}
    dtypes = {path: np.dtype(leaf.dtype) for path, leaf in flat.items()}
    specs = []
    rules = mapping.bound_rules(model.config, list(shapes))
    for rule, _, name in mapping.export_order(rules, model.config.num_layers):
        layer_shape = shapes[rule.flax][1:] if rule.per_layer else shapes[rule.flax]
        shape = rule.layout.hf_shape(tuple(layer_shape))
        specs.append((name, shape, numpy_dtype(dtype) if dtype else dtypes[rule.flax]))
    return specs


def save_pretrained(
    model: Transformer,
    params: dict,
    path: str | os.PathLike,
    dtype: str | None = None,
    tokenizer_from: str | os.PathLike | None = None,
    max_shard_bytes: int = 4 << 30,
    write: bool = True,
) -> Path:
    """Writes a Hugging Face folder (config.json + safetensors, sharded with an index when larger
    than `max_shard_bytes`) that transformers and vLLM load. `tokenizer_from` copies tokenizer and
    generation-config files from another model folder. `write=False`: only take part in
    gathering the tensors (the other processes of a multi-process learner; one process writes).
    """
    out = Path(path)
    if not write:
        for _ in iter_hf_tensors(model, params, dtype):
            pass
        return out
    out.mkdir(parents=True, exist_ok=True)
    specs = hf_tensor_specs(model, params, dtype)
    shards: list[list[tuple[str, tuple[int, ...], np.dtype]]] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1])) * spec[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    stream = iter_hf_tensors(model, params, dtype)
    if len(shards) == 1:
        write_file(out / "model.safetensors", shards[0], stream)
    else:
        weight_map, total = {}, 0
        for k, shard in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            total += write_file(out / file, shard, stream)
            weight_map.update({name: file for name, _, _ in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config = config_to_hf(model.config)
    # transformers >= 5 reads "dtype"; older readers (and some vLLM paths) "torch_dtype".
    dtype_name = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[DTYPE_NAMES[specs[0][2]]]
    hf_config["dtype"] = hf_config["torch_dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    if tokenizer_from is not None:
        source = resolve_model_path(tokenizer_from)
        for name in TOKENIZER_FILES:
            if (source / name).exists() and source.resolve() != out.resolve():
                shutil.copy(source / name, out / name)
    return out
