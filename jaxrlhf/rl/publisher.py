"""The publisher: the learner's weights on their way to the generators, and the versions.

A version is the generators' label of a set of weights. A run starts at the version serving
when it begins (`base_version`, or one more when it publishes its own initial weights); update
k makes `base_version + k` (`version`); the generators serve `served` (below `version`
between two publishes when `sync_every` > 1). Only the learner publishes, so whatever it waits
for that needs generation (a batch, a checkpoint's batches, an evaluation) also brings back
replicas that answer again (`wait`).

Over several processes (`jaxrlhf.distributed`) every process holds a Publisher and takes part
in each publish (each sends its own slices); only the driver's has a pool (None elsewhere).

In the background (`generator.publish_in_background`, one process): a due publish of version v
sends v's parameters from a thread while the learner goes on with its next step. The learner's
steps then keep the parameters they read (`Learner.keep_params`: not donated, so the step
writes new ones and v's stay valid; the memory of one more copy during the step, no copying
time); a parameter published in another dtype is cast on its device first. At most one
publish is in flight: the next due one, a checkpoint, an evaluation, a rejoin and the end of
the run wait for it first (`finish`). The staleness rule is unchanged: a
batch that needs v waits until v is served (`producer.weights_served(v)`, from the thread). Per step
(`take_times`): `weight_sync_s`, the seconds of the publishes the learner saw finish during the
step (in the background: the one an earlier update started, when the learner next needs it
done), and `publish_blocked_s`, the seconds the learner waited on publishing (the cast, and
a publish still running when it needed it done). Without the background, both are the
publish's seconds. `generator_pause_s`: for the publishes of `weight_sync_s`, the time the
generators held generation back to swap (the longest replica's, summed over publishes);
`weight_sync_bytes`: the bytes those publishes sent (one replica's update, summed over them).

Over several processes a publish stays in the learner's step (it announces each attempt to
the others with a collective). Every process sends the slices its own devices hold: as one of
several streams of the update, or written into the shared file; nothing is gathered
(`publish_sliced`). Only a model whose shards are not boxes of its HF tensors is gathered,
each process taking part in each tensor's gather and the driver sending it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxrlhf.distributed import broadcast, driven_plans, driven_streams, to_host
from jaxrlhf.fleet.pool import GeneratorPool
from jaxrlhf.fleet.transport import PublishStats, WeightTransport
from jaxrlhf.fleet.transport.senders import FollowerSenders
from jaxrlhf.models import hf_tensor_specs, iter_hf_slices, iter_hf_tensors, slice_plan
from jaxrlhf.models import lora as lora_lib
from jaxrlhf.models.safetensors_io import numpy_dtype
from jaxrlhf.rl.learner import Learner

REJOIN_POLL_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class PublishJob:
    """One publish as the pool sends it: `version` of tensors laid out as `specs`, whether
    replicas serving a newer version take it (`rollback`), and whether only the rejoining
    replicas get it. `send(tensors, transport=...)` is called once per stream of tensors
    (`distributed.driven_streams`, `publish_sliced`): each call is the pool's publish."""

    pool: GeneratorPool | None
    version: int
    specs: list
    rollback: bool = False
    rejoining_only: bool = False

    def send(self, tensors: Callable[[], Iterator[tuple[str, Any]]],
             transport: WeightTransport | None = None) -> PublishStats:  # fmt: skip
        """`pool.publish_weights` of `tensors` (a stream factory), through `transport` when
        given (the senders of a multi-process learner)."""
        return self.pool.publish_weights(
            tensors, len(self.specs), self.version, allow_rollback=self.rollback,
            specs=self.specs, rejoining_only=self.rejoining_only, transport=transport,
        )  # fmt: skip


def publish(
    learner: Learner,
    pool: GeneratorPool | None,
    version: int,
    dtype: str | None,
    rollback=False,
    rejoining_only: bool = False,
    params=None,
):
    """Publishes the policy (`params`, by default the learner's) as `version` (to the replicas
    that rejoin only, with `rejoining_only`). Over several processes, each sends its own slices
    when the pool streams (`publish_sliced`); else every process gathers its tensors (one at a
    time) and the driver sends them (`distributed.driven_streams`). Returns the driver's
    PublishStats."""
    if learner.sends_adapter:
        return publish_adapter(learner, pool, version, dtype, rollback, rejoining_only, params)
    # The policy's weights in the served layout: a LoRA run's adapters merged into its base.
    model, policy_params = learner.base_policy, learner.published(params)
    specs = hf_tensor_specs(model, policy_params, dtype)
    job = PublishJob(pool, version, specs, rollback=rollback, rejoining_only=rejoining_only)
    if jax.process_count() > 1:
        plan = slice_plan(model, policy_params)
        if not plan.gathered:  # the same on every process
            return publish_sliced(model, policy_params, dtype, plan, job)
    return driven_streams(lambda: iter_hf_tensors(model, policy_params, dtype), job.send)


def publish_adapter(learner: Learner, pool, version: int, dtype: str | None, rollback=False,
                    rejoining_only: bool = False, params=None):  # fmt: skip
    """Publishes a LoRA run's adapter alone (`params`, by default the learner's) as `version`,
    to generators in "lora" mode (`generator.swap_mode`), which load it beside the base with no
    pause. Its tensors are PEFT's (A [rank, in], B [out, rank]; `lora.adapter_tensors`), a few
    MB: over several processes every process gathers each factor whole (`to_host`, in step),
    then the driver sends them through the pool's transport: streamed, or written into the
    shared file (laid out for the adapter's tensors, `specs`)."""
    from jaxrlhf.fleet.rpc import generator_pb2

    adapter = learner.state.params["policy"] if params is None else params
    config = learner.policy.config
    host = jax.tree.map(to_host, adapter)
    tensors = lora_lib.adapter_tensors(config, host, numpy_dtype(dtype) if dtype else None)
    header = generator_pb2.LoraAdapter(rank=config.lora_rank, alpha=config.lora_alpha,
                                       target_modules=list(config.lora_targets))  # fmt: skip
    specs = [(name, tuple(array.shape), array.dtype) for name, array in tensors.items()]

    def send(stream):
        return pool.publish_weights(
            stream, len(tensors), version, allow_rollback=rollback, specs=specs,
            rejoining_only=rejoining_only, lora=header,
        )  # fmt: skip

    return driven_streams(lambda: iter(tensors.items()), send)


_FOLLOWER = FollowerSenders()  # a process other than the driver: its clients, kept


def publish_sliced(model, params, dtype: str | None, plan, job: PublishJob):
    """Every process sends (streams, or writes into the shared file) the slices its devices
    own (`jaxrlhf.fleet.transport.senders`): the driver's pool runs the attempts and announces
    each; the others follow it. No gather."""

    def slices():
        return iter_hf_slices(model, params, dtype, plan)

    sender = plan.sender(jax.process_index())

    def consume(announce):
        senders = len(plan.senders)
        return job.send(slices, transport=job.pool.sender_transport(job.specs, senders, announce))

    def follow(attempt) -> None:
        _FOLLOWER.send(attempt, slices, sender)

    return driven_plans(consume, follow)


def publish_due(updates: int, cfg) -> bool:
    """Whether the run publishes after its `updates`-th update: every `sync_every`, and last."""
    return updates % cfg.sync_every == 0 or updates == cfg.total_steps


def device_copy(params, dtype: str | None, copy: bool = True):
    """`params` on their devices, cast to `dtype` (None: as they are); each array that is not
    cast is copied, unless `copy` is false (then it is the array itself)."""
    target = numpy_dtype(dtype) if dtype else None

    def one(array):
        if target is not None and array.dtype != target:
            return array.astype(target)
        return array.copy() if copy else array

    return jax.tree.map(one, params)


@dataclasses.dataclass
class Publisher:
    learner: Learner
    pool: GeneratorPool | None
    dtype: str | None  # of the published tensors
    base_version: int
    version: int  # the learner's
    # The newest version a due publish sent, so the schedule's: batches needing a newer one
    # wait for the next due publish. The generators serve it, or (after resuming between two
    # publishes) the learner's weights of the checkpoint (`jaxrlhf.rl.trainer.begin`).
    served: int
    background: bool = False  # publish beside the next train step (module docstring)
    _pending: concurrent.futures.Future | None = dataclasses.field(default=None, repr=False)
    _thread: concurrent.futures.ThreadPoolExecutor | None = dataclasses.field(
        default=None, repr=False
    )
    _sync_s: float = 0.0  # seconds of the publishes finished since the last take_times
    _blocked_s: float = 0.0  # seconds the learner waited on publishing since then
    _pause_s: float = 0.0  # the generators' pauses for those publishes (the longest each)
    _bytes: int = 0  # the bytes those publishes sent (one replica's update each)

    def send(self, rollback: bool = False, rejoining_only: bool = False):
        """Publishes the learner's weights as its `version` now (module docstring)."""
        self.finish()
        return publish(self.learner, self.pool, self.version, self.dtype, rollback,
                       rejoining_only)  # fmt: skip

    def after_update(self, cfg, producer) -> None:
        """The learner took one update: its version moves on, and the weights are published
        when due (`publish_due`), once the producer has admitted every batch that may run on
        the served ones; in the background with `background` (module docstring)."""
        self.version += 1
        if not publish_due(self.version - self.base_version, cfg):
            return
        self.finish()
        if producer is not None:
            producer.wait_admitted()
        started = time.perf_counter()
        version = self.version
        if not self.background:
            self._add(self._publish(None, version, producer, started))
            self._blocked_s += time.perf_counter() - started
            return
        # The learner's next step keeps these (`Learner.keep_params`): no copy to take.
        keep = getattr(self.learner, "keep_params", False)
        params = device_copy(self.learner.state.params["policy"], self.dtype, copy=not keep)
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._pending = self._thread.submit(self._publish, params, version, producer, started)
        self._blocked_s += time.perf_counter() - started

    def _publish(self, params, version: int, producer, started: float):
        """Sends `params` (None: the learner's) as `version`; returns (its seconds, the
        generators' longest pause, the bytes of the update)."""
        stats = publish(self.learner, self.pool, version, self.dtype, params=params)
        if producer is not None:
            producer.weights_served(version)
        self.served = version
        if stats is None:  # another process's, or a test's
            return time.perf_counter() - started, 0.0, 0
        return stats.seconds, stats.pause_seconds, stats.num_bytes

    def _add(self, times: tuple[float, float, int]) -> None:
        self._sync_s += times[0]
        self._pause_s += times[1]
        self._bytes += times[2]

    def finish(self) -> None:
        """Waits for the publish in flight, if any (re-raising its error)."""
        if self._pending is None:
            return
        started = time.perf_counter()
        try:
            self._add(self._pending.result())
        finally:
            self._pending = None
            self._blocked_s += time.perf_counter() - started

    def take_times(self) -> dict[str, float]:
        """weight_sync_s, publish_blocked_s, generator_pause_s and weight_sync_bytes since the
        last call (module docstring)."""
        times = {"weight_sync_s": self._sync_s, "publish_blocked_s": self._blocked_s,
                 "generator_pause_s": self._pause_s, "weight_sync_bytes": self._bytes}  # fmt: skip
        self._sync_s = self._blocked_s = self._pause_s = 0.0
        self._bytes = 0
        return times

    def close(self) -> None:
        """Finishes the publish in flight; the thread ends."""
        try:
            self.finish()
        finally:
            if self._thread is not None:
                self._thread.shutdown()
                self._thread = None

    def in_background(self, fn) -> Any:
        """fn() run by the driver (None elsewhere) in a thread, its result on every process,
        rejoining replicas meanwhile: an evaluation waits for generation too (and for the
        learner's weights to be served)."""
        self.finish()
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
