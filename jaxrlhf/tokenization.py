"""Tokenization helpers: chat templates, left-padded prompt batches, response masks after EOS.

RLHF batches put the prompt left-padded and the response right-padded, so every prompt ends at
the same column and every response starts there:

    [pad pad p1 p2 p3 | r1 r2 EOS pad]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def chat_prompt_ids(tokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ending with the assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; use plain text prompts instead")
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
    """(ids [B, L], mask [B, L]) with each sequence right-aligned; raises if one is too long."""
    longest = max(len(s) for s in sequences)
    length = longest if length is None else length
    if longest > length:
        raise ValueError(f"a prompt has {longest} tokens, more than the {length} allowed")
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, length - len(seq) :] = seq
            mask[row, length - len(seq) :] = 1
    return ids, mask


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None):
    """(ids [B, L], mask [B, L]) with each sequence left-aligned and truncated to `length`."""
    length = max(len(s) for s in sequences) if length is None else length
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for row, seq in enumerate(sequences):
        seq = list(seq)[:length]
        ids[row, : len(seq)] = seq
        mask[row, : len(seq)] = 1
    return ids, mask


def response_mask_after_eos(responses: np.ndarray, eos_ids: Sequence[int]) -> np.ndarray:
    """1 for every response token up to and including the first EOS, 0 after it.

    responses [B, T]. A row without EOS is all ones (the missing-EOS penalty handles it).
    """
    is_eos = np.isin(responses, np.asarray(list(eos_ids)))
    after = np.cumsum(is_eos, axis=1) - is_eos  # number of EOS strictly before each position
    return (after == 0).astype(np.int32)


def has_eos(responses: np.ndarray, eos_ids: Sequence[int]) -> np.ndarray:
    """[B] bool: does the response contain an EOS token."""
    return np.isin(responses, np.asarray(list(eos_ids))).any(axis=1)


def concat_prompt_response(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    response_ids: np.ndarray,
    response_mask: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, loss_mask) of [left-padded prompt | right-padded response].

    loss_mask marks the response tokens as targets, aligned with `token_logprobs` output
    ([B, T-1], entry t scores token t+1).
    """
    input_ids = np.concatenate([prompt_ids, response_ids], axis=1)
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1)
    loss_mask = np.concatenate([np.zeros_like(prompt_mask), response_mask], axis=1)[:, 1:]
    return input_ids, attention_mask, loss_mask


def eos_token_ids(tokenizer, extra: Sequence[int] = ()) -> list[int]:
    """The tokenizer's EOS id plus any extra stop ids (e.g. the generation config's list)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return sorted(set(ids) | set(extra))
