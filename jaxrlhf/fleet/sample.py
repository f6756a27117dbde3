"""One completion as a generator replica returned it: its tokens, their log-probs under the
weights that sampled them, and the policy version of each token."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_index: int
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int  # of the first token
    # Of each token (non-decreasing); () from a generator that does not report them: then every
    # token is `policy_version`'s.
    token_policy_versions: tuple[int, ...] = ()
    # When the generator took the request and when it ended (Unix seconds, its clock; 0 from
    # a generator that does not say).
    submitted_unix_time: float = 0.0
    finished_unix_time: float = 0.0

    @property
    def token_versions(self) -> tuple[int, ...]:
        return self.token_policy_versions or (self.policy_version,) * len(self.token_ids)

    @property
    def oldest_version(self) -> int:
        return min(self.token_policy_versions, default=self.policy_version)
