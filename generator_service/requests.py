"""What a Generate call may ask for: sampling settings and the checks on prompts.

Kept apart from the engine so that every rule is plain Python, checked before anything reaches
vLLM (which, for one, does not refuse prompt + max_tokens over the model length by itself).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import grpc


class GenerateError(Exception):
    """A Generate call refused or failed: `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one Generate call (proto defaults already resolved)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None  # set: reproducible call (see GenerateRequest.seed)
    seed_per_request: bool = False  # with `seed` (GenerateRequest.seed_per_request)
    # Per prompt (Prompt.max_tokens; 0 = max_tokens), or () when no prompt sets one.
    prompt_max_tokens: tuple[int, ...] = ()
    max_running: int = 0  # the call's samples in the engine at once (0 = all; GenerateRequest)

    def max_tokens_of(self, prompt_index: int) -> int:
        limits = self.prompt_max_tokens
        return (limits[prompt_index] if limits else 0) or self.max_tokens


# vLLM refuses higher temperatures when a request is built (SamplingParams._verify_args).
MAX_TEMPERATURE = 2.0
# Engine requests (prompts x n) one call may make: far above any learner's batch, and low enough
# that a call is submitted, or refused, at once (n is a uint32: 2**32 - 1 samples would keep
# the server submitting requests for hours).
MAX_SAMPLES_PER_CALL = 1 << 16


def _invalid(message: str) -> GenerateError:
    return GenerateError(grpc.StatusCode.INVALID_ARGUMENT, message)


def _check_sampling(sampling: Sampling, vocab_size: int) -> None:
    if sampling.n < 1:
        raise _invalid(f"sampling.n must be >= 1, got {sampling.n}")
    if sampling.max_tokens < 1:
        raise _invalid(f"sampling.max_tokens must be >= 1, got {sampling.max_tokens}")
    if not (math.isfinite(sampling.temperature) and sampling.temperature >= 0):
        raise _invalid(f"sampling.temperature must be >= 0, got {sampling.temperature}")
    if sampling.temperature > MAX_TEMPERATURE:
        raise _invalid(
            f"sampling.temperature must be <= {MAX_TEMPERATURE} (the engine's limit), got "
            f"{sampling.temperature}"
        )
    if not (0 < sampling.top_p <= 1):
        raise _invalid(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < -1:
        raise _invalid(f"sampling.top_k must be -1, 0 (off) or >= 1, got {sampling.top_k}")
    if sampling.min_tokens > sampling.max_tokens:
        raise _invalid(
            f"sampling.min_tokens {sampling.min_tokens} exceeds max_tokens {sampling.max_tokens}"
        )
    for token in sampling.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise _invalid(f"stop token id {token} is outside the vocabulary [0, {vocab_size})")
    if sampling.seed_per_request and sampling.seed is None:
        raise _invalid("seed_per_request is set but the request has no seed")


def validate_request(
    prompts: Sequence[tuple[str, Sequence[int]]],
    sampling: Sampling,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raises GenerateError(INVALID_ARGUMENT) naming the first problem (and the prompt)."""
    if not prompts:
        raise _invalid("the request has no prompts")
    _check_sampling(sampling, vocab_size)
    if len(prompts) * sampling.n > MAX_SAMPLES_PER_CALL:
        raise _invalid(
            f"{len(prompts)} prompts x n={sampling.n} is {len(prompts) * sampling.n} samples, "
            f"over the {MAX_SAMPLES_PER_CALL} one call may ask for; split the call"
        )
    if sampling.prompt_max_tokens and len(sampling.prompt_max_tokens) != len(prompts):
        raise _invalid(f"{len(sampling.prompt_max_tokens)} prompt max_tokens for "
                       f"{len(prompts)} prompts")  # fmt: skip
    for index, (prompt_id, token_ids) in enumerate(prompts):
        name = f"prompt {index} (id {prompt_id!r})"
        if not token_ids:
            raise _invalid(f"{name} is empty")
        max_tokens = sampling.max_tokens_of(index)
        if max_tokens < sampling.min_tokens:
            raise _invalid(f"{name} has max_tokens {max_tokens}, below min_tokens "
                           f"{sampling.min_tokens}")  # fmt: skip
        total = len(token_ids) + max_tokens
        if total > max_model_len:
            raise _invalid(
                f"{name} has {len(token_ids)} tokens; with max_tokens {max_tokens} "
                f"that is {total}, over the model length {max_model_len}"
            )
        if min(token_ids) < 0 or max(token_ids) >= vocab_size:
            bad = next(t for t in token_ids if not 0 <= t < vocab_size)
            raise _invalid(f"{name} has token id {bad}, outside the vocabulary [0, {vocab_size})")
