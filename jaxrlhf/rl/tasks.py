"""Tasks for the RLHF loop: tokenized prompts (train and held-out) and, where the task has one, a
verifiable reward on decoded responses. Tasks without one are scored by a reward model
(`config.task.reward_model`, see `jaxrlhf.stages.reward.RewardScorer`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jaxrlhf.data import task_registry
from jaxrlhf.data.types import PromptExample, prompt_ids
from jaxrlhf.rl.rollout import PromptItem


@dataclasses.dataclass
class Task:
    name: str
    train_prompts: list[PromptItem]
    eval_prompts: list[PromptItem]  # the validation split
    pad_id: int
    decode: Callable[[Sequence[int]], str]
    # (answer, response text) -> reward; None = the task needs a reward model.
    verify: Callable[[str, str], float] | None = None
    eval_references: list[str] = dataclasses.field(default_factory=list)
    test_prompts: list[PromptItem] = dataclasses.field(default_factory=list)

    @property
    def verifiable(self) -> bool:
        return self.verify is not None

    def score(self, prompt: PromptItem, response_ids: Sequence[int]) -> float:
        if self.verify is None:
            raise ValueError(f"task {self.name!r} has no verifiable reward; use a reward model")
        return self.verify(prompt.answer, self.decode(response_ids))


def tokenize_prompts(
    tokenizer, examples: Sequence[PromptExample], max_prompt_tokens: int, split: str
) -> list[PromptItem]:
    """PromptItems of the examples; a prompt longer than `max_prompt_tokens` is an error that
    names it (raise rollout.max_prompt_tokens, or shorten the data)."""
    items = []
    for example in examples:
        ids = prompt_ids(tokenizer, example)
        if len(ids) > max_prompt_tokens:
            raise ValueError(
                f"{split} prompt {example.id!r} has {len(ids)} tokens, more than "
                f"rollout.max_prompt_tokens={max_prompt_tokens}"
            )
        items.append(PromptItem(example.id, tuple(ids), example.answer))
    return items


def build_task(config, tokenizer, test: bool = True) -> Task:
    """The configured task (`config.task`), tokenized for the policy; `test`: with the test
    split's prompts as well."""
    task_cfg, limit = config.task, config.rollout.max_prompt_tokens
    train = task_registry.prompt_examples(task_cfg, "train", config.seed)
    validation = task_registry.prompt_examples(task_cfg, "validation", config.seed)
    test_examples = task_registry.prompt_examples(task_cfg, "test", config.seed) if test else []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Task(
        name=task_cfg.name,
        train_prompts=tokenize_prompts(tokenizer, train, limit, "train"),
        eval_prompts=tokenize_prompts(tokenizer, validation, limit, "validation"),
        pad_id=pad,
        decode=lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        verify=task_registry.verifier(task_cfg),
        eval_references=[e.reference for e in validation],
        test_prompts=tokenize_prompts(tokenizer, test_examples, limit, "test"),
    )
