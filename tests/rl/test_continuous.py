"""The continuous producer (jaxrlhf.rl.continuous) against scripted replicas: several batches in
flight, delivery in order, the staleness bound, admission by each replica's room, failover
without a lost or doubled sample, per-request seeds, and resuming from a checkpoint taken while
batches are in flight.

The replicas are `FakeGenerator`s (tests/generator_service/replicas.py), real gRPC servers on
127.0.0.1 in this process, behind the real `GeneratorPool`. Prompt p of batch b is the tokens
(b, p); a replica answers sample k with (b, p, k), tagged with its version, after `hold` lets it.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.rl.continuous import ContinuousProducer
from jaxrlhf.rl.rollout import PromptItem, check_complete
from tests.generator_service.replicas import FakeGenerator
from tests.rl.test_rollout import WAIT_S

pytestmark = pytest.mark.timeout(120)

N = 2  # samples per prompt
PROMPTS = 4  # per batch


def prompts_for_batch(index: int) -> list[PromptItem]:
    return [PromptItem(f"b{index}p{p}", (index, p), None) for p in range(PROMPTS)]


class Holds:
    """`FakeGenerator.hold`: a call whose first prompt is in `held` waits until released."""

    def __init__(self, *held: tuple[int, int]):
        self.events = {prompt: threading.Event() for prompt in held}

    def __call__(self, token_ids: tuple[int, ...]) -> None:
        event = self.events.get(tuple(token_ids))
        if event is not None:
            assert event.wait(WAIT_S), f"prompt {token_ids} held for {WAIT_S} s"

    def release(self, prompt: tuple[int, int]) -> None:
        self.events[prompt].set()


def start(replicas, max_staleness: int, end_batch: int, **options):
    """(a GeneratorPool over `replicas`, a ContinuousProducer on it from version 0)."""
    pool = GeneratorPool([r.address for r in replicas], probe_interval=0.1,
                         no_replica_timeout=30.0)  # fmt: skip
    pool.wait_until_serving(timeout=30)
    producer = ContinuousProducer(pool, prompts_for_batch, {"n": N, "max_tokens": 1},
                                  max_staleness, start_batch=options.pop("start_batch", 0),
                                  served_version=0, end_batch=end_batch,
                                  **options)  # fmt: skip
    return pool, producer


def serve(pool: GeneratorPool, producer, replicas, version: int) -> None:
    """What the learner's publish does: the replicas serve `version` (the pool learns it as a
    publish tells it), then the producer is told."""
    for fake in replicas:
        fake.version = version
    for replica in pool.replicas:
        pool.lifecycle.join(replica, version)
    producer.weights_served(version)


def prompts_of(replica: FakeGenerator) -> list[tuple[int, int]]:
    return [tuple(r.prompts[0].token_ids) for r in list(replica.requests)]


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT_S} s: {what}"
        time.sleep(0.02)


def test_batches_generate_at_once_and_arrive_in_order():
    """max_staleness 2 at version 0 allows batches 0, 1 and 2: while batch 0's prompt 0 is
    held, batches 1 and 2 complete but wait for it (order); batch 3, needing version 1, starts
    only once it is published."""
    holds = Holds((0, 0))
    replica = FakeGenerator(capacity=64, hold=holds, workers=16)
    pool, producer = start([replica], max_staleness=2, end_batch=4)
    try:
        wait_until(lambda: len(replica.requests) == 3 * PROMPTS, "batches 0-2 all started")
        wait_until(lambda: producer.in_flight() == [0], "batches 1 and 2 complete")
        with pytest.raises(TimeoutError):
            producer.next(timeout=0.3)  # batch 0 first, and it is not complete
        assert {b for b, _ in prompts_of(replica)} == {0, 1, 2}  # none of batch 3
        holds.release((0, 0))
        assert [producer.next(WAIT_S).batch_index for _ in range(3)] == [0, 1, 2]
        serve(pool, producer, [replica], 1)
        rollout = producer.next(WAIT_S)
    finally:
        producer.close()
        pool.close()
        replica.stop()
    assert rollout.batch_index == 3 and rollout.required_version == 1
    assert {s.policy_version for s in rollout.samples} == {1}
    check_complete(3, rollout.samples, PROMPTS, N)
    for s in rollout.samples:  # prompt-major, each sample its own prompt's
        assert s.token_ids == (3, s.prompt_index, s.sample_index)


def test_calls_go_where_there_is_room_and_never_beyond_it():
    """Two replicas of capacity 4 (two prompts of 2 samples each at once). A takes the first
    call (a tie) and holds it; the next goes to B, the one with more room. A call is admitted
    while a slot is free, and its slots come back sample by sample: neither replica ever owes
    more than capacity + n − 1 = 5 samples, and every batch but the held one completes
    meanwhile."""
    holds = Holds((0, 0))
    a = FakeGenerator(capacity=4, hold=holds, workers=16)
    b = FakeGenerator(capacity=4, workers=16)
    pool, producer = start([a, b], max_staleness=3, end_batch=4)
    try:
        wait_until(lambda: len(a.requests) + len(b.requests) == 4 * PROMPTS
                   and producer.in_flight() == [0], "every call but the held one done")  # fmt: skip
        holds.release((0, 0))
        batches = [producer.next(WAIT_S) for _ in range(4)]
    finally:
        producer.close()
        pool.close()
        a.stop()
        b.stop()
    assert [r.batch_index for r in batches] == [0, 1, 2, 3]
    assert (0, 0) in prompts_of(a) and (0, 1) in prompts_of(b)
    assert a.max_sequences <= 5 and b.max_sequences <= 5
    for rollout in batches:
        check_complete(rollout.batch_index, rollout.samples, PROMPTS, N)


@pytest.mark.parametrize(("die_after", "per_call"), [(1, 1), (5, 1), (5, 3)])
def test_a_replica_dying_mid_batch_loses_and_doubles_no_sample(die_after, per_call):
    """A dies after `die_after` completions (so a prompt of it has some of its samples sent):
    its unfinished calls start again on B whole (`per_call` prompts each); every batch has each
    (prompt, sample) once."""
    a = FakeGenerator(capacity=8, tag=1.0, die_after=die_after, workers=16)
    b = FakeGenerator(capacity=8, tag=2.0, workers=16)
    logged = []
    pool, producer = start([a, b], max_staleness=3, end_batch=4, log=logged.append,
                           prompts_per_call=per_call)  # fmt: skip
    try:
        batches = [producer.next(WAIT_S) for _ in range(4)]
        metrics = pool.metrics()
    finally:
        producer.close()
        pool.close()
        a.stop()
        b.stop()
    assert a.dead and producer.retries >= 1 and metrics["failures"] == 1
    assert len([m for m in logged if "is started again" in m]) == producer.retries, logged
    for rollout in batches:
        check_complete(rollout.batch_index, rollout.samples, PROMPTS, N)
        for p in range(PROMPTS):
            samples = [s for s in rollout.samples if s.prompt_index == p]
            assert [s.token_ids for s in samples] == [(rollout.batch_index, p, k) for k in range(N)]
            assert len({s.logprobs[0] for s in samples}) == 1  # one replica's, never mixed


def test_a_sample_older_than_its_bound_is_refused():
    """The replica claims version 1 (the pool lets it take batch 1, which needs 1) but answers
    with tokens of version 0: the producer fails, naming the batch and the versions."""
    replica = FakeGenerator(capacity=8, workers=16)
    replica._completions = _answering_with(replica, version=0)
    replica.version = 1
    pool, producer = start([replica], max_staleness=0, end_batch=3)
    try:
        producer.weights_served(1)
        with pytest.raises(RuntimeError, match=r"batch 1 needs policy version >= 1 but the "
                           r"generator answered with tokens of version 0") as caught:  # fmt: skip
            for _ in range(3):
                producer.next(WAIT_S)
        # What happened and how to go on: the run stops, and resumes from its last checkpoint.
        assert "older weights than it reported" in str(caught.value.__cause__)
        assert "--config.resume=true" in str(caught.value.__cause__)
    finally:
        producer.close()
        pool.close()
        replica.stop()


def _answering_with(replica: FakeGenerator, version: int):
    completions = replica._completions
    return lambda request, context, _: completions(request, context, version)


def test_seeded_calls_seed_each_request_and_keep_their_seed_when_started_again():
    a = FakeGenerator(capacity=8, die_after=3, workers=16)
    b = FakeGenerator(capacity=8, workers=16)
    pool, producer = start([a, b], max_staleness=1, end_batch=2, generation_seed=5)
    try:
        [producer.next(WAIT_S) for _ in range(2)]
    finally:
        producer.close()
        pool.close()
        a.stop()
        b.stop()
    seeds = collections.defaultdict(set)
    for request in [*a.requests, *b.requests]:
        assert request.HasField("seed") and request.seed_per_request
        seeds[tuple(request.prompts[0].token_ids)].add(request.seed)
    assert len(seeds) == 2 * PROMPTS and all(len(s) == 1 for s in seeds.values())
    firsts = sorted(next(iter(s)) for s in seeds.values())
    # Each request of a call draws from seed + its sample index: no two overlap.
    assert all(later - earlier >= N for earlier, later in zip(firsts, firsts[1:], strict=False))


def test_resuming_from_a_checkpoint_taken_while_batches_are_in_flight():
    """A checkpoint after 1 update (version 1 published, max_staleness 2): batch 1 complete,
    batches 2 and 3 in flight (a prompt of each held). It holds batch 1 only; the resumed
    producer hands over batch 1, then generates 2, 3, 4 again, each complete."""
    holds = Holds((2, 1), (3, 0))
    replica = FakeGenerator(capacity=64, hold=holds, workers=16)
    pool, producer = start([replica], max_staleness=2, end_batch=5)
    try:
        assert producer.next(WAIT_S).batch_index == 0
        serve(pool, producer, [replica], 1)
        wait_until(lambda: producer.in_flight() == [2, 3], "batch 1 complete, 2 and 3 held")
        held = producer.snapshot(1)
    finally:
        producer.close()
        for event in holds.events.values():
            event.set()
        pool.close()
    assert [r.batch_index for r in held] == [1]
    fresh = FakeGenerator(capacity=64, version=1, workers=16)
    pool, resumed = start([fresh], max_staleness=2, end_batch=5, start_batch=1,
                          pending=held, base_version=0)  # fmt: skip
    try:
        resumed.weights_served(1)
        batches = [resumed.next(WAIT_S) for _ in range(3)]
        serve(pool, resumed, [fresh], 2)
        batches.append(resumed.next(WAIT_S))
    finally:
        resumed.close()
        pool.close()
        replica.stop()
        fresh.stop()
    assert [r.batch_index for r in batches] == [1, 2, 3, 4]
    assert {tuple(r.prompts[0].token_ids)[0] for r in batches} == {1, 2, 3, 4}
    assert {b for b, _ in prompts_of(fresh)} == {2, 3, 4}  # batch 1 came from the checkpoint
    for rollout in batches:
        check_complete(rollout.batch_index, rollout.samples, PROMPTS, N)


def _pareto_finish(scale: float, shape: float, cap: float):
    """Seconds to each sample's end, long-tailed: scale · U^(−1/shape), at most `cap`, from a
    hash of (prompt, sample) (the same for every run of the test)."""
    import random

    def finish_after(token_ids: tuple[int, ...], k: int) -> float:
        uniform = 1.0 - random.Random(hash((token_ids, k))).random()  # in (0, 1]
        return min(cap, scale * uniform ** (-1.0 / shape))

    return finish_after


# Timed: samples of seconds, so that a busy machine's thread latency (tens of ms) stays small
# beside them; left out of `make test-fast`.
@pytest.mark.slow
def test_leased_calls_keep_a_long_tailed_engine_full():
    """A replica of capacity 64, 4 samples a prompt, long-tailed lengths: most calls soon hold
    one slot (their longest sample), so far more calls than C / n run at once. While prompts
    remain to start, the samples being generated (at most 64) fill the engine: occupancy ≥ 0.9
    of 64 over that window. (A pool of C/n + 8 = 24 call threads, each lease taken before its
    call had a thread, filled about half.)"""
    n = 4
    replica = FakeGenerator(capacity=64, workers=256,
                            finish_after=_pareto_finish(0.6, 1.2, 4.0))  # fmt: skip
    pool = GeneratorPool([replica.address], probe_interval=0.1, no_replica_timeout=30.0)
    pool.wait_until_serving(timeout=30)
    batches = 6
    producer = ContinuousProducer(
        pool, lambda i: [PromptItem(f"b{i}p{p}", (i, p), None) for p in range(16)],
        {"n": n, "max_tokens": 1}, max_staleness=batches, start_batch=0, served_version=0,
        end_batch=batches,
    )  # fmt: skip
    try:
        for _ in range(batches):
            producer.next(WAIT_S)
        last_start = replica.call_starts[-1]
        window = (replica.call_starts[0], last_start)
    finally:
        producer.close()
        pool.close()
        replica.stop()
    # The integral of what was generating, over the window only: redo it from the timeline.
    assert len(replica.call_starts) == batches * 16
    occupancy = _occupancy_between(replica, *window) / 64
    assert occupancy >= 0.9, f"engine {occupancy:.0%} full while prompts waited to start"


def _occupancy_between(replica: FakeGenerator, start: float, end: float) -> float:
    """The mean number of samples a replica generated (at most its capacity) over [start, end],
    from its calls' starts and its samples' finishing offsets (`finish_after`)."""
    events = []  # (time, +1 / -1)
    for request, began in zip(replica.requests, replica.call_starts, strict=True):
        prompt = tuple(request.prompts[0].token_ids)
        for k in range(request.sampling.n):
            events += [(began, 1), (began + replica.finish_after(prompt, k), -1)]
    events.sort()
    area, owed, at = 0.0, 0, start
    for when, change in events:
        if when > at and when > start:
            span = min(when, end) - max(at, start)
            if span > 0:
                area += min(owed, replica.capacity) * span
            at = when
        owed += change
        if when >= end:
            break
    return area / (end - start)


def test_a_prompts_samples_reach_the_learner_in_sample_order_whatever_order_they_finish():
    """Sample k finishes after (n − k) · 20 ms: they come back last first; the batch lists each
    prompt's samples 0, 1, ..., so a loss's choice among equal rewards (Online DPO's chosen and
    rejected) does not depend on which finished first."""
    replica = FakeGenerator(capacity=64, workers=16,
                            finish_after=lambda token_ids, k: 0.02 * (N - k))  # fmt: skip
    pool, producer = start([replica], max_staleness=0, end_batch=1)
    try:
        rollout = producer.next(WAIT_S)
    finally:
        producer.close()
        pool.close()
        replica.stop()
    assert [s.sample_index for s in rollout.samples] == list(range(N)) * PROMPTS
    assert [s.prompt_index for s in rollout.samples] == [
        p for p in range(PROMPTS) for _ in range(N)
    ]


def test_a_batchs_generation_time_ends_at_its_last_sample_not_at_its_delivery():
    """Batch 0's prompt 0 is held for 1.5 s; batch 1 is done long before, but is handed over
    after batch 0 (order). Its generate_seconds is its own generation time (well under the
    hold), batch 0's covers the hold."""
    holds = Holds((0, 0))
    replica = FakeGenerator(capacity=64, hold=holds, workers=16)
    pool, producer = start([replica], max_staleness=1, end_batch=2)
    try:
        wait_until(lambda: producer.in_flight() == [0], "batch 1 complete, batch 0 held")
        time.sleep(1.5)
        holds.release((0, 0))
        first, second = producer.next(WAIT_S), producer.next(WAIT_S)
    finally:
        producer.close()
        pool.close()
        replica.stop()
    assert first.generate_seconds >= 1.5
    assert second.generate_seconds < 0.75, second.generate_seconds


def test_closing_gives_back_every_lease():
    """Calls that have sent their samples (their slots given back) but not ended yet keep
    their threads; more calls are leased meanwhile. Closing the producer ends them all and
    every slot of the replica is free again: no lease is left with a call that never runs."""
    finished = threading.Event()
    replica = FakeGenerator(capacity=8, workers=64,
                            linger=lambda token_ids: finished.wait(WAIT_S))  # fmt: skip
    pool, producer = start([replica], max_staleness=16, end_batch=16)
    try:
        wait_until(lambda: len(replica.requests) >= 12, "12 calls lingering")
        producer.close()
        (leased,) = pool.replicas
        in_use = leased.in_use
    finally:
        finished.set()
        pool.close()
        replica.stop()
    assert in_use == 0, f"{in_use} slots still leased after close"


def test_a_call_of_several_prompts_takes_consecutive_ones_and_keeps_each_prompt_s_seed():
    """`prompts_per_call` 3 of 4 prompts: each batch is the calls [0, 1, 2] and [3]; each
    sample goes to its own prompt; a prompt's per-request seed is the one a call of its own
    would have (the call's seed + its place × n: `GenerateRequest.seed_per_request`); a call
    holds 3 × n slots."""
    replica = FakeGenerator(capacity=64, workers=16)
    pool, producer = start([replica], max_staleness=1, end_batch=2, generation_seed=5,
                           prompts_per_call=3)  # fmt: skip
    try:
        batches = [producer.next(WAIT_S) for _ in range(2)]
    finally:
        producer.close()
        pool.close()
        replica.stop()
    calls = sorted([tuple(p.token_ids) for p in r.prompts] for r in replica.requests)
    assert calls == [[(0, 0), (0, 1), (0, 2)], [(0, 3)], [(1, 0), (1, 1), (1, 2)], [(1, 3)]]
    for rollout in batches:
        check_complete(rollout.batch_index, rollout.samples, PROMPTS, N)
        for s in rollout.samples:
            assert s.token_ids == (rollout.batch_index, s.prompt_index, s.sample_index)
    for request in replica.requests:
        for place, prompt in enumerate(request.prompts):
            batch, p = prompt.token_ids
            alone = ((5 * 1_000_003 + batch) * 65_537 + p * N) % (1 << 63)
            assert request.seed + place * N == alone
    with pytest.raises(ValueError, match="prompts_per_call must be >= 1"):
        ContinuousProducer(pool, prompts_for_batch, {"n": N}, 1, start_batch=0,
                           served_version=0, end_batch=1, prompts_per_call=0)  # fmt: skip
