"""Tasks for the RLHF loop: prompts (train and held-out) and a reward on decoded responses."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxrlhf.data.arithmetic import make_problems
from jaxrlhf.rl.rewards import arithmetic_reward
from jaxrlhf.rl.rollout import PromptItem
from jaxrlhf.tokenization import chat_prompt_ids


@dataclasses.dataclass
class Task:
    name: str
    train_prompts: list[PromptItem]
    eval_prompts: list[PromptItem]
    pad_id: int
    score_text: Callable[[PromptItem, str], float]
    decode: Callable[[Sequence[int]], str]

    def score(self, prompt: PromptItem, response_ids: Sequence[int]) -> float:
        return self.score_text(prompt, self.decode(response_ids))


def arithmetic_task(tokenizer, num_train: int, num_eval: int, seed: int, max_prompt_tokens: int):
    """Two-digit additions in the chat template; reward 1 when the last number is the sum."""

    def items(split: str, count: int) -> list[PromptItem]:
        out = []
        for problem in make_problems(count, split, seed):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": problem.question}])
            if len(ids) > max_prompt_tokens:
                raise ValueError(
                    f"prompt of {len(ids)} tokens exceeds rollout.max_prompt_tokens="
                    f"{max_prompt_tokens}"
                )
            out.append(PromptItem(problem.id, tuple(ids), problem.answer))
        return out

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Task(
        name="arithmetic",
        train_prompts=items("train", num_train),
        eval_prompts=items("eval", num_eval),
        pad_id=pad,
        score_text=lambda prompt, text: arithmetic_reward(text, prompt.answer),
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
    )
