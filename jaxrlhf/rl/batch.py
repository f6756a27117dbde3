"""Rollouts to fixed-shape arrays: [left-padded prompt | right-padded response] per sample.

Every array has the same shape every step (prompt length and response length come from the
config), so the jitted learner functions compile once. Token-aligned arrays are [N, T−1] like
`token_logprobs`: entry t scores token t+1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxrlhf.rl.rollout import Rollout
from jaxrlhf.tokenization import concat_prompt_response, left_pad, right_pad


@dataclasses.dataclass
class RolloutArrays:
    input_ids: np.ndarray  # [N, T] int32
    attention_mask: np.ndarray  # [N, T]
    loss_mask: np.ndarray  # [N, T-1], 1 on response tokens (through EOS)
    sampler_logprobs: np.ndarray  # [N, T-1], the sampler's log-probs on response tokens, else 0
    finished: np.ndarray  # [N] bool: the response ended with a stop token (EOS)
    policy_versions: np.ndarray  # [N] int: version tag of each completion
    response_lengths: np.ndarray  # [N]

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The model inputs of the selected rows."""
        return {
            "input_ids": self.input_ids[index],
            "attention_mask": self.attention_mask[index],
            "loss_mask": self.loss_mask[index],
        }


def prompt_width(rollout: Rollout, max_prompt_tokens: int, multiple: int) -> int:
    """The prompt columns of a batch: its longest prompt rounded up to `multiple`, at most
    `max_prompt_tokens` (`multiple` 0: always `max_prompt_tokens`)."""
    if not multiple:
        return max_prompt_tokens
    longest = max(len(rollout.prompts[s.prompt_index].token_ids) for s in rollout.samples)
    return min(max_prompt_tokens, -(-longest // multiple) * multiple)


def rollout_arrays(
    rollout: Rollout, pad_id: int, prompt_len: int, response_len: int
) -> RolloutArrays:
    samples = rollout.samples
    prompts = [rollout.prompts[s.prompt_index].token_ids for s in samples]
    responses: Sequence[Sequence[int]] = [s.token_ids for s in samples]
    if max(len(r) for r in responses) > response_len:
        raise ValueError(f"a response is longer than the configured {response_len} tokens")
    p_ids, p_mask = left_pad(prompts, pad_id, prompt_len)
    r_ids, r_mask = right_pad(responses, pad_id, response_len)
    input_ids, attention_mask, loss_mask = concat_prompt_response(p_ids, p_mask, r_ids, r_mask)
    sampler = np.zeros(loss_mask.shape, np.float32)
    for row, sample in enumerate(samples):
        # Response token j sits at column prompt_len + j, scored by entry prompt_len + j − 1.
        sampler[row, prompt_len - 1 : prompt_len - 1 + len(sample.logprobs)] = sample.logprobs
    return RolloutArrays(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask.astype(np.float32),
        sampler_logprobs=sampler,
        finished=np.array([s.finish_reason == "stop" for s in samples]),
        policy_versions=np.array([s.policy_version for s in samples], np.int64),
        response_lengths=np.array([len(s.token_ids) for s in samples], np.int64),
    )
