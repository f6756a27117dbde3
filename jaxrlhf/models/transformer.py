"""The full model: embeddings, a scanned stack of decoder blocks, final norm and a head.

`head="lm"` returns next-token logits [B, T, V]; `head="score"` returns one scalar per position
[B, T] (the `*ForSequenceClassification` layout), used for reward and value models.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models.blocks import block_class
from jaxrlhf.models.config import ModelConfig
from jaxrlhf.models.layers import (
    LayerNorm,
    RMSNorm,
    attention_bias,
    contract,
    logical_param,
    positions_from_mask,
    residual_constraint,
    rope_inv_freq,
    target_logprobs,
)
from jaxrlhf.sharding import constrain


class Transformer(nn.Module):
    """Decoder-only transformer for every supported family.

    Args of `__call__`: input_ids [B, T] int, attention_mask [B, T] (1 = real token, 0 = padding),
    optional positions [B, T] (default: counted over real tokens, so left padding is invisible).
    With `targets` [B, T−1] (the next tokens, input_ids[:, 1:]) an LM returns their log-probs
    [B, T−1] at `temperature` instead of the logits, in chunks of `config.logprob_chunk`
    positions (`layers.target_logprobs`: the full logits never exist at once).

    Parameters are stored in `param_dtype` and computed with in `dtype` (mixed precision: e.g.
    float32 master weights, bfloat16 compute).
    """

    config: ModelConfig
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False

    @nn.compact
    def __call__(self, input_ids, attention_mask, positions=None, targets=None, temperature=1.0):
        cfg = self.config
        if positions is None:
            positions = positions_from_mask(attention_mask)
        embedding = logical_param(
            self,
            "embedding",
            (cfg.vocab_size, cfg.hidden_size),
            ("vocab", "embed"),
            self.param_dtype,
        )
        x = residual_constraint(jnp.take(embedding, input_ids, axis=0).astype(self.dtype))
        bias = attention_bias(attention_mask, self.dtype)
        block = block_class(cfg)
        if self.remat:
            block = nn.remat(block, prevent_cse=False)
        stack = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )
        x, _ = stack(cfg, self.dtype, self.param_dtype, name="layers")(
            x, bias, positions, rope_inv_freq(cfg)
        )
        norm_cls = LayerNorm if cfg.is_neox else RMSNorm
        x = norm_cls(cfg.norm_eps, self.dtype, self.param_dtype, name="final_norm")(x)
        if cfg.head == "score":
            kernel = logical_param(
                self, "score", (cfg.hidden_size, 1), ("embed", None), self.param_dtype
            )
            return jnp.einsum("bte,eo->bto", x, kernel.astype(self.dtype))[..., 0].astype(
                jnp.float32
            )
        if cfg.tie_word_embeddings:
            kernel = embedding.T
        else:
            kernel = logical_param(
                self,
                "lm_head",
                (cfg.hidden_size, cfg.vocab_size),
                ("embed", "vocab"),
                self.param_dtype,
            )
        if targets is not None:
            return target_logprobs(
                x[:, :-1], kernel, targets, temperature, self.dtype, cfg.contraction_block,
                cfg.logprob_chunk,
            )  # fmt: skip
        logits = contract(x, kernel, 1, self.dtype, cfg.contraction_block)
        return constrain(logits, ("batch", "length", "act_vocab"))


def abstract_params(model: Transformer) -> Any:
    """Shapes/dtypes of the parameters with their logical-axis metadata, without allocating."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids, ids))["params"]


def init_params(model: Transformer, rng: jax.Array) -> Any:
    """Randomly initialised (unboxed) parameters — for tests and models trained from scratch."""
    ids = jnp.zeros((1, 1), jnp.int32)
    return nn.meta.unbox(model.init(rng, ids, ids)["params"])
