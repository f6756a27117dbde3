"""Declarative name/layout tables between Hugging Face checkpoints and our Flax parameters.

One table per architecture, used in both directions: HF -> Flax for loading, Flax -> HF for
export and for streaming weights to the generator. Each rule names a Flax parameter path, the HF
tensor name (with `{i}` for the layer index; Flax stacks layers on a leading axis, see
`nn.scan`) and a layout:

- `SAME`:   identical array (embeddings, norm scales).
- `Kernel(n_in)`: HF Linear weight [out, in] <-> Flax kernel [*in_dims, *out_dims]; the flat HF
  dims are the row-major flattening of the Flax dims (heads before head_dim, and for GPT-NeoX's
  fused `query_key_value` the per-head (q, k, v) triplet), so the conversion is transpose + reshape.
- `VECTOR`: HF bias [out] <-> Flax bias [*out_dims], a reshape.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

import numpy as np

from jaxrlhf.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Layout:
    kind: str  # "same", "kernel" or "vector"
    n_in: int = 1  # kernels: how many leading Flax dims are input dims

    def to_flax(self, hf: np.ndarray, flax_shape: tuple[int, ...]) -> np.ndarray:
        if self.kind == "kernel":
            return hf.T.reshape(flax_shape)
        return hf.reshape(flax_shape)

    def to_hf(self, flax: np.ndarray) -> np.ndarray:
        if self.kind == "kernel":
            in_flat = math.prod(flax.shape[: self.n_in])
            return flax.reshape(in_flat, -1).T
        if self.kind == "vector":
            return flax.reshape(-1)
        return flax

    def hf_shape(self, flax_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "kernel":
            return (math.prod(flax_shape[self.n_in :]), math.prod(flax_shape[: self.n_in]))
        if self.kind == "vector":
            return (math.prod(flax_shape),)
        return tuple(flax_shape)

    def hf_box(
        self, start: tuple[int, ...], extent: tuple[int, ...], flax_shape: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Where a box of the Flax array (its first index and extent per dimension, e.g. one
        device's shard) lies in the HF tensor: (start, extent) there, or None when its elements
        are not one box of the HF tensor (a reshape merges dimensions the box splits)."""
        if self.kind == "kernel":
            n = self.n_in
            inner = _merged(start[:n], extent[:n], flax_shape[:n])
            outer = _merged(start[n:], extent[n:], flax_shape[n:])
            if inner is None or outer is None:
                return None
            return (outer[0], inner[0]), (outer[1], inner[1])
        if self.kind == "vector":
            merged = _merged(start, extent, flax_shape)
            return None if merged is None else ((merged[0],), (merged[1],))
        return tuple(start), tuple(extent)


def _merged(start, extent, shape) -> tuple[int, int] | None:
    """(first index, extent) of a box of `shape` once its dimensions are merged into one
    (row-major), or None when its elements are not one contiguous range there: the box must be
    one index wide up to some dimension and whole after it."""
    first = next((d for d in range(len(shape)) if extent[d] != 1), len(shape) - 1)
    if any(extent[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    flat = sum(s * math.prod(shape[d + 1 :]) for d, s in enumerate(start))
    return flat, math.prod(extent)


SAME = Layout("same")
KERNEL = Layout("kernel", 1)
KERNEL_FROM_HEADS = Layout("kernel", 2)  # attention output projection: in dims (heads, head_dim)
VECTOR = Layout("vector")


@dataclasses.dataclass(frozen=True)
class Rule:
    flax: str  # "/"-joined parameter path; paths under "layers/" are stacked over layers
    hf: str  # HF tensor name, "{i}" = layer index
    layout: Layout

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def _linear(flax: str, hf: str, kernel: Layout = KERNEL) -> list[Rule]:
    return [
        Rule(f"{flax}/kernel", f"{hf}.weight", kernel),
        Rule(f"{flax}/bias", f"{hf}.bias", VECTOR),
    ]


_L = "model.layers.{i}"
LLAMA_RULES: tuple[Rule, ...] = (
    Rule("embedding", "model.embed_tokens.weight", SAME),
    Rule("layers/input_norm/scale", f"{_L}.input_layernorm.weight", SAME),
    *_linear("layers/attn/q_proj", f"{_L}.self_attn.q_proj"),
    *_linear("layers/attn/k_proj", f"{_L}.self_attn.k_proj"),
    *_linear("layers/attn/v_proj", f"{_L}.self_attn.v_proj"),
    *_linear("layers/attn/o_proj", f"{_L}.self_attn.o_proj", KERNEL_FROM_HEADS),
    Rule("layers/post_attn_norm/scale", f"{_L}.post_attention_layernorm.weight", SAME),
    *_linear("layers/mlp/gate_proj", f"{_L}.mlp.gate_proj"),
    *_linear("layers/mlp/up_proj", f"{_L}.mlp.up_proj"),
    *_linear("layers/mlp/down_proj", f"{_L}.mlp.down_proj"),
    Rule("final_norm/scale", "model.norm.weight", SAME),
    Rule("lm_head", "lm_head.weight", KERNEL),
    Rule("score", "score.weight", KERNEL),
)

_N = "gpt_neox.layers.{i}"
NEOX_RULES: tuple[Rule, ...] = (
    Rule("embedding", "gpt_neox.embed_in.weight", SAME),
    Rule("layers/input_norm/scale", f"{_N}.input_layernorm.weight", SAME),
    Rule("layers/input_norm/bias", f"{_N}.input_layernorm.bias", SAME),
    Rule("layers/post_attn_norm/scale", f"{_N}.post_attention_layernorm.weight", SAME),
    Rule("layers/post_attn_norm/bias", f"{_N}.post_attention_layernorm.bias", SAME),
    *_linear("layers/attn/qkv_proj", f"{_N}.attention.query_key_value"),
    *_linear("layers/attn/o_proj", f"{_N}.attention.dense", KERNEL_FROM_HEADS),
    *_linear("layers/mlp/up_proj", f"{_N}.mlp.dense_h_to_4h"),
    *_linear("layers/mlp/down_proj", f"{_N}.mlp.dense_4h_to_h"),
    Rule("final_norm/scale", "gpt_neox.final_layer_norm.weight", SAME),
    Rule("final_norm/bias", "gpt_neox.final_layer_norm.bias", SAME),
    Rule("lm_head", "embed_out.weight", KERNEL),
    Rule("score", "score.weight", KERNEL),
)

# Checkpoint entries that are buffers, not parameters (older exports carry them).
IGNORED_HF = re.compile(r".*(rotary_emb\.inv_freq|attention\.bias|attention\.masked_bias)$")


def rules_for(config: ModelConfig) -> tuple[Rule, ...]:
    return NEOX_RULES if config.is_neox else LLAMA_RULES


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": x}} -> {"a/b": x}."""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict) or hasattr(value, "items") and not hasattr(value, "shape"):
            out.update(flatten(dict(value.items()), path))
        else:
            out[path] = value
    return out


def unflatten(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def bound_rules(config: ModelConfig, flax_paths: list[str]) -> list[Rule]:
    """The rules for the parameters that exist in this model, in table order.

    Raises if a Flax parameter has no rule (the table is incomplete for this architecture).
    """
    by_path = {rule.flax: rule for rule in rules_for(config)}
    missing = [path for path in flax_paths if path not in by_path]
    if missing:
        raise ValueError(f"no HF mapping rule for Flax parameters {missing} ({config.family})")
    present = set(flax_paths)
    return [rule for rule in rules_for(config) if rule.flax in present]


def hf_names(rule: Rule, num_layers: int) -> list[str]:
    if rule.per_layer:
        return [rule.hf.format(i=i) for i in range(num_layers)]
    return [rule.hf]


def export_order(rules: list[Rule], num_layers: int) -> list[tuple[Rule, int | None, str]]:
    """Every HF tensor of `rules` as (rule, layer index or None, HF name), in the order the
    model is exported and published: layer by layer. First the tensors outside the layers whose
    rules come before the layers' in the table (the embedding), then each layer's tensors in
    table order, then the rest (the final norm, the head). A generator that converts an update
    layer by layer as it arrives can start on a layer as soon as its last tensor has come,
    which with a tensor-by-tensor order (every layer's q_proj, then every layer's k_proj...)
    would be near the end of the update."""
    before, layered, after = [], [], []
    for rule in rules:
        if rule.per_layer:
            layered.append(rule)
        else:
            (after if layered else before).append(rule)
    order: list[tuple[Rule, int | None, str]] = [(rule, None, rule.hf) for rule in before]
    for i in range(num_layers):
        order += [(rule, i, rule.hf.format(i=i)) for rule in layered]
    return order + [(rule, None, rule.hf) for rule in after]


def hf_specs(
    config: ModelConfig, flax_shapes: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) of every tensor the export writes, in export order (`export_order`)."""
    for rule, _, name in export_order(bound_rules(config, list(flax_shapes)), config.num_layers):
        shape = flax_shapes[rule.flax]
        layer_shape = shape[1:] if rule.per_layer else shape
        yield name, rule.layout.hf_shape(tuple(layer_shape))
