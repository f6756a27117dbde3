"""Building blocks shared by the architectures: norms, rotary embeddings, attention, projections.

Every parameter carries logical axis names (see `jaxrlhf.sharding.LOGICAL_RULES`); activations
are constrained with `constrain` so that a mesh, when one is active, shards them as the rules say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrlhf.models.config import ModelConfig
from jaxrlhf.sharding import constrain

Dtype = Any
_init = nn.initializers.normal(stddev=0.02)


def logical_param(
    module: nn.Module,
    name: str,
    shape: Sequence[int],
    axes: tuple[str | None, ...],
    dtype: Dtype,
    init=_init,
) -> jax.Array:
    """Declares a parameter annotated with its logical axes."""
    return module.param(name, nn.with_logical_partitioning(init, axes), tuple(shape), dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · scale, computed in float32 (as transformers does)."""

    eps: float
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = logical_param(
            self, "scale", (x.shape[-1],), ("norm",), self.param_dtype, nn.initializers.ones
        )
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * x32.astype(self.dtype)


class LayerNorm(nn.Module):
    """Standard LayerNorm with scale and bias, statistics in float32."""

    eps: float
    dtype: Dtype
    param_dtype: Dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dim = x.shape[-1]
        scale = logical_param(
            self, "scale", (dim,), ("norm",), self.param_dtype, nn.initializers.ones
        )
        bias = logical_param(
            self, "bias", (dim,), ("norm",), self.param_dtype, nn.initializers.zeros
        )
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * scale.astype(y.dtype) + bias.astype(y.dtype)).astype(self.dtype)


def logprobs_from_logits(
    logits: jax.Array, targets: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """log softmax(logits / T)[target] = logit_t/T − logsumexp(logits/T), in float32.

    logits [..., V], targets [...] int. Computed without materialising the full log-softmax.
    """
    scaled = logits.astype(jnp.float32) / temperature
    target_logits = jnp.take_along_axis(scaled, targets[..., None], axis=-1)[..., 0]
    return target_logits - jax.nn.logsumexp(scaled, axis=-1)


def target_logprobs(
    x: jax.Array,
    kernel: jax.Array,
    targets: jax.Array,
    temperature: float,
    dtype: Dtype,
    contraction_block: int = 0,
    chunk: int = 0,
) -> jax.Array:
    """log π(targets) [B, T] from final hidden states x [B, T, E] and the LM head [E, V].

    With `chunk` > 0 the positions are taken `chunk` at a time in a scan whose body is
    rematerialised: the logits of one chunk ([B, chunk, V], float32) are the largest
    temporary, in the forward and in the backward pass, instead of all [B, T, V] of them. The
    values equal the unchunked ones (the same per-position computation).
    """

    def piece(x_part, target_part):
        logits = contract(x_part, kernel, 1, dtype, contraction_block)
        logits = constrain(logits, ("batch", "length", "act_vocab"))
        return logprobs_from_logits(logits, target_part, temperature)

    batch, length = targets.shape
    if not chunk or chunk >= length:
        return piece(x, targets)
    count = -(-length // chunk)
    pad = count * chunk - length
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    xs = x.reshape(batch, count, chunk, x.shape[-1]).swapaxes(0, 1)
    ts = targets.reshape(batch, count, chunk).swapaxes(0, 1)
    body = jax.checkpoint(lambda carry, part: (carry, piece(*part)))
    _, out = jax.lax.scan(body, None, (xs, ts))
    return out.swapaxes(0, 1).reshape(batch, count * chunk)[:, :length]


def contract(x: jax.Array, kernel: jax.Array, n_in: int, dtype: Dtype, block: int = 0):
    """x · kernel over x's last `n_in` dims and kernel's first `n_in` dims, in `dtype`.

    With `block` > 0 the contraction is split along its first dim into pieces of at most `block`
    terms (when that dim allows) whose products are summed. XLA:CPU sums a float32 contraction
    in one long run, so its rounding error grows with the length (K=1536: 1.7e-6 relative, vs
    3.9e-7 for torch's blocked sgemm); blocks of 256 bring it to torch's accuracy at ~1.7x the
    train-step time on CPU (bench/parity_fp64.py, bench/learner_step.py). GPUs and TPUs
    accumulate in blocks already: leave it 0 there.
    """
    x, kernel = x.astype(dtype), kernel.astype(dtype)
    lead = x.ndim - n_in
    first = x.shape[lead]
    blocks = 1
    if block and math.prod(x.shape[lead:]) > block:
        total = math.prod(x.shape[lead:])
        blocks = next(
            (n for n in range(1, first + 1) if first % n == 0 and total // n <= block), first
        )
    if blocks == 1:
        dims = (tuple(range(lead, x.ndim)), tuple(range(n_in)))
        return jax.lax.dot_general(x, kernel, (dims, ((), ())))
    xb = x.reshape(*x.shape[:lead], blocks, first // blocks, *x.shape[lead + 1 :])
    kb = kernel.reshape(blocks, first // blocks, *kernel.shape[1:])
    # Batched over the block index: partial products [blocks, ..., out], then their sum.
    dims = (tuple(range(lead + 1, xb.ndim)), tuple(range(1, n_in + 1)))
    return jnp.sum(jax.lax.dot_general(xb, kb, (dims, ((lead,), (0,)))), axis=0)


def lora_a_init(key, shape, dtype=jnp.float32):
    """PEFT's LoRA A: Kaiming-uniform with a = √5, i.e. U(±1/√fan_in), fan_in = the input dims."""
    bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class Projection(nn.Module):
    """y = x · W (+ b) contracting the last `len(in_axes)` dims of x; W has in + out dims.

    With `lora_rank` r > 0 it also holds a LoRA adapter, A [*in, r] (`lora_a`, `lora_a_init`) and
    B [r, *out] (`lora_b`, zeros, so a new adapter leaves y unchanged), and adds
    `lora_scale` · (x · A) · B. The kernel keeps its name and layout."""

    out_shape: tuple[int, ...]
    in_axes: tuple[str | None, ...]
    out_axes: tuple[str | None, ...]
    use_bias: bool
    dtype: Dtype
    param_dtype: Dtype
    contraction_block: int = 0  # see `contract`
    lora_rank: int = 0
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_axes)
        in_shape = x.shape[x.ndim - n_in :]
        kernel = logical_param(
            self,
            "kernel",
            (*in_shape, *self.out_shape),
            (*self.in_axes, *self.out_axes),
            self.param_dtype,
        )
        y = contract(x, kernel, n_in, self.dtype, self.contraction_block)
        if self.use_bias:
            bias = logical_param(
                self, "bias", self.out_shape, self.out_axes, self.param_dtype, nn.initializers.zeros
            )
            y = y + bias.astype(self.dtype)
        if self.lora_rank:
            rank, pdt = self.lora_rank, self.param_dtype
            a_axes, b_axes = (*self.in_axes, "lora_rank"), ("lora_rank", *self.out_axes)
            a = logical_param(self, "lora_a", (*in_shape, rank), a_axes, pdt, lora_a_init)
            b = logical_param(self, "lora_b", (rank, *self.out_shape), b_axes, pdt,
                              nn.initializers.zeros)  # fmt: skip
            low = contract(x, a, n_in, self.dtype, self.contraction_block)
            y = y + self.lora_scale * contract(low, b, 1, self.dtype)
        return y


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """Inverse frequencies 1/θ^(2i/d) for the rotary dims, with Llama 3 scaling when configured.

    Llama 3 ("llama3") keeps high frequencies, divides low ones by `factor` and interpolates
    smoothly between `high_freq_factor` and `low_freq_factor` wavelengths.
    """
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = scaling.factor
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates the first 2·len(inv_freq) features of each head (rotate-half convention).

    x: [B, T, H, D]; positions: [B, T]. Features past the rotary dims pass unchanged (GPT-NeoX).
    """
    rot_dim = 2 * inv_freq.shape[0]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, rot/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    # Tables in float32 as transformers computes them, applied in (at least) float32.
    acc = jnp.promote_types(x.dtype, jnp.float32)
    cos, sin = jnp.cos(angles).astype(acc), jnp.sin(angles).astype(acc)
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = jnp.split(x_rot.astype(acc), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = (x_rot.astype(acc) * cos + rotated * sin).astype(x.dtype)
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


def attention_bias(attention_mask: jax.Array, dtype: Dtype) -> jax.Array:
    """Additive bias [B, 1, T, T]: 0 where query i may see key j (j ≤ i and j is a real token)."""
    length = attention_mask.shape[1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    allowed = causal[None, None] & attention_mask[:, None, None, :].astype(bool)
    return jnp.where(allowed, 0.0, jnp.finfo(dtype).min).astype(dtype)


def dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, dtype: Dtype
) -> jax.Array:
    """softmax(q·kᵀ/√d + bias)·v with grouped-query attention.

    q: [B, T, H, D]; k, v: [B, T, KV, D] with H a multiple of KV; bias [B, 1, T, T].
    Softmax in float32 (or wider). Returns [B, T, H, D].
    """
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    q = q.reshape(batch, length, kv_heads, groups, head_dim)
    acc = jnp.promote_types(dtype, jnp.float32)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=acc)
    scores = scores / math.sqrt(head_dim) + bias[:, :, None].astype(acc)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(batch, length, heads, head_dim)


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Position of each token counting real tokens only (left padding does not shift positions)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def residual_constraint(x: jax.Array) -> jax.Array:
    return constrain(x, ("batch", "length", "act_embed"))
