"""The rollout producer: generation runs ahead of the learner by at most `max_staleness` versions.

Batch i may be generated once the generator serves a policy version ≥ i − max_staleness:

- max_staleness = 0: batch i waits for version i, the weights after i updates (synchronous,
  on-policy);
- max_staleness = 1: batch i+1 is generated with version i while the learner trains on batch i
  (the paper's one-step-off asynchronous mode);
- with `sync_every = N` and max_staleness = N − 1: N mini-batches generated with one policy,
  then N updates (the paper's off-policyness test bed).

The producer is a thread that only waits on gRPC calls to the generator service (a separate
process), so it does not compete with the learner for the GIL. Staleness is never assumed: every
token carries the version of the weights that sampled it. With in-flight swaps (generator
`--swap-mode in-flight`) a sample's tokens may come from several versions; the bound applies to
its oldest token, the first.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from jaxrlhf.fleet.sample import Sample


@dataclasses.dataclass(frozen=True)
class PromptItem:
    id: str
    token_ids: tuple[int, ...]
    answer: Any = None  # what the reward function needs (e.g. the correct sum)
    max_tokens: int = 0  # its own response budget (0 = the run's max_response_tokens)


@dataclasses.dataclass
class Rollout:
    batch_index: int
    prompts: list[PromptItem]
    samples: list[Sample]  # prompt-major: the k samples of a prompt are adjacent
    required_version: int
    generate_seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Rollout:
        prompts = [PromptItem(p["id"], tuple(p["token_ids"]), p["answer"], p.get("max_tokens", 0))
                   for p in data["prompts"]]  # fmt: skip
        samples = [
            Sample(
                **{
                    **s,
                    **{
                        key: tuple(s.get(key, ()))
                        for key in ("token_ids", "logprobs", "token_policy_versions")
                    },
                }
            )  # fmt: skip
            for s in data["samples"]
        ]
        return cls(
            data["batch_index"],
            prompts,
            samples,
            data["required_version"],
            data["generate_seconds"],
        )


class GenerationBackend(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        on_admitted: Callable[[], None] | None = None,
        min_version: int | None = None,
    ) -> list[Sample]:
        """All completions for `prompts` (n per prompt), prompt-major order, from weights of
        at least `min_version`; `on_admitted` runs once the weight version of the batch is
        fixed."""


class ProducerBase:
    """What the learner sees of a producer (this module's and `jaxrlhf.rl.continuous`'s):
    batches start_batch, start_batch+1, ... handed over in order by `next()`,
    `weights_served(version)` once a due publish has sent new weights, the staleness rule, and a
    failure of the producer thread re-raised to the learner."""

    def __init__(
        self,
        prompts_for_batch: Callable[[int], list[PromptItem]],
        sampling: dict[str, Any],
        max_staleness: int,
        start_batch: int,
        served_version: int,
        end_batch: int,
        base_version: int = 0,
        generation_seed: int | None = None,
        pending: Sequence[Rollout] = (),
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._prompts_for_batch = prompts_for_batch
        self._sampling = dict(sampling)
        self.max_staleness = max_staleness
        self.base_version = base_version
        self.generation_seed = generation_seed
        # `pending`: batches generated before a checkpoint and not trained on yet (restored).
        self._ready: collections.deque[Rollout] = collections.deque(pending)
        self._next_batch = start_batch + len(self._ready)
        self._end_batch = end_batch
        self._served = served_version
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def required_version(self, batch_index: int) -> int:
        """The run's versions start at `base_version` (the version serving when it began)."""
        return self.base_version + max(0, batch_index - self.max_staleness)

    def weights_served(self, version: int) -> None:
        """The generators now serve `version` (a due publish sent it): batches that waited for
        it may start."""
        with self._cond:
            self._served = max(self._served, version)
            self._cond.notify_all()

    def next(self, timeout: float | None = None) -> Rollout:
        """The next batch in order; re-raises a failure of the producer thread."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._error, timeout):
                raise TimeoutError(f"no rollout batch within {timeout}s")
            if self._ready:
                return self._ready.popleft()
            raise self._failure()

    def _failure(self) -> RuntimeError:
        error = RuntimeError(f"rollout generation failed: {self._error}")
        error.__cause__ = self._error
        return error

    def _fail(self, error: BaseException) -> None:
        """The producer thread failed: the learner's next call re-raises it."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()


class RolloutProducer(ProducerBase):
    """Generates one batch at a time, each one Generate call, in a background thread."""

    def __init__(self, backend: GenerationBackend, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._backend = backend
        self._admitted = self._next_batch  # batches before this one are admitted
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def wait_admitted(self) -> None:
        """Blocks until every batch that may run on the published weights has been admitted.

        Called before publishing new weights, so that which version a batch runs on depends on
        the schedule alone, never on a race between the producer thread and the learner.
        """
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    self._stopped
                    or self._error is not None
                    or self._admitted >= self._end_batch
                    or self.required_version(self._admitted) > self._served
                )
            )

    def _mark_admitted(self, index: int) -> None:
        with self._cond:
            self._admitted = max(self._admitted, index + 1)
            self._cond.notify_all()

    def snapshot(self, version: int, timeout: float | None = None) -> list[Rollout]:
        """The generated batches not trained on yet, for a checkpoint at learner `version`.

        Waits until every batch that runs on weights older than `version` and can run now is
        complete: those weights are not in the checkpoint, so a resumed run must get these
        batches from it. With `sync_every` > 1 the generator may serve a version P older than
        `version` (no publish was due): the batches needing at most P run on P and are waited
        for; those needing more wait for the next publish, of weights the resumed run trains
        again exactly, so they are regenerated exactly (from the checkpoint's weights and
        seeds) and never waited for here (they could not start before the next publish).
        Raises TimeoutError after `timeout` seconds without those batches.
        """
        with self._cond:
            # The newest version whose batches the checkpoint must hold.
            held = min(self._served, version - 1)

            def complete() -> bool:
                done = self._next_batch
                failed = self._error is not None
                return failed or done >= self._end_batch or self.required_version(done) > held

            if not self._cond.wait_for(complete, timeout):
                raise TimeoutError(f"the batches of a checkpoint not generated within {timeout}s")
            if self._error is not None:
                raise self._failure()
            return list(self._ready)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        try:
            while self._next_batch < self._end_batch:
                index = self._next_batch
                required = self.required_version(index)
                with self._cond:
                    self._cond.wait_for(
                        lambda required=required: self._stopped or self._served >= required
                    )
                    if self._stopped:
                        return
                prompts = self._prompts_for_batch(index)
                sampling = dict(self._sampling)
                if any(p.max_tokens for p in prompts):
                    sampling["prompt_max_tokens"] = [p.max_tokens for p in prompts]
                if self.generation_seed is not None:
                    # Reproducible batches: the sample depends on (seed, batch), not on history.
                    sampling["seed"] = self.generation_seed * 1_000_003 + index
                started = time.perf_counter()
                samples = self._backend.generate(
                    [p.token_ids for p in prompts],
                    sampling,
                    on_admitted=lambda index=index: self._mark_admitted(index),
                    min_version=required,
                )
                elapsed = time.perf_counter() - started
                check_complete(index, samples, len(prompts), sampling.get("n", 1))
                check_within_bound(index, required, samples)
                with self._cond:
                    self._ready.append(Rollout(index, prompts, samples, required, elapsed))
                    self._next_batch += 1
                    self._cond.notify_all()
        except BaseException as error:  # noqa: BLE001 - handed to the learner thread
            self._fail(error)


def check_within_bound(index: int, required: int, samples: Sequence[Sample]) -> None:
    """Raises StaleSampleError if a sample of batch `index` starts at a version older than the
    batch's bound `required`: the pool gives a batch only to replicas it knows serve at least
    that, so a replica serves older weights than it reported (replaced at its address, rolled
    back by another learner): a fault of the fleet the run does not train through."""
    stale = [s.oldest_version for s in samples if s.oldest_version < required]
    if stale:
        raise StaleSampleError(
            f"batch {index} needs policy version >= {required} but the generator answered with "
            f"tokens of version {min(stale)}: a replica serves older weights than it reported "
            "(replaced at its address, or rolled back by another run?). The run stops rather "
            "than train on them; once every replica serves this run's weights (or none is "
            "shared with another run), resume from the last checkpoint: --config.resume=true"
        )


class StaleSampleError(RuntimeError):
    """A sample older than its batch's staleness bound (`check_within_bound`)."""


def check_complete(index: int, samples: Sequence[Sample], prompts: int, n: int) -> None:
    """Every prompt of batch `index` has exactly its n samples, none lost, none twice (failover
    must keep that); raises RuntimeError naming what is off."""
    got = collections.Counter((s.prompt_index, s.sample_index) for s in samples)
    want = {(p, k) for p in range(prompts) for k in range(n)}
    missing, twice = want - set(got), [key for key, count in got.items() if count > 1]
    extra = set(got) - want
    if missing or twice or extra:
        raise RuntimeError(
            f"batch {index} came back with {len(missing)} (prompt, sample) missing, "
            f"{len(twice)} twice and {len(extra)} unknown of {prompts} x {n}"
        )
