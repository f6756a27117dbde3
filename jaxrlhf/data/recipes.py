"""The data side of each task, selected by `config.task`, in the shapes the stages train on.

    arithmetic  generated two-digit additions (offline), verifiable reward
    tldr        TL;DR summarisation: SFT set + OpenAI's preference set (reward model)
    nobots      No Robots chat: SFT set + your own preference pairs (see jaxrlhf.data.nobots)
    gsm8k       GSM8k: SFT on worked solutions, verifiable reward (the `#### n` answer)

`config.task.source` / `preference_source` override the hub names with a local path (jsonl,
parquet, a folder of split files or a `save_to_disk` folder); "" keeps the task's default.
Token ids: a chat prompt goes through the tokenizer's chat template, a plain prompt is encoded
as is; a response is its text's tokens plus the tokenizer's EOS.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrlhf.data import gsm8k, nobots, tldr
from jaxrlhf.data.arithmetic import make_problems, score_answer
from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample
from jaxrlhf.tokenization import chat_prompt_ids

TASKS = ("arithmetic", "tldr", "nobots", "gsm8k")
# The held-out split each dataset names.
EVAL_SPLITS = {"arithmetic": "eval", "tldr": "validation", "nobots": "test", "gsm8k": "test"}
VERIFIABLE = ("arithmetic", "gsm8k")


def _limit(count: int) -> int | None:
    return count if count > 0 else None


def _source(task, default: str | None, key: str = "source") -> str:
    source = task.get(key, "") or default
    if not source:
        raise ValueError(f"config.task.{key} is required for task {task.name!r} (no hub default)")
    return source


def split_name(task, split: str) -> str:
    """ "train" or "eval" (the task's held-out split) -> the dataset's split name."""
    if split == "eval":
        return task.get("eval_split", "") or EVAL_SPLITS[task.name]
    return task.get("train_split", "") or split


def _count(task, split: str) -> int | None:
    return _limit(task.num_eval if split == "eval" else task.num_train)


# The dataset modules, each with prompt_examples / sft_examples(source, split, limit).
_DATASETS = {"tldr": tldr, "nobots": nobots, "gsm8k": gsm8k}


def _dataset_module(task):
    if task.name not in _DATASETS:
        raise ValueError(f"unknown task {task.name!r}; one of {TASKS}")
    return _DATASETS[task.name]


def prompt_examples(task, split: str, seed: int = 0) -> list[PromptExample]:
    """The prompts of `split` ("train" or "eval") with their references (and answers)."""
    count = _count(task, split)
    if task.name == "arithmetic":
        return [
            PromptExample(
                p.id, [{"role": "user", "content": p.question}], None, str(p.answer), str(p.answer)
            )  # fmt: skip
            for p in make_problems(count or 0, "train" if split == "train" else "eval", seed)
        ]
    module = _dataset_module(task)
    return module.prompt_examples(
        _source(task, module.DEFAULT_SOURCE), split_name(task, split), count
    )


def sft_examples(task, split: str, seed: int = 0) -> list[SFTExample]:
    if task.name == "arithmetic":
        return [SFTExample(p, p.reference) for p in prompt_examples(task, split, seed)]
    module = _dataset_module(task)
    return module.sft_examples(
        _source(task, module.DEFAULT_SOURCE), split_name(task, split), _count(task, split)
    )


def preference_pairs(task, split: str) -> list[PreferencePair]:
    name, count = task.name, _count(task, split)
    dataset_split = split_name(task, split)
    if name == "tldr":
        source = _source(task, tldr.DEFAULT_PREFERENCE_SOURCE, "preference_source")
        return tldr.preference_pairs(source, dataset_split, count)
    if name == "nobots":
        source = _source(task, nobots.DEFAULT_PREFERENCE_SOURCE, "preference_source")
        return nobots.preference_pairs(source, dataset_split, count)
    raise ValueError(
        f"task {name!r} has no preference data: the reward-model stage needs task.name "
        f"'tldr' or 'nobots'"
    )


def verifier(task) -> Callable[[PromptExample | str, str], float] | None:
    """(answer, response text) -> 1.0 / 0.0 for tasks with a checkable answer, else None."""
    if task.name == "arithmetic":
        return lambda answer, text: score_answer(text, int(answer))
    if task.name == "gsm8k":
        return lambda answer, text: float(gsm8k.is_correct(text, answer))
    return None


def prompt_ids(tokenizer, prompt: PromptExample) -> list[int]:
    if prompt.is_chat:
        return chat_prompt_ids(tokenizer, prompt.messages)
    return list(tokenizer.encode(prompt.text))


def response_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) + [tokenizer.eos_token_id]
