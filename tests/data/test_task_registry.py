"""Tasks are registered like losses: one `TaskSpec` per task (`jaxrlhf.data.task_registry`).

Every registered task has a complete spec that loads; a task registered from elsewhere (here a
throwaway one) works through the functions the stages call and the config checks without any
other table; an unknown name is one clear error that lists the known tasks.
"""

from __future__ import annotations

import importlib

import pytest

from jaxrlhf.config import base_config
from jaxrlhf.config.checks import ConfigError, validate
from jaxrlhf.data import task_registry
from jaxrlhf.data.splits import SPLITS
from jaxrlhf.data.task_spec import SOURCE_KEYS, TaskSpec
from jaxrlhf.data.types import PromptExample, SFTExample
from jaxrlhf.prerequisites import _dataset_needs

# Each task's sources in tests/fixtures/data (none: generated), and its splits found there.
FIXTURES = {
    "arithmetic": ({}, SPLITS),
    "gsm8k": ({"source": "gsm8k"}, SPLITS),
    "tldr": ({"source": "tldr_sft", "preference_source": "tldr_pref"}, ("train", "validation")),
    "nobots": ({"source": "no_robots", "preference_source": "toy_pref"}, SPLITS),
}


@pytest.mark.parametrize("name", list(task_registry.TASKS))
def test_every_registered_task_has_a_complete_spec(name):
    spec = task_registry.task(name)
    assert isinstance(spec, TaskSpec) and spec.name == name and spec.description
    assert importlib.import_module(f"jaxrlhf.data.{name}").SPEC is spec  # declared by its module
    assert tuple(spec.splits) == SPLITS
    assert callable(spec.prompts) and callable(spec.sft)
    assert set(spec.sources) <= set(SOURCE_KEYS)
    assert spec.verify is None or callable(spec.verify)
    if spec.sources:  # a dataset task says where its preference pairs come from, or has none
        assert (spec.preferences is not None) == ("preference_source" in spec.sources)


@pytest.mark.parametrize("name", list(FIXTURES))
def test_every_task_loads_through_its_spec(name, fixtures):
    sources, splits = FIXTURES[name]
    task = base_config().task
    task.name, task.num_train, task.num_eval, task.num_test = name, 4, 2, 2
    task.validation_fraction = 0.3
    for key, folder in sources.items():
        task[key] = str(fixtures / folder)
    for split in splits:
        prompts = task_registry.prompt_examples(task, split)
        assert prompts and all(isinstance(p, PromptExample) for p in prompts)
        assert all(isinstance(e, SFTExample) for e in task_registry.sft_examples(task, split))
        if task_registry.task(name).preferences is not None and split != "test":
            assert task_registry.preference_pairs(task, split)


def _echo_prompts(source, split, limit, seed):
    rows = [PromptExample(f"{split}-{i}", None, f"Say {i}:", f" {i}", str(i)) for i in range(40)]
    return rows[:limit] if limit else rows


ECHO = TaskSpec(
    name="echo",
    description="say the number back (a throwaway task of this test)",
    splits={"train": "train", "validation": None, "test": "test"},
    prompts=_echo_prompts,
    sft=lambda *args: [SFTExample(p, p.reference) for p in _echo_prompts(*args)],
    verify=lambda answer, text: float(text.strip() == answer),
)


@pytest.fixture
def echo(monkeypatch):
    """The throwaway task registered for one test, and a config that selects it."""
    monkeypatch.setitem(task_registry.TASKS, ECHO.name, ECHO)
    config = base_config()
    config.stage, config.task.name = "rlhf", ECHO.name
    config.task.num_train = config.task.num_eval = 5
    config.task.validation_fraction = 0.25
    return config


def test_a_task_registered_from_elsewhere_works_without_any_other_table(echo):
    task = echo.task
    train = task_registry.prompt_examples(task, "train")
    validation = task_registry.prompt_examples(task, "validation")  # carved out of train
    assert len(train) == len(validation) == 5
    assert not {p.id for p in train} & {p.id for p in validation}
    assert all(p.id.startswith("train-") for p in train + validation)
    assert len(task_registry.prompt_examples(task, "test")) == 40  # num_test=0: all of it
    assert task_registry.split_name(task, "validation") is None
    assert [e.response for e in task_registry.sft_examples(task, "train")] == [
        p.reference for p in train
    ]
    verify = task_registry.verifier(task)
    assert verify("7", " 7") == 1.0 and verify("7", "8") == 0.0
    validate(echo)  # rlhf without a reward model: its verifiable reward
    assert _dataset_needs(task, "source") == []  # generated: nothing to download


def test_the_config_checks_read_the_spec(echo):
    echo.stage = "reward"
    with pytest.raises(ConfigError, match=r"reward stage needs preference pairs \('tldr' or"):
        validate(echo)
    with pytest.raises(ValueError, match="task 'echo' has no preference data"):
        task_registry.preference_pairs(echo.task, "train")


def test_an_unknown_task_is_one_error_naming_the_known_ones():
    known = "arithmetic, tldr, nobots, gsm8k"
    with pytest.raises(ValueError, match=f"^unknown task 'nope'; known tasks: {known}$"):
        task_registry.task("nope")
    config = base_config()
    config.task.name = "nope"
    with pytest.raises(ValueError, match=f"unknown task 'nope'; known tasks: {known}"):
        task_registry.prompt_examples(config.task, "train")
    with pytest.raises(ConfigError, match=r"config.task.name='nope': one of \('arithmetic', "):
        validate(config)
