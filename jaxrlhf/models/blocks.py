"""Decoder blocks: the Llama block (also SmolLM2, Mistral, Qwen2) and the GPT-NeoX block (Pythia).

Each block maps the residual stream [B, T, E] to the next one. Both are pre-norm; GPT-NeoX may add
attention and MLP outputs in parallel (`use_parallel_residual`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.layers import (
    LayerNorm,
    Projection,
    RMSNorm,
    apply_rope,
    dot_product_attention,
    residual_constraint,
)
from jaxrlhf.sharding import constrain

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported ({sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class LlamaBlock(nn.Module):
    """x + attn(rmsnorm(x)), then + mlp(rmsnorm(·)) with mlp = down(act(gate(x)) · up(x))."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, bias, positions, inv_freq):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        h = RMSNorm(cfg.norm_eps, dt, pdt, name="input_norm")(x)
        x = x + Attention(cfg, dt, pdt, name="attn")(h, bias, positions, inv_freq)
        x = residual_constraint(x)
        h = RMSNorm(cfg.norm_eps, dt, pdt, name="post_attn_norm")(x)
        x = x + GatedMLP(cfg, dt, pdt, name="mlp")(h)
        return residual_constraint(x), None


class NeoXBlock(nn.Module):
    """Parallel: x + attn(ln1(x)) + mlp(ln2(x)); sequential: as in Llama, with LayerNorm."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, bias, positions, inv_freq):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        attn = Attention(cfg, dt, pdt, name="attn")
        mlp = PlainMLP(cfg, dt, pdt, name="mlp")
        ln1 = LayerNorm(cfg.norm_eps, dt, pdt, name="input_norm")
        ln2 = LayerNorm(cfg.norm_eps, dt, pdt, name="post_attn_norm")
        if cfg.parallel_residual:
            x = x + attn(ln1(x), bias, positions, inv_freq) + mlp(ln2(x))
        else:
            x = residual_constraint(x + attn(ln1(x), bias, positions, inv_freq))
            x = x + mlp(ln2(x))
        return residual_constraint(x), None


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention with rotary embeddings.

    Llama family: separate q/k/v projections. GPT-NeoX: one fused projection whose output is laid
    out per head as (q, k, v) — the layout of its `query_key_value` weight.
    """

    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, bias, positions, inv_freq):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(out_shape, out_axes, use_bias, name):
            return Projection(
                out_shape, ("embed",), out_axes, use_bias, dt, pdt, cfg.contraction_block,
                cfg.lora_rank_of(name), cfg.lora_scale, name=name,
            )(x)  # fmt: skip

        if cfg.is_neox:
            qkv = proj((heads, 3, head_dim), ("heads", "qkv", "head_dim"), cfg.qkv_bias, "qkv_proj")
            q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
        else:
            q = proj((heads, head_dim), ("heads", "head_dim"), cfg.qkv_bias, "q_proj")
            k = proj((kv_heads, head_dim), ("kv_heads", "head_dim"), cfg.qkv_bias, "k_proj")
            v = proj((kv_heads, head_dim), ("kv_heads", "head_dim"), cfg.qkv_bias, "v_proj")
        q = constrain(q, ("batch", "length", "act_heads", None))
        k = constrain(k, ("batch", "length", "act_kv_heads", None))
        v = constrain(v, ("batch", "length", "act_kv_heads", None))
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        out = dot_product_attention(q, k, v, bias, dt)
        out = constrain(out, ("batch", "length", "act_heads", None))
        return Projection(
            (cfg.hidden_size,),
            ("heads", "head_dim"),
            ("embed",),
            cfg.o_bias,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("o_proj"),
            cfg.lora_scale,
            name="o_proj",
        )(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) · up(x)) — the Llama MLP."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        inner = (cfg.intermediate_size,)
        gate = Projection(
            inner,
            ("embed",),
            ("mlp",),
            cfg.mlp_bias,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("gate_proj"),
            cfg.lora_scale,
            name="gate_proj",
        )(x)
        up = Projection(
            inner,
            ("embed",),
            ("mlp",),
            cfg.mlp_bias,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("up_proj"),
            cfg.lora_scale,
            name="up_proj",
        )(x)
        h = constrain(activation(cfg.hidden_act)(gate) * up, ("batch", "length", "act_mlp"))
        return Projection(
            (cfg.hidden_size,),
            ("mlp",),
            ("embed",),
            cfg.mlp_bias,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("down_proj"),
            cfg.lora_scale,
            name="down_proj",
        )(h)


class PlainMLP(nn.Module):
    """down(act(up(x))) — the GPT-NeoX MLP."""

    config: ModelConfig
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg, dt, pdt = self.config, self.dtype, self.param_dtype
        h = Projection(
            (cfg.intermediate_size,),
            ("embed",),
            ("mlp",),
            True,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("up_proj"),
            cfg.lora_scale,
            name="up_proj",
        )(x)
        h = constrain(activation(cfg.hidden_act)(h), ("batch", "length", "act_mlp"))
        return Projection(
            (cfg.hidden_size,),
            ("mlp",),
            ("embed",),
            True,
            dt,
            pdt,
            cfg.contraction_block,
            cfg.lora_rank_of("down_proj"),
            cfg.lora_scale,
            name="down_proj",
        )(h)


def block_class(config: ModelConfig) -> type[nn.Module]:
    return NeoXBlock if config.is_neox else LlamaBlock
