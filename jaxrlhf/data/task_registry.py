"""Tasks by name: `config.task.name` picks a task, and its `TaskSpec` says where its data comes
from, how it is split and how a response is rewarded, so adding a task is one module that
declares a `SPEC` (next to its loader) plus its entry here, and a `configs/<task>.py`.

    arithmetic  generated two-digit additions (offline), verifiable reward
    tldr        TL;DR summarisation: SFT set + OpenAI's preference set (reward model)
    nobots      No Robots chat: SFT set + your own preference pairs (see jaxrlhf.data.nobots)
    gsm8k       GSM8k: SFT on worked solutions, verifiable reward (the `#### n` answer)

The functions below are what the stages call, each with `config.task`: they look the spec up
and ask it (`jaxrlhf.data.task_spec` says how sources, splits and counts are read from the
config). `config.task.source` / `preference_source` override the hub names with a local path
(jsonl, parquet, a folder of split files or a `save_to_disk` folder); "" keeps the task's
default.

Splits (`jaxrlhf.data.splits`): "train", "validation" (evaluations during a run, choosing
hyper-parameters) and "test" (the reported figure). A dataset's own split is used where it has
one (`TaskSpec.splits`); a dataset without a validation split (GSM8k, No Robots) gets one
carved out of its train split by a hash of each example's id (`config.task.validation_fraction`),
and the train split then leaves those examples out.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrlhf.data import arithmetic, gsm8k, nobots, tldr
from jaxrlhf.data.task_spec import TaskSpec
from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample

TASKS: dict[str, TaskSpec] = {
    spec.name: spec for spec in (arithmetic.SPEC, tldr.SPEC, nobots.SPEC, gsm8k.SPEC)
}


def task(name: str) -> TaskSpec:
    """The registered TaskSpec called `name`; ValueError listing the known tasks otherwise."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def split_name(task_config, split: str) -> str | None:
    """Our split ("train", "validation", "test") -> the dataset's split name; None = the
    validation split is carved out of the dataset's train split."""
    return task(task_config.name).split_name(task_config, split)


def prompt_examples(task_config, split: str, seed: int = 0) -> list[PromptExample]:
    """The prompts of `split` ("train", "validation" or "test") with their references."""
    return task(task_config.name).prompt_examples(task_config, split, seed)


def sft_examples(task_config, split: str, seed: int = 0) -> list[SFTExample]:
    return task(task_config.name).sft_examples(task_config, split, seed)


def preference_pairs(task_config, split: str) -> list[PreferencePair]:
    """Preference pairs of `split`, for the reward-model stage (TL;DR, No Robots)."""
    spec = task(task_config.name)
    if spec.preferences is None:
        having = " or ".join(repr(name) for name, s in TASKS.items() if s.preferences is not None)
        raise ValueError(
            f"task {spec.name!r} has no preference data: the reward-model stage needs task.name "
            f"{having}"
        )
    return spec.preference_pairs(task_config, split)


def verifier(task_config) -> Callable[[str, str], float] | None:
    """(answer, response text) -> 1.0 / 0.0 for tasks with a checkable answer, else None."""
    return task(task_config.name).verify
