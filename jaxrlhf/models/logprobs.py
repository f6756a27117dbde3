"""Log-probabilities of given tokens under the model: the quantity every loss is built on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.models.layers import logprobs_from_logits
from jaxrlhf.models.transformer import Transformer

__all__ = ["logprobs_from_logits", "next_token_logprobs", "token_logprobs"]


def next_token_logprobs(
    model: Transformer,
    params: dict,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """[B, T−1] log π(input_ids[:, t+1] | input_ids[:, :t+1]) at `temperature`, unmasked.

    Jit-able; computed in chunks of `model.config.logprob_chunk` positions (no [B, T, V]
    logits at once).
    """
    return model.apply(
        {"params": params}, input_ids, attention_mask, targets=input_ids[:, 1:],
        temperature=temperature,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("temperature",))
def token_logprobs(
    model: Transformer,
    params: dict,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    temperature: float = 1.0,
) -> jax.Array:
    """log π(input_ids[:, t+1] | input_ids[:, :t+1]) for t < T−1, shape [B, T−1].

    Logits are divided by `temperature` first (the sampler's distribution). Entries whose target
    token is padding are 0. Positions count real tokens only, so padding never changes the value
    for real tokens.
    """
    logprobs = next_token_logprobs(model, params, input_ids, attention_mask, temperature)
    return jnp.where(attention_mask[:, 1:].astype(bool), logprobs, 0.0)
