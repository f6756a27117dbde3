"""The rollout producer against a scripted backend: what a checkpoint holds between two publishes,
the staleness guard, and the record of what came back (`samples_returned`)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.rollout import PromptItem, Rollout, RolloutProducer
from jaxrlhf.rl.step_metrics import samples_returned

N = 2  # samples per prompt
WAIT_S = 30.0  # far above what any call here takes; a call still waiting then is stuck


class ScriptedBackend:
    """Answers every Generate at once with samples of the version it serves (`version`), or,
    with `versions`, of the (first token's, per-token) versions that function gives for a
    call's min_version; records each call's min_version."""

    def __init__(self, versions: Callable[[int], tuple[int, tuple[int, ...]]] | None = None):
        self.version = 0
        self.versions = versions
        self.min_versions: list[int | None] = []

    def generate(self, prompts, sampling, on_admitted=None, min_version=None) -> list[Sample]:
        self.min_versions.append(min_version)
        if on_admitted is not None:
            on_admitted()
        first, tokens = self.versions(min_version) if self.versions else (self.version, ())
        return [
            Sample(p, k, (7, 8, 9), (-1.0, -1.0, -1.0), "length", first, tokens)
            for p in range(len(prompts))
            for k in range(sampling["n"])
        ]


def prompts_for_batch(index: int) -> list[PromptItem]:
    return [PromptItem(f"b{index}p{i}", (index, i), None) for i in range(2)]


def producer(backend, max_staleness: int, end_batch: int, **kwargs) -> RolloutProducer:
    kwargs = {"start_batch": 0, "served_version": 0, **kwargs}
    return RolloutProducer(backend, prompts_for_batch, {"n": N}, max_staleness,
                           end_batch=end_batch, **kwargs)  # fmt: skip


def within(seconds: float, call: Callable):
    """call()'s result, or an assertion error if it has not returned after `seconds` (a hang
    fails the test instead of blocking the suite)."""
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_snapshot_between_two_publishes_holds_what_runs_on_the_served_weights():
    """sync_every = 4 (max_staleness 3): a checkpoint after 2 updates (learner version 2, the
    generator still serves 0) holds batches 2 and 3, generated on version 0, and waits for
    nothing that needs the next publish (batch 4 needs version 1, first served at 4)."""
    backend = ScriptedBackend()
    rollouts = producer(backend, max_staleness=3, end_batch=8)
    try:
        assert [rollouts.next(WAIT_S).batch_index for _ in range(2)] == [0, 1]
        held = within(WAIT_S, lambda: rollouts.snapshot(2))
        assert [r.batch_index for r in held] == [2, 3]
        assert {s.policy_version for r in held for s in r.samples} == {0}
        assert backend.min_versions == [0, 0, 0, 0]  # batch 4 did not start
        # The run goes on: 2 more updates, then version 4 is published.
        assert [rollouts.next(WAIT_S).batch_index for _ in range(2)] == [2, 3]
        rollouts.wait_admitted()
        backend.version = 4
        rollouts.weights_served(4)
        later = [rollouts.next(WAIT_S) for _ in range(4)]
        assert [r.batch_index for r in later] == [4, 5, 6, 7]
        assert {s.policy_version for r in later for s in r.samples} == {4}
        assert backend.min_versions == [0, 0, 0, 0, 1, 2, 3, 4]
    finally:
        rollouts.close()


def test_snapshot_at_a_publish_waits_for_the_batches_of_older_weights():
    """sync_every = 1 (max_staleness 1): after update 2 and its publish, batch 2 (generated on
    version 1, not in the checkpoint) is held; the checkpoint returns without batch 3 having to
    finish (it runs on version 2, which the checkpoint holds)."""
    backend = ScriptedBackend()
    release = threading.Event()
    first = backend.generate

    def generate(prompts, sampling, on_admitted=None, min_version=None):
        if min_version == 2:  # batch 3 stays in flight until the checkpoint is taken
            release.wait(WAIT_S)
        return first(prompts, sampling, on_admitted, min_version)

    backend.generate = generate
    rollouts = producer(backend, max_staleness=1, end_batch=4)
    try:
        for version in (1, 2):
            rollouts.next(WAIT_S)
            rollouts.wait_admitted()
            backend.version = version
            rollouts.weights_served(version)
        held = within(WAIT_S, lambda: rollouts.snapshot(2))
        assert [r.batch_index for r in held] == [2]
        assert {s.policy_version for s in held[0].samples} == {1}
    finally:
        release.set()
        rollouts.close()


@pytest.mark.parametrize(
    "versions, oldest",
    [
        (lambda required: (required - 1, ()), "1"),  # the whole sample one version too old
        # In-flight swap: the first token older than the bound, the rest new enough.
        (lambda required: (required - 2, (required - 2, required, required)), "0"),
    ],
)
def test_a_sample_older_than_its_bound_is_refused(versions, oldest):
    """max_staleness 0 from version 2: batch 2 needs version 2; a generator that answers with
    older tokens (a replica that missed the publish) fails the run with a clear error."""
    rollouts = producer(ScriptedBackend(versions), max_staleness=0, end_batch=3, start_batch=2,
                        served_version=2)  # fmt: skip
    try:
        message = f"batch 2 needs policy version >= 2 but the generator answered with tokens of " \
                  f"version {oldest}"  # fmt: skip
        with pytest.raises(RuntimeError, match="rollout generation failed") as raised:
            rollouts.next(WAIT_S)
        assert message in str(raised.value)
    finally:
        rollouts.close()


def test_samples_returned_lists_each_sample_as_it_came_back():
    """Order as returned (not the schedule's), ids from the batch's prompts, a doubled sample
    shows twice: what a check against `prompt_ids` needs."""
    prompts = [PromptItem("a", (1,)), PromptItem("b", (2,))]
    order = [(1, 0), (0, 1), (0, 0), (1, 0)]
    samples = [Sample(p, k, (3,), (-1.0,), "stop", 0) for p, k in order]
    rollout = Rollout(0, prompts, samples, 0, 0.0)
    assert samples_returned(rollout) == [["b", 0], ["a", 1], ["a", 0], ["b", 0]]


def test_the_pareto_length_law_by_hand():
    """pareto:A:M gives min(cap, ⌈M · U^(−1/A)⌉) for U uniform on (0, 1] from (seed, position)."""
    import math

    import numpy as np

    from jaxrlhf.data.lengths import parse_length_law

    assert parse_length_law("", 64) is None
    budget = parse_length_law("pareto:1.5:4", 64)
    uniform = 1.0 - np.random.default_rng([3, 17, 7]).random()
    assert budget(3, 17) == min(64, math.ceil(4 * uniform ** (-1 / 1.5)))
    draws = [budget(0, position) for position in range(4000)]
    assert min(draws) >= 4 and max(draws) == 64 and budget(0, 5) == draws[5]
    # P(budget > x) = (M / x)^A below the cap: > 16 tokens with probability (4/16)^1.5 = 1/8.
    assert abs(np.mean(np.array(draws) > 16) - 0.125) < 0.02
    for law in ("pareto:1.5", "pareto:0:4", "pareto:1.5:65", "zipf:1:2", "pareto:x:4"):
        with pytest.raises(ValueError, match="expected pareto:SHAPE:MIN"):
            parse_length_law(law, 64)
