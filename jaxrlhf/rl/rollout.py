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
sample carries the version the service tagged it with.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class PromptItem:
    id: str
    token_ids: tuple[int, ...]
    answer: Any = None  # what the reward function needs (e.g. the correct sum)


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt_index: int
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_version: int


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


class GenerationBackend(Protocol):
    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any]) -> list[Sample]:
        """All completions for `prompts` (n per prompt), prompt-major order."""


class RolloutProducer:
    """Generates batches start_batch, start_batch+1, ... in a background thread.

    The learner calls `next()` for each batch in order and `publish(version)` after the
    generator serves new weights.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        prompts_for_batch: Callable[[int], list[PromptItem]],
        sampling: dict[str, Any],
        max_staleness: int,
        start_batch: int,
        published_version: int,
        end_batch: int,
        base_version: int = 0,
    ):
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._backend = backend
        self._prompts_for_batch = prompts_for_batch
        self._sampling = dict(sampling)
        self.max_staleness = max_staleness
        self.base_version = base_version
        self._next_batch = start_batch
        self._end_batch = end_batch
        self._published = published_version
        self._cond = threading.Condition()
        self._ready: queue.Queue[Rollout | BaseException] = queue.Queue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def required_version(self, batch_index: int) -> int:
        """The run's versions start at `base_version` (the version serving when it began)."""
        return self.base_version + max(0, batch_index - self.max_staleness)

    def publish(self, version: int) -> None:
        """The generator now serves `version`: batches that waited for it may start."""
        with self._cond:
            self._published = max(self._published, version)
            self._cond.notify_all()

    def next(self, timeout: float | None = None) -> Rollout:
        """The next batch in order; re-raises a failure of the producer thread."""
        item = self._ready.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise RuntimeError(f"rollout generation failed: {item}") from item
        return item

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
                        lambda required=required: self._stopped or self._published >= required
                    )
                    if self._stopped:
                        return
                prompts = self._prompts_for_batch(index)
                started = time.perf_counter()
                samples = self._backend.generate([p.token_ids for p in prompts], self._sampling)
                elapsed = time.perf_counter() - started
                stale = [s.policy_version for s in samples if s.policy_version < required]
                if stale:
                    raise RuntimeError(
                        f"batch {index} needs policy version >= {required} but the generator "
                        f"answered with version {min(stale)}"
                    )
                self._ready.put(Rollout(index, prompts, samples, required, elapsed))
                self._next_batch += 1
        except BaseException as error:  # noqa: BLE001 - handed to the learner thread
            self._ready.put(error)
