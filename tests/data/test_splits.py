"""Train / validation / test splits: disjoint, fixed by a hash of each example, in proportion.

The arithmetic task used to hold out the pairs with (a + b) % 10 == 0, so its "held-out" sums all
ended in 0 and no training sum did. These tests pin the replacement: every split draws from the
same distribution (carries, three-digit sums and sums ending in 0 in every split in
proportion), and datasets without a validation split get one carved from train by id.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrlhf.config import base_config
from jaxrlhf.data import task_registry
from jaxrlhf.data.arithmetic import make_problems
from jaxrlhf.data.splits import carve, hash_fraction


def _operands(problem) -> tuple[int, int]:
    words = problem.question.replace("?", "").split()
    return int(words[2]), int(words[4])


def test_arithmetic_splits_partition_the_pairs():
    splits = {name: make_problems(0, name) for name in ("train", "validation", "test")}
    pairs = {name: {_operands(p) for p in problems} for name, problems in splits.items()}
    assert sum(len(p) for p in pairs.values()) == 90 * 90
    assert not pairs["train"] & pairs["validation"]
    assert not pairs["train"] & pairs["test"] and not pairs["validation"] & pairs["test"]
    assert 0.08 < len(pairs["test"]) / 8100 < 0.12 and 0.08 < len(pairs["validation"]) / 8100 < 0.12


def test_arithmetic_splits_keep_swapped_questions_together():
    """ "b + a" is the question "a + b" with the same answer: it must never sit in another split
    (hashing the ordered pair put ~80% of the test questions' twins in train)."""
    unordered = {
        name: {frozenset(_operands(p)) for p in make_problems(0, name)}
        for name in ("train", "validation", "test")
    }
    assert not unordered["train"] & unordered["test"]
    assert not unordered["train"] & unordered["validation"]
    assert not unordered["validation"] & unordered["test"]
    test_pairs = {_operands(p) for p in make_problems(0, "test")}
    swapped = {(b, a) for a, b in test_pairs if a != b}
    assert swapped <= test_pairs  # every twin of a test question is a test question too


@pytest.mark.parametrize(
    "feature",
    [
        lambda a, b: (a + b) % 10 == 0,  # the old held-out rule
        lambda a, b: a % 10 + b % 10 >= 10,  # a carry in the units
        lambda a, b: a + b >= 100,  # a three-digit sum
    ],
)
def test_arithmetic_splits_share_one_distribution(feature):
    shares = {}
    for name in ("train", "validation", "test"):
        problems = make_problems(0, name)
        shares[name] = np.mean([feature(*_operands(p)) for p in problems])
    overall = np.mean([feature(a, b) for a in range(10, 100) for b in range(10, 100)])
    for name, share in shares.items():
        # ~800 pairs per held-out split: 4 standard errors of a share p is 4·sqrt(p(1−p)/800).
        assert abs(share - overall) < 4 * np.sqrt(overall * (1 - overall) / 800), (name, shares)
    assert shares["test"] > 0  # (the old rule gave 0 or 1 here)


def test_arithmetic_seed_picks_within_a_fixed_split():
    assert {p.id for p in make_problems(50, "test", seed=0)} != {
        p.id for p in make_problems(50, "test", seed=1)
    }
    assert {p.id for p in make_problems(0, "test", seed=0)} == {
        p.id for p in make_problems(0, "test", seed=1)
    }
    with pytest.raises(ValueError, match="split must be one of"):
        make_problems(10, "eval")


def test_hash_fraction_is_fixed_and_uniform():
    assert hash_fraction("a") == hash_fraction("a") != hash_fraction("b")
    values = np.array([hash_fraction(str(i)) for i in range(4000)])
    assert values.min() >= 0 and values.max() < 1
    assert abs(values.mean() - 0.5) < 0.02 and abs((values < 0.1).mean() - 0.1) < 0.02
    items = [str(i) for i in range(100)]
    held, kept = carve(items, str, 0.2, True), carve(items, str, 0.2, False)
    assert sorted(held + kept) == sorted(items) and not set(held) & set(kept)


def _gsm8k_task(fraction: float):
    task = base_config().task
    task.name, task.source = "gsm8k", "tests/fixtures/data/gsm8k"
    task.num_train = task.num_eval = task.num_test = 0
    task.validation_fraction = fraction
    return task


def test_validation_is_carved_out_of_train_when_the_dataset_has_none():
    task = _gsm8k_task(0.5)
    train = {e.id for e in task_registry.prompt_examples(task, "train")}
    validation = {e.id for e in task_registry.prompt_examples(task, "validation")}
    test = {e.id for e in task_registry.prompt_examples(task, "test")}
    assert train and validation and not train & validation
    assert train | validation == {f"train-{i}" for i in range(6)}  # all of the dataset's train
    assert all(i.startswith("test-") for i in test)
    assert task_registry.split_name(task, "validation") is None


def test_an_empty_carved_split_is_a_clear_error():
    with pytest.raises(ValueError, match="validation split carved .* is empty"):
        task_registry.prompt_examples(_gsm8k_task(1e-6), "validation")


def test_a_named_eval_split_is_used_as_is():
    task = _gsm8k_task(0.5)
    task.eval_split = "test"
    assert [e.id for e in task_registry.prompt_examples(task, "validation")] == [
        e.id for e in task_registry.prompt_examples(task, "test")
    ]
