"""Log-probabilities of given tokens under the model: the quantity every loss is built on."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrlhf.models.transformer import Transformer


def logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """log softmax(logits / T)[target] = logit_t/T − logsumexp(logits/T), in float32.

    logits [..., V], targets [...] int. Computed without materialising the full log-softmax.
    """
    scaled = logits.astype(jnp.float32) / temperature
    target_logits = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return target_logits - jax.nn.logsumexp(scaled, axis=-1)


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
    logits = model.apply({"params": params}, input_ids, attention_mask)
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
    return jnp.where(attention_mask[:, 1:].astype(bool), logprobs, 0.0)
