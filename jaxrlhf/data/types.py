"""The examples every task's loader returns, so a trainer never needs a dataset's own schema,
and their token ids (`prompt_ids`, `response_ids`).

A prompt is either a chat conversation (`messages`, rendered later with the model's chat
template) or plain text (`text`, fed to a base model as is), never both. Responses are the text a
model should produce after the prompt, without any end-of-sequence token: the trainer appends its
own tokenizer's EOS. Token ids: a chat prompt goes through the tokenizer's chat template, a plain
prompt is encoded as is; a response is its text's tokens plus the tokenizer's EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxrlhf.tokenization import chat_prompt_ids

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt with its reference response.

    id: stable identifier from the dataset (several rows may share one when they share a prompt).
    messages: the conversation so far (chat prompt), or None.
    text: the prompt as plain text, or None. Exactly one of `messages` / `text` is set.
    reference: the dataset's reference response (what the policy is compared against).
    answer: the gold final answer for tasks that have one (GSM8k), else None.
    """

    id: str
    messages: list[Message] | None
    text: str | None
    reference: str
    answer: str | None = None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise ValueError(
                f"prompt {self.id!r}: set exactly one of messages (chat) or text (plain prompt)"
            )
        if self.messages is not None and not self.messages:
            raise ValueError(f"prompt {self.id!r}: messages is empty")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """A prompt and the response supervised fine-tuning trains on."""

    prompt: PromptExample
    response: str


@dataclasses.dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred (`chosen`) and a dispreferred (`rejected`) response."""

    prompt: PromptExample
    chosen: str
    rejected: str


def sft_from_references(prompts: Iterable[PromptExample]) -> list[SFTExample]:
    """The SFT examples of a dataset whose prompts carry reference responses (TL;DR, No
    Robots): each prompt with its reference as the response to learn."""
    return [SFTExample(prompt, prompt.reference) for prompt in prompts]


def prompt_ids(tokenizer, prompt: PromptExample) -> list[int]:
    if prompt.is_chat:
        return chat_prompt_ids(tokenizer, prompt.messages)
    return list(tokenizer.encode(prompt.text))


def response_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
