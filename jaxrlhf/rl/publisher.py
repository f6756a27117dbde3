"""The publisher: the learner's weights on their way to the generators, and the versions.

A version is the generators' label of a set of weights. A run starts at the version serving
when it begins (`base_version`, or one more when it publishes its own initial weights); update
k makes `base_version + k` (`version`); the generators serve `published` (below `version`
between two publishes when `sync_every` > 1). Only the learner publishes, so whatever it waits
for that needs generation (a batch, a checkpoint's batches, an evaluation) also brings back
replicas that answer again (`wait`).

Over several processes (`jaxrlhf.distributed`) every process holds a Publisher and takes part
in each publish (each gathers its tensors); only the driver's has a pool (None elsewhere).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any

from jaxrlhf.distributed import broadcast, driven_streams
from jaxrlhf.models import hf_tensor_specs, iter_hf_tensors
from jaxrlhf.rl.learner import Learner
from jaxrlhf.rl.pool import GeneratorPool
from jaxrlhf.rl.rollout import Rollout

REJOIN_POLL_SECONDS = 1.0


def publish(
    learner: Learner,
    pool: GeneratorPool | None,
    version: int,
    dtype: str | None,
    rollback=False,
    rejoining_only: bool = False,
):
    """Publishes the policy as `version` (to the replicas that rejoin only, with
    `rejoining_only`); every process gathers its tensors (one at a time), the driver sends them
    (`distributed.driven_streams`). Returns the driver's PublishStats."""
    policy_params = learner.state.params["policy"]
    specs = hf_tensor_specs(learner.policy, policy_params, dtype)
    return driven_streams(
        lambda: iter_hf_tensors(learner.policy, policy_params, dtype),
        lambda tensors: pool.publish_weights(tensors, len(specs), version,
                                             allow_rollback=rollback, specs=specs,
                                             rejoining_only=rejoining_only),
    )  # fmt: skip


def publish_due(updates: int, cfg) -> bool:
    """Whether the run publishes after its `updates`-th update: every `sync_every`, and last."""
    return updates % cfg.sync_every == 0 or updates == cfg.total_steps


@dataclasses.dataclass
class Publisher:
    learner: Learner
    pool: GeneratorPool | None
    dtype: str | None  # of the published tensors
    base_version: int
    version: int  # the learner's
    published: int  # what the generators serve for this run
    # Whether the next publish may go to replicas serving a newer version (the first publish
    # after resuming between two publishes).
    rollback: bool = False

    def send(self, rollback: bool = False, rejoining_only: bool = False):
        """Publishes the learner's weights as its `version` now (module docstring)."""
        return publish(self.learner, self.pool, self.version, self.dtype, rollback,
                       rejoining_only)  # fmt: skip

    def after_update(self, cfg, producer) -> float:
        """The learner took one update: its version moves on, and the weights are published
        when due (`publish_due`), once the producer has admitted every batch that may run on
        the served ones. Returns the publish's seconds (0 when none was due)."""
        self.version += 1
        if not publish_due(self.version - self.base_version, cfg):
            return 0.0
        if producer is not None:
            producer.wait_admitted()
        started = time.perf_counter()
        stats = self.send(rollback=self.rollback)
        if producer is not None:
            producer.publish(self.version)
        self.published, self.rollback = self.version, False
        return stats.seconds if stats is not None else time.perf_counter() - started

    def next_batch(self, producer) -> Rollout:
        """The next batch (the driver's, on every process), rejoining replicas meanwhile."""
        poll = None if producer is None else lambda timeout: producer.next(timeout=timeout)
        return self.wait(poll)

    def checkpoint_batches(self, producer) -> list[Rollout]:
        """The batches a checkpoint at the learner's version holds (`snapshot`; the driver's,
        on every process), rejoining replicas while they are generated: a batch that waits for
        a live replica completes only once one has the weights again."""
        poll = None if producer is None else lambda t: producer.snapshot(self.version, t)
        return self.wait(poll)

    def in_background(self, fn) -> Any:
        """fn() run by the driver (None elsewhere) in a thread, its result on every process,
        rejoining replicas meanwhile: an evaluation waits for generation too."""
        if fn is None:
            return self.wait(None)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evaluation") as thread:
            future = thread.submit(fn)
            return self.wait(future.result)

    def wait(self, poll) -> Any:
        """`poll(timeout)`'s result (the driver's poll; None on the other processes), broadcast
        to every process; `poll` raises TimeoutError while there is none. Until then, replicas
        that answer again get the learner's current weights as its own `version` (every process
        takes part in that publish), also between two publishes (sync_every > 1), when that
        version is ahead of the one the others serve: no host copy of the published weights is
        kept for them, and what they then sample is newer than the others' (within the
        staleness bound), each token tagged with its true version."""
        while True:
            event = None
            if poll is not None:  # the driver
                try:
                    event = ("done", poll(REJOIN_POLL_SECONDS))
                except TimeoutError:
                    event = ("rejoin", None) if self.pool.needs_weights() else ("wait", None)
            kind, result = broadcast(event)
            if kind == "done":
                return result
            if kind == "rejoin":
                self.send(rejoining_only=True)
