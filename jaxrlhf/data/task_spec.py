"""What a task is, in one spec: `TaskSpec`. Each task's module (`arithmetic`, `tldr`, `nobots`,
`gsm8k`) declares its `SPEC` next to its loader; `jaxrlhf.data.task_registry` finds them by
`config.task.name`.

A spec's loaders take `(source, split, limit, seed)`: the dataset (a hub name or a local path,
None for a task that reads none), the dataset's own split name, the most examples to return
(None = all) and the run's seed. The spec does the rest the same way for every task
(`examples`): the source from `config.task` or the spec's default, our split ("train",
"validation", "test") renamed by `config.task.train_split` / `eval_split` / `test_split` or the
spec's `splits`, the count from `num_train` / `num_eval` / `num_test`, and a validation split
carved out of the train split by a hash of each example's id where the dataset has none
(`jaxrlhf.data.splits`, `config.task.validation_fraction`); the train split then leaves those
examples out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from jaxrlhf.data.splits import SPLITS, carve
from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample

# The config keys that name a task's datasets: its prompts / SFT set, its preference pairs.
SOURCE_KEYS = ("source", "preference_source")
# The config key that renames each of our splits, and the one that limits its size.
_SPLIT_KEYS = {"train": "train_split", "validation": "eval_split", "test": "test_split"}
_COUNT_KEYS = {"train": "num_train", "validation": "num_eval", "test": "num_test"}

Loader = Callable[[str | None, str, int | None, int], list[Any]]


def unseeded(load: Callable[[str, str, int | None], list[Any]]) -> Loader:
    """A loader of `(source, split, limit)` (a dataset's rows do not depend on the seed) as a
    spec's loader."""
    return lambda source, split, limit, seed: load(source, split, limit)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task: where its data comes from, how it is split, and how a response is rewarded.

    name: the `config.task.name` that selects it.
    description: one line (what the data is, how it is rewarded).
    splits: our split ("train", "validation", "test") -> the dataset's split name; None = carved
        out of the train split (module docstring).
    prompts(source, split, limit, seed) -> [PromptExample]: the prompts in the task's prompt
        format, with their references (and gold answers where the task has them).
    sft(source, split, limit, seed) -> [SFTExample]: the prompts with the responses SFT trains on.
    sources: the datasets it reads, by config key ("source", "preference_source") -> what "" in
        that key stands for: a hub name, or None when the key must be set (no hub default; so
        is a key left out of a task that reads some). A task that generates its data here
        reads none ({}).
    preferences(source, split, limit, seed) -> [PreferencePair], for the reward-model stage;
        None = the task has no preference data.
    verify(answer, response text) -> 1.0 / 0.0: its verifiable reward; None = the task needs a
        reward model (`config.task.reward_model`).
    """

    name: str
    description: str
    splits: Mapping[str, str | None]
    prompts: Loader
    sft: Loader
    sources: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    preferences: Loader | None = None
    verify: Callable[[str, str], float] | None = None

    def __post_init__(self) -> None:
        if tuple(self.splits) != SPLITS:
            raise ValueError(f"TaskSpec {self.name!r}: splits must name {SPLITS} in that order")
        if self.splits["train"] is None or self.splits["test"] is None:
            raise ValueError(f"TaskSpec {self.name!r}: only the validation split may be carved")
        if not set(self.sources) <= set(SOURCE_KEYS):
            raise ValueError(f"TaskSpec {self.name!r}: sources are keys of {SOURCE_KEYS}")
        if self.preferences is None and "preference_source" in self.sources:
            raise ValueError(f"TaskSpec {self.name!r}: a preference_source but no preferences")
        object.__setattr__(self, "splits", MappingProxyType(dict(self.splits)))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))

    def source(self, task, key: str = "source") -> str | None:
        """The dataset `config.task.<key>` names, or the spec's default; None when the task
        reads none (generated data)."""
        if not self.sources:
            return None
        source = task.get(key, "") or self.sources.get(key)
        if not source:
            raise ValueError(
                f"config.task.{key} is required for task {self.name!r} (no hub default)"
            )
        return source

    def split_name(self, task, split: str) -> str | None:
        """Our split -> the dataset's split name; None = the validation split is carved out of
        the dataset's train split."""
        check_split(split)
        return task.get(_SPLIT_KEYS[split], "") or self.splits[split]

    def prompt_examples(self, task, split: str, seed: int = 0) -> list[PromptExample]:
        check_split(split)
        return self.examples(task, split, self.prompts, "source", seed, key=lambda e: e.id)

    def sft_examples(self, task, split: str, seed: int = 0) -> list[SFTExample]:
        return self.examples(task, split, self.sft, "source", seed, key=lambda e: e.prompt.id)

    def preference_pairs(self, task, split: str, seed: int = 0) -> list[PreferencePair]:
        if self.preferences is None:
            raise ValueError(f"task {self.name!r} has no preference data")
        return self.examples(task, split, self.preferences, "preference_source", seed,
                             key=lambda pair: pair.prompt.id)  # fmt: skip

    def examples(self, task, split: str, load: Loader, source_key: str, seed: int, key):
        """`load`'s examples of our `split`, carving the validation part when the dataset has
        none (`key(example)` is the example's id)."""
        source = self.source(task, source_key)
        count = task.get(_COUNT_KEYS[split], 0)
        count = count if count > 0 else None  # 0 = all
        if not self._carved(task, split):
            return load(source, self.split_name(task, split), count, seed)
        fraction = task.get("validation_fraction", 0.05)
        examples = carve(load(source, self.split_name(task, "train"), None, seed), key,
                         fraction, held_out=split == "validation")  # fmt: skip
        if not examples:
            raise ValueError(
                f"task {self.name!r}: the {split} split carved out of the dataset's train split "
                f"(config.task.validation_fraction={fraction}) is empty; raise the fraction or "
                f"name a dataset split with config.task.eval_split"
            )
        return examples[:count] if count else examples

    def _carved(self, task, split: str) -> bool:
        """Whether `split` is (validation) or excludes (train) the part carved out of train."""
        return split in ("train", "validation") and self.split_name(task, "validation") is None
