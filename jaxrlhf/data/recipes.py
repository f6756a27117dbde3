"""The data side of each task, selected by `config.task`, in the shapes the stages train on.

    arithmetic  generated two-digit additions (offline), verifiable reward
    tldr        TL;DR summarisation: SFT set + OpenAI's preference set (reward model)
    nobots      No Robots chat: SFT set + your own preference pairs (see jaxrlhf.data.nobots)
    gsm8k       GSM8k: SFT on worked solutions, verifiable reward (the `#### n` answer)

`config.task.source` / `preference_source` override the hub names with a local path (jsonl,
parquet, a folder of split files or a `save_to_disk` folder); "" keeps the task's default.
Token ids: a chat prompt goes through the tokenizer's chat template, a plain prompt is encoded
as is; a response is its text's tokens plus the tokenizer's EOS.

Splits (`jaxrlhf.data.splits`): "train", "validation" (evaluations during a run, choosing
hyper-parameters) and "test" (the reported figure). A dataset's own split is used where it has
one (`DATASET_SPLITS`); a dataset without a validation split (GSM8k, No Robots) gets one carved
out of its train split by a hash of each example's id (`config.task.validation_fraction`), and
the train split then leaves those examples out.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxrlhf.data import gsm8k, nobots, tldr
from jaxrlhf.data.arithmetic import make_problems, score_answer
from jaxrlhf.data.splits import SPLITS, carve
from jaxrlhf.data.types import PreferencePair, PromptExample, SFTExample
from jaxrlhf.tokenization import chat_prompt_ids

TASKS = ("arithmetic", "tldr", "nobots", "gsm8k")
VERIFIABLE = ("arithmetic", "gsm8k")
# Each dataset's own split for each of ours; None = carved out of "train" (module docstring).
DATASET_SPLITS = {
    "arithmetic": {"train": "train", "validation": "validation", "test": "test"},
    "tldr": {"train": "train", "validation": "validation", "test": "test"},
    "nobots": {"train": "train", "validation": None, "test": "test"},
    "gsm8k": {"train": "train", "validation": None, "test": "test"},
}
# The config key that renames each of our splits, and the one that limits its size.
_SPLIT_KEYS = {"train": "train_split", "validation": "eval_split", "test": "test_split"}
_COUNT_KEYS = {"train": "num_train", "validation": "num_eval", "test": "num_test"}


def _limit(count: int) -> int | None:
    return count if count > 0 else None


def _source(task, default: str | None, key: str = "source") -> str:
    source = task.get(key, "") or default
    if not source:
        raise ValueError(f"config.task.{key} is required for task {task.name!r} (no hub default)")
    return source


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def split_name(task, split: str) -> str | None:
    """Our split ("train", "validation", "test") -> the dataset's split name; None = the
    validation split is carved out of the dataset's train split."""
    _check_split(split)
    return task.get(_SPLIT_KEYS[split], "") or DATASET_SPLITS[task.name][split]


def _count(task, split: str) -> int | None:
    return _limit(task.get(_COUNT_KEYS[split], 0))


def _carved(task, split: str) -> bool:
    """Whether `split` is (validation) or excludes (train) the part carved out of train."""
    return split in ("train", "validation") and split_name(task, "validation") is None


def _from_dataset(task, split: str, load, key):
    """`load(dataset_split, limit)` for our `split`, carving the validation part when the
    dataset has none (`key(example)` is the example's id)."""
    count = _count(task, split)
    if not _carved(task, split):
        return load(split_name(task, split), count)
    fraction = task.get("validation_fraction", 0.05)
    examples = carve(load(split_name(task, "train"), None), key, fraction,
                     held_out=split == "validation")  # fmt: skip
    if not examples:
        raise ValueError(
            f"task {task.name!r}: the {split} split carved out of the dataset's train split "
            f"(config.task.validation_fraction={fraction}) is empty; raise the fraction or "
            f"name a dataset split with config.task.eval_split"
        )
    return examples[:count] if count else examples


# The dataset modules, each with prompt_examples / sft_examples(source, split, limit).
_DATASETS = {"tldr": tldr, "nobots": nobots, "gsm8k": gsm8k}
# What `config.task.source` / `preference_source` = "" stand for (None: no hub default).
DATASET_DEFAULTS = {
    "tldr": {"source": tldr.DEFAULT_SOURCE, "preference_source": tldr.DEFAULT_PREFERENCE_SOURCE},
    "nobots": {"source": nobots.DEFAULT_SOURCE, "preference_source": None},
    "gsm8k": {"source": gsm8k.DEFAULT_SOURCE, "preference_source": None},
}


def _dataset_module(task):
    if task.name not in _DATASETS:
        raise ValueError(f"unknown task {task.name!r}; one of {TASKS}")
    return _DATASETS[task.name]


def prompt_examples(task, split: str, seed: int = 0) -> list[PromptExample]:
    """The prompts of `split` ("train", "validation" or "test") with their references."""
    _check_split(split)
    if task.name == "arithmetic":
        return [
            PromptExample(
                p.id, [{"role": "user", "content": p.question}], None, str(p.answer), str(p.answer)
            )  # fmt: skip
            for p in make_problems(_count(task, split) or 0, split_name(task, split), seed)
        ]
    module = _dataset_module(task)
    source = _source(task, module.DEFAULT_SOURCE)
    return _from_dataset(
        task, split, lambda name, limit: module.prompt_examples(source, name, limit),
        key=lambda example: example.id,
    )  # fmt: skip


def sft_examples(task, split: str, seed: int = 0) -> list[SFTExample]:
    if task.name == "arithmetic":
        return [SFTExample(p, p.reference) for p in prompt_examples(task, split, seed)]
    module = _dataset_module(task)
    source = _source(task, module.DEFAULT_SOURCE)
    return _from_dataset(
        task, split, lambda name, limit: module.sft_examples(source, name, limit),
        key=lambda example: example.prompt.id,
    )  # fmt: skip


def preference_pairs(task, split: str) -> list[PreferencePair]:
    """Preference pairs of `split`, for the reward-model stage (TL;DR, No Robots)."""
    modules = {
        "tldr": (tldr, tldr.DEFAULT_PREFERENCE_SOURCE),
        "nobots": (nobots, nobots.DEFAULT_PREFERENCE_SOURCE),
    }
    if task.name not in modules:
        raise ValueError(
            f"task {task.name!r} has no preference data: the reward-model stage needs task.name "
            f"'tldr' or 'nobots'"
        )
    module, default = modules[task.name]
    source = _source(task, default, "preference_source")
    return _from_dataset(
        task, split, lambda name, limit: module.preference_pairs(source, name, limit),
        key=lambda pair: pair.prompt.id,
    )  # fmt: skip


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
