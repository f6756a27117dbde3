"""The continuous producer (`rollout.continuous`): generation that never waits for a batch
boundary.

The batch-at-a-time producer (`jaxrlhf.rl.rollout.RolloutProducer`) makes one Generate call per
batch and starts the next batch when the last sequence of this one ends, so a replica idles
while a batch's longest answers finish. Here every prompt is its own call (its n samples; or
`prompts_per_call` consecutive prompts of one batch, `rollout.prompts_per_call`, where answers
are so short that a call's fixed cost outweighs the tail it saves), and a call starts as soon
as

- its batch's staleness bound allows it (batch i needs policy version ≥ i − max_staleness, the
  same rule), and
- a replica serving such a version has a free slot of its capacity in sequences (its engine's
  `max_num_seqs`, or `generator.capacity`); a call holds n slots, each given back as its sample
  finishes, so the few sequences beyond the capacity wait in the engine's own queue and a freed
  slot is refilled at once (a call of k prompts holds k·n). A call goes to the replica with the
  most room
  (`GeneratorPool.lease`), not to a fixed share of its batch.

So batch i+1's first prompts start while batch i's last ones finish, on every replica, and with
in-flight swaps (`generator.swap_mode=in-flight`) a batch's tail continues on the new weights.
Prompts start in schedule order; a batch is handed to the learner once all its prompts are back,
and batches in order. A call that fails with its replica (down, hung, gone) is started again
from scratch on another (its partial samples dropped): no sample is lost or doubled. Every
sample's oldest token is checked against its batch's bound.

With `generation_seed`, each request is seeded on its own (GenerateRequest.seed_per_request):
prompt p of batch i draws from a seed of (seed, i, p) whatever replica, batching or retry it
meets, without a call ever running alone. The loop does not use it yet: vLLM 0.32's CPU
backend dies on a seeded request whose prefill chunked prefill splits ("CPU Generator does not
use offset", seen on the default workload), and the service refuses seed_per_request there; so
`rollout.continuous` runs generate unseeded.

A checkpoint holds the batches that are complete and not trained on yet; batches half
generated are generated again after resuming, from the checkpoint's own weights (a resumed run
publishes them before anything samples: `jaxrlhf.rl.trainer.begin`). Exact resume is not
promised in this mode: which version a prompt starts on depends on timing.

Calls: a thread per leased call, started with its lease, so a lease never waits for a thread
(leased calls queued behind busy threads once held slots the engine could not fill) and
closing leaves no lease behind. A prompt's samples reach the learner in sample order, whatever
order they finished in.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrlhf.fleet.pool import GeneratorError, GeneratorPool
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.rl.rollout import (
    ProducerBase,
    PromptItem,
    Rollout,
    StaleSampleError,
    check_within_bound,
)


@dataclasses.dataclass
class _Batch:
    index: int
    prompts: list[PromptItem]
    required: int
    started: float
    finished: float = 0.0  # when its last prompt's samples came back
    samples: dict[int, list[Sample]] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.samples) == len(self.prompts)

    def add(self, prompt: int, samples: list[Sample]) -> None:
        """A prompt's samples, in sample order (they come back in the order they finish, and
        what a loss does with ties must not depend on timing)."""
        self.samples[prompt] = sorted(samples, key=lambda s: s.sample_index)
        if self.complete:
            self.finished = time.perf_counter()

    def rollout(self) -> Rollout:
        """The batch, prompt-major; its generate_seconds run from when its bound let it start
        to its last sample (not to its delivery, which waits for the batches before it)."""
        samples = [dataclasses.replace(s, prompt_index=p)
                   for p in range(len(self.prompts)) for s in self.samples[p]]  # fmt: skip
        return Rollout(self.index, self.prompts, samples, self.required,
                       self.finished - self.started)  # fmt: skip


class ContinuousProducer(ProducerBase):
    """Generates batches start_batch, start_batch+1, ... prompt by prompt (module docstring);
    `snapshot(version)` for a checkpoint, `close()`."""

    def __init__(self, pool: GeneratorPool, *args, log: Callable[[str], None] | None = None,
                 prompts_per_call: int = 1, **kwargs):  # fmt: skip
        super().__init__(*args, **kwargs)
        if prompts_per_call < 1:
            raise ValueError(f"prompts_per_call must be >= 1, got {prompts_per_call}")
        self._pool = pool
        self._per_call = prompts_per_call
        self._n = self._sampling.get("n", 1)
        self._log = log or (lambda message: None)
        self._next_delivery = self._next_batch  # the next batch to hand over once complete
        self._batches: dict[int, _Batch] = {}
        # (batch, prompt) calls to start, in schedule order; a failed call goes back in front.
        self._queue: collections.deque[tuple[int, int]] = collections.deque()
        self._calls: set[Any] = set()  # running gRPC calls (cancelled by `close`)
        # A thread per leased call, started with its lease: a lease never waits for a thread
        # (a queue of leased calls would hold slots the engine then cannot fill), and closing
        # leaves no call that holds a lease and will never run.
        self._call_threads: set[threading.Thread] = set()
        self._stop = threading.Event()
        self.retries = 0  # calls started again after their replica failed
        self._thread = threading.Thread(target=self._run, name="continuous-producer", daemon=True)
        self._thread.start()

    # --- the learner's side ------------------------------------------------------------------

    def wait_admitted(self) -> None:
        """Nothing to wait for: which version a prompt starts on is not fixed by the schedule
        in this mode (the bound alone is), so a publish never waits for admissions."""

    def snapshot(self, version: int, timeout: float | None = None) -> list[Rollout]:
        """The complete batches not trained on yet, in order (module docstring); waits for
        nothing."""
        with self._cond:
            if self._error is not None:
                raise self._failure()
            return list(self._ready)

    def in_flight(self) -> list[int]:
        """The batches started and not complete (for tests and logs)."""
        with self._cond:
            return sorted(i for i, b in self._batches.items() if not b.complete)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            calls = list(self._calls)
        for call in calls:
            call.cancel()
        self._thread.join(timeout=60)
        with self._cond:
            threads = list(self._call_threads)
        for thread in threads:  # each gives its lease back as its cancelled call ends
            thread.join(timeout=60)

    # --- the producer thread -----------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        self._stop.set()
        super()._fail(error)

    def _next_call(self) -> tuple[int, list[int]] | None:
        """The next call to start, once its batch's bound allows it: (batch, its prompts, up to
        `prompts_per_call` consecutive ones in schedule order); None to stop."""
        with self._cond:
            while not self._stop.is_set():
                if self._queue:
                    batch, prompt = self._queue[0]
                    if self._served >= self._batches[batch].required:
                        prompts = [self._queue.popleft()[1]]
                        while (len(prompts) < self._per_call and self._queue
                               and self._queue[0] == (batch, prompts[-1] + 1)):  # fmt: skip
                            prompts.append(self._queue.popleft()[1])
                        return batch, prompts
                elif self._next_batch < self._end_batch:
                    index = self._next_batch
                    required = self.required_version(index)
                    if self._served >= required:
                        prompts = self._prompts_for_batch(index)
                        self._batches[index] = _Batch(index, prompts, required, time.perf_counter())
                        self._queue.extend((index, p) for p in range(len(prompts)))
                        self._next_batch += 1
                        continue
                self._cond.wait()
        return None

    def _run(self) -> None:
        try:
            while (call := self._next_call()) is not None:
                batch = self._batches[call[0]]
                replica = self._pool.lease(self._n * len(call[1]), batch.required, self._stop)
                if replica is None:
                    return
                thread = threading.Thread(target=self._call, args=(call, replica),
                                          name="prompt-call", daemon=True)  # fmt: skip
                with self._cond:
                    self._call_threads.add(thread)
                thread.start()
        except BaseException as error:  # noqa: BLE001 - handed to the learner thread
            self._fail(error)

    def _call_sampling(self, batch: int, first: int) -> dict[str, Any]:
        sampling = dict(self._sampling)
        if self.generation_seed is not None:
            # Distinct for every (seed, batch, prompt, sample), however prompts are grouped in
            # calls: the server adds the place in the call times n plus the sample's index
            # (GenerateRequest.seed_per_request), and a call's prompts are consecutive.
            batch_seed = self.generation_seed * 1_000_003 + batch
            sampling["seed"] = (batch_seed * 65_537 + first * self._n) % (1 << 63)
            sampling["seed_per_request"] = True
        return sampling

    def _call(self, call: tuple[int, list[int]], replica) -> None:
        try:
            self._run_call(call, replica)
        finally:
            with self._cond:
                self._call_threads.discard(threading.current_thread())

    def _run_call(self, call: tuple[int, list[int]], replica) -> None:
        index, prompts = call
        batch = self._batches[index]
        try:
            samples, error = self._pool.run_leased(
                replica, [batch.prompts[p].token_ids for p in prompts],
                self._call_sampling(index, prompts[0]), started=self._started,
                max_tokens=[batch.prompts[p].max_tokens for p in prompts],
            )  # fmt: skip
        except GeneratorError as refused:
            self._fail(refused)
            return
        except BaseException as error:  # noqa: BLE001 - handed to the learner thread
            self._fail(error)
            return
        finally:
            self._forget_calls()
        if error is not None:
            if self._stop.is_set():
                return
            with self._cond:
                self.retries += 1
                self._queue.extendleft((index, p) for p in reversed(prompts))
                self._cond.notify_all()
            named = f"prompt {prompts[0]}" if len(prompts) == 1 else f"prompts {prompts}"
            self._log(f"{named} of batch {index} is started again ({error})")
            return
        try:
            check_within_bound(index, batch.required, samples)
        except StaleSampleError as stale:
            self._fail(stale)
            return
        with self._cond:
            for place, prompt in enumerate(prompts):
                batch.add(prompt, [s for s in samples if s.prompt_index == place])
            while (done := self._batches.get(self._next_delivery)) and done.complete:
                self._ready.append(done.rollout())
                del self._batches[self._next_delivery]
                self._next_delivery += 1
            self._cond.notify_all()

    def _started(self, stream) -> None:
        with self._cond:
            self._calls.add(stream)
        if self._stop.is_set():
            stream.cancel()

    def _forget_calls(self) -> None:
        with self._cond:
            self._calls = {c for c in self._calls if c.is_active()}
