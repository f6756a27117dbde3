"""A policy whose log-probs are a table, and a small hand-made rollout, for the loss tests.

`tests/losses/test_objectives.py` (exact values and gradients) and `tests/losses/test_registry.py`
(every entry runs) feed the registry's losses through `TableModel` instead of a Transformer:
log π_θ(y_t) = θ[y_t] and V(s_t) = w[x_t], so a loss and its gradient have closed forms that
a test can write out in numpy.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxrlhf.losses import LossInputs

PAD = 0
# Two prompts, left-padded to 3 tokens.
PROMPTS = np.array([[PAD, 7, 8], [9, 7, 8]])
# Each prompt's four responses, right-padded to 3 tokens; a rollout of k samples uses the first
# k. Lengths 1 to 3, token ids shared across rows so that gradients accumulate per id.
RESPONSES = np.array([
    [[1, 2, 3], [4, 5, PAD], [2, 6, PAD], [3, PAD, PAD]],
    [[5, 1, PAD], [6, 6, 6], [4, PAD, PAD], [1, 3, 2]],
])  # fmt: skip
# log π_θ(token) and V(token) per token id (index 0: the pad id).
THETA = np.array([-0.5, -1.0, -1.3, -0.7, -2.0, -0.4, -1.6, -0.9, -1.1, -0.8], np.float32)
VALUE_TABLE = np.array([0.3, -0.2, 0.5, 0.1, -0.4, 0.6, 0.0, 0.2, -0.1, 0.4], np.float32)
VOCAB = len(THETA)

# Per (prompt, sample, token) offsets, fixed once: π_old = π_θ + OLD; π_sampler = π_old − GAP
# (so π_old/π_sampler = exp(GAP) reaches past 2: truncated IS caps bind); π_ref = π_θ + REF;
# V_old = V + VALUE. Rounded to two decimals, like values chosen by hand. Seed 3 is one where
# every regime the tests assert on occurs (clipped and unclipped terms, caps that bind on some
# rows only); keep clip widths off the two-decimal grid, or a value can sit on a clip edge.
_rng = np.random.default_rng(3)
_SHAPE = (*RESPONSES.shape[:2], PROMPTS.shape[1] + RESPONSES.shape[2] - 1)
OLD, GAP, REF, VALUE = (
    np.round(_rng.uniform(low, high, _SHAPE), 2).astype(np.float32)
    for low, high in ((-0.4, 0.4), (-0.4, 0.8), (-0.5, 0.5), (-0.4, 0.4))
)


@dataclasses.dataclass(frozen=True)
class TableModel:
    """`PolicyFunctions` of the tables in params: {"policy": {"theta"}, "value": {"w"}}."""

    def logprobs(self, params, batch, prefix=""):
        """θ[y_t] for each target token of batch[prefix + "input_ids"]."""
        return params["policy"]["theta"][batch[prefix + "input_ids"][:, 1:]]

    def values(self, params, batch):
        """w[x_t]: the value of the state ending in token t."""
        return params["value"]["w"][batch["input_ids"][:, :-1]]


def table_params() -> dict:
    """The model's params: THETA and VALUE_TABLE as jax arrays."""
    return {"policy": {"theta": jnp.asarray(THETA)}, "value": {"w": jnp.asarray(VALUE_TABLE)}}


def make_inputs(scores, k: int, with_ref: bool = True) -> LossInputs:
    """The rollout of the first k responses to each prompt, rows prompt-major, with these
    scores; reference log-probs only `with_ref`."""
    responses = RESPONSES[:, :k].reshape(-1, RESPONSES.shape[2])
    ids = np.concatenate([np.repeat(PROMPTS, k, axis=0), responses], axis=1)
    loss_mask = np.zeros(ids[:, 1:].shape, np.float32)
    loss_mask[:, PROMPTS.shape[1] - 1 :] = responses != PAD

    def offsets(table):
        return table[:, :k].reshape(loss_mask.shape)

    old = (THETA[ids[:, 1:]] + offsets(OLD)) * loss_mask
    return LossInputs(
        input_ids=ids,
        attention_mask=(ids != PAD).astype(np.int32),
        loss_mask=loss_mask,
        scores=np.asarray(scores, np.float32),
        samples_per_prompt=k,
        sampler_logprobs=old - offsets(GAP) * loss_mask,
        old_logprobs=old,
        ref_logprobs=(THETA[ids[:, 1:]] + offsets(REF)) * loss_mask if with_ref else None,
        old_values=VALUE_TABLE[ids[:, :-1]] + offsets(VALUE),
    )
