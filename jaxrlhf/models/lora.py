"""LoRA adapters on the Flax models, in PEFT's layout.

A model whose config has `lora_rank` r > 0 holds, beside each targeted linear layer's frozen
kernel W, two factors (`layers.Projection`): `lora_a` [*in, r] and `lora_b` [r, *out], and
computes x W + (alpha / r) x A B. PEFT's convention throughout: A starts Kaiming-uniform, B at
zero (a new adapter is the base model), the scale is alpha / r.

- `with_lora`: the same model with adapters on `targets` (Llama-family names, `TARGETS`).
- `split` / `merge`: a LoRA model's params as (adapter, base) and back; the adapter is what a
  LoRA run trains, checkpoints and publishes, the base never moves.
- `adapter_tensors` / `save_adapter` / `load_adapter`: the adapter as PEFT writes it
  (`adapter_model.safetensors`: `base_model.model.<HF module>.lora_A.weight` [r, in] and
  `lora_B.weight` [out, r]; `adapter_config.json`), which `peft.PeftModel.from_pretrained` and
  vLLM's LoRA loader read.
- `merged`: the base params with each adapter folded into its kernel (W + (alpha / r) A B), the
  parameters of the merged model any HF loader reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import jax
import numpy as np

from jaxrlhf.models import mapping
from jaxrlhf.models.mapping import KERNEL, KERNEL_FROM_HEADS, Layout, Rule
from jaxrlhf.models.safetensors_io import SafetensorsFile, write_file
from jaxrlhf.models.transformer import Transformer

# The linear layers an adapter may target (Llama family: Llama, Qwen2), by their HF and Flax
# module names, with their kernels' layouts.
_ATTN, _MLP = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
MODULES: dict[str, tuple[str, str, Layout]] = {
    "q_proj": ("layers/attn/q_proj", f"{_ATTN}.q_proj", KERNEL),
    "k_proj": ("layers/attn/k_proj", f"{_ATTN}.k_proj", KERNEL),
    "v_proj": ("layers/attn/v_proj", f"{_ATTN}.v_proj", KERNEL),
    "o_proj": ("layers/attn/o_proj", f"{_ATTN}.o_proj", KERNEL_FROM_HEADS),
    "gate_proj": ("layers/mlp/gate_proj", f"{_MLP}.gate_proj", KERNEL),
    "up_proj": ("layers/mlp/up_proj", f"{_MLP}.up_proj", KERNEL),
    "down_proj": ("layers/mlp/down_proj", f"{_MLP}.down_proj", KERNEL),
}
TARGETS = tuple(MODULES)
PEFT_PREFIX = "base_model.model."
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
FACTORS = ("lora_a", "lora_b")


def check_lora(family: str, rank: int, alpha: float, targets) -> None:
    """ValueError naming the first setting a LoRA model cannot have."""
    if family == "gpt_neox":
        raise ValueError("LoRA adapters are for the Llama family (llama, qwen2), not gpt_neox")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank {rank!r}: must be an integer >= 1")
    if not (isinstance(alpha, int | float) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"LoRA alpha {alpha!r}: must be a finite number > 0")
    unknown = [t for t in targets if t not in MODULES]
    if not targets or unknown:
        raise ValueError(f"LoRA targets {list(targets)}: name one or more of {', '.join(TARGETS)}"
                         + (f" ({', '.join(unknown)} is none)" if unknown else ""))  # fmt: skip


def with_lora(model: Transformer, rank: int, alpha: float, targets=TARGETS) -> Transformer:
    """`model` with LoRA adapters of `rank` and `alpha` on `targets` (`check_lora`)."""
    check_lora(model.config.family, rank, alpha, tuple(targets))
    chosen = tuple(t for t in TARGETS if t in targets)
    config = dataclasses.replace(model.config, lora_rank=rank, lora_alpha=float(alpha),
                                 lora_targets=chosen)  # fmt: skip
    return model.clone(config=config)


def base_model(model: Transformer) -> Transformer:
    """The model without its adapters (the base the adapters sit on)."""
    return model.clone(config=model.config.without_lora())


def is_factor(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in FACTORS


def split(params: dict) -> tuple[dict, dict]:
    """(adapter, base): the LoRA factors of a LoRA model's params, and everything else."""
    flat = mapping.flatten(params)
    adapter = {p: v for p, v in flat.items() if is_factor(p)}
    base = {p: v for p, v in flat.items() if not is_factor(p)}
    return mapping.unflatten(adapter), mapping.unflatten(base)


def merge(adapter: dict, base: dict) -> dict:
    """The LoRA model's params from its adapter and base (`split`'s inverse)."""
    return mapping.unflatten({**mapping.flatten(base), **mapping.flatten(adapter)})


def init_adapter(model: Transformer, seed: int = 0) -> dict:
    """A new adapter for the LoRA `model`: A Kaiming-uniform (U(±1/√fan_in), each layer its
    own), B zeros, in the model's param dtype, so that the model starts as its base."""
    config = model.config
    dtype = np.dtype(jax.numpy.dtype(model.param_dtype).name)
    rng = np.random.default_rng(seed)
    out = {}
    for target in config.lora_targets:
        flax, _, layout = MODULES[target]
        kernel = _kernel_shape(model, flax)  # [L, *in, *out]
        layers, ins, outs = kernel[0], kernel[1 : 1 + layout.n_in], kernel[1 + layout.n_in :]
        bound = 1.0 / math.sqrt(math.prod(ins))
        shape_a = (layers, *ins, config.lora_rank)
        out[f"{flax}/lora_a"] = rng.uniform(-bound, bound, shape_a).astype(dtype)
        out[f"{flax}/lora_b"] = np.zeros((layers, config.lora_rank, *outs), dtype)
    return mapping.unflatten(out)


def _kernel_shape(model: Transformer, flax: str) -> tuple[int, ...]:
    from jaxrlhf.models.transformer import abstract_params

    unboxed = jax.tree_util.tree_map(
        lambda x: x.value if hasattr(x, "value") else x,
        abstract_params(base_model(model)),
        is_leaf=lambda x: hasattr(x, "value"),
    )
    return tuple(mapping.flatten(unboxed)[f"{flax}/kernel"].shape)


def adapter_rules(config) -> list[Rule]:
    """The mapping rules of the adapter's factors to PEFT's tensor names, in table order."""
    rules = []
    for target in config.lora_targets:
        flax, hf, layout = MODULES[target]
        rules.append(Rule(f"{flax}/lora_a", f"{PEFT_PREFIX}{hf}.lora_A.weight", layout))
        rules.append(Rule(f"{flax}/lora_b", f"{PEFT_PREFIX}{hf}.lora_B.weight", KERNEL))
    return rules


def adapter_tensors(config, adapter: dict, dtype=None) -> dict[str, np.ndarray]:
    """{PEFT name: array}: A as [r, in], B as [out, r], layer by layer (`mapping.export_order`)."""
    flat = {p: np.asarray(v) for p, v in mapping.flatten(adapter).items()}
    out = {}
    for rule, layer, name in mapping.export_order(adapter_rules(config), config.num_layers):
        value = flat[rule.flax][layer]
        value = rule.layout.to_hf(value if dtype is None else value.astype(dtype))
        out[name] = np.ascontiguousarray(value)
    return out


def peft_config(config, base_name: str) -> dict:
    """The `adapter_config.json` PEFT and vLLM read for this adapter."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_name,
        "r": config.lora_rank, "lora_alpha": config.lora_alpha,
        "target_modules": list(config.lora_targets), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "init_lora_weights": True, "modules_to_save": None, "rank_pattern": {},
        "alpha_pattern": {},
    }  # fmt: skip


def save_adapter(model: Transformer, adapter: dict, folder: str | os.PathLike,
                 base_name: str = "", dtype=None) -> Path:  # fmt: skip
    """Writes the adapter as PEFT does (module docstring) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(model.config, adapter, dtype)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    write_file(folder / ADAPTER_FILE, specs, iter(tensors.items()), metadata={"format": "pt"})
    config = peft_config(model.config, base_name)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def load_adapter(model: Transformer, folder: str | os.PathLike) -> tuple[Transformer, dict]:
    """(the LoRA model, its adapter) from a PEFT adapter folder on `model`'s base: its rank,
    alpha and targets from `adapter_config.json`; every factor there, with the base's shapes
    (ValueError naming what does not fit)."""
    folder = Path(folder)
    settings = json.loads((folder / ADAPTER_CONFIG).read_text())
    for key, allowed in (("bias", "none"), ("use_rslora", False), ("use_dora", False)):
        if settings.get(key, allowed) != allowed:
            raise ValueError(f"{folder}: {key}={settings[key]!r} is not supported")
    targets = settings["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    lora = with_lora(base_model(model), int(settings["r"]), float(settings["lora_alpha"]), targets)
    shapes = mapping.flatten(init_adapter(lora))
    handle = SafetensorsFile(folder / ADAPTER_FILE)
    names = set(handle.names())
    flat = {}
    for rule in adapter_rules(lora.config):
        shape = shapes[rule.flax].shape
        layers = []
        for name in mapping.hf_names(rule, lora.config.num_layers):
            if name not in names:
                raise ValueError(f"{folder}: the adapter lacks {name}")
            array = np.asarray(handle.get(name))
            if tuple(array.shape) != rule.layout.hf_shape(shape[1:]):
                raise ValueError(f"{folder}: {name} has shape {list(array.shape)}, the base needs "
                                 f"{list(rule.layout.hf_shape(shape[1:]))}")  # fmt: skip
            names.discard(name)
            layers.append(rule.layout.to_flax(array, shape[1:]))
        flat[rule.flax] = np.stack(layers).astype(shapes[rule.flax].dtype)
    if names:
        raise ValueError(f"{folder}: tensors no target of this adapter holds: {sorted(names)[:3]}")
    return lora, mapping.unflatten(flat)


def merged(config, params: dict) -> dict:
    """The base params with each adapter folded into its kernel: W + (alpha / r) A B, summed in
    float32 and stored in the kernel's dtype."""
    adapter, base = split(params)
    flat, factors = dict(mapping.flatten(base)), mapping.flatten(adapter)
    for target in config.lora_targets:
        flax, _, _ = MODULES[target]
        a = np.asarray(factors[f"{flax}/lora_a"], np.float32)
        b = np.asarray(factors[f"{flax}/lora_b"], np.float32)
        kernel = np.asarray(flat[f"{flax}/kernel"])
        delta = _delta(a, b)
        total = kernel.astype(np.float32) + config.lora_scale * delta
        flat[f"{flax}/kernel"] = jax.numpy.asarray(total.astype(kernel.dtype))
    return mapping.unflatten(flat)


def _delta(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A B per layer: A [L, *in, r] · B [L, r, *out] -> [L, *in, *out]."""
    layers, rank = a.shape[0], a.shape[-1]
    ins, outs = a.shape[1:-1], b.shape[2:]
    flat = np.matmul(a.reshape(layers, -1, rank), b.reshape(layers, rank, -1))
    return flat.reshape(layers, *ins, *outs)


def merged_on_device(config, adapter: dict, base: dict) -> dict:
    """`merged` in jax (jit-able, each array where its inputs are): the base params with each
    adapter folded into its kernel, W + (alpha / r) A B summed in float32."""
    flat, factors = dict(mapping.flatten(base)), mapping.flatten(adapter)
    for target in config.lora_targets:
        flax, _, _ = MODULES[target]
        a = factors[f"{flax}/lora_a"].astype(jax.numpy.float32)
        b = factors[f"{flax}/lora_b"].astype(jax.numpy.float32)
        kernel = flat[f"{flax}/kernel"]
        layers, rank = a.shape[0], a.shape[-1]
        delta = jax.numpy.matmul(a.reshape(layers, -1, rank), b.reshape(layers, rank, -1))
        total = kernel.astype(jax.numpy.float32) + config.lora_scale * delta.reshape(kernel.shape)
        flat[f"{flax}/kernel"] = total.astype(kernel.dtype)
    return mapping.unflatten(flat)
