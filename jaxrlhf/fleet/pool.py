"""The learner's side of the generator replicas: Generate fanned out with failover, weights
published through a transport. Each replica is live, failed or rejoining; failed replicas are
probed, restarted and brought back by their lifecycle (`jaxrlhf.fleet.lifecycle`).

Generate (`generate`) splits the prompts over the live replicas; a call that fails hands its
unfinished prompts to the replicas still live (or, when none is, to the first that rejoins):
completions of prompts the failed replica finished are kept, a prompt it left unfinished is
regenerated whole (its partial samples dropped), so a batch comes back with exactly its prompts
x n samples, never a duplicate. Publishing (`publish_weights`) goes to every live and rejoining
replica through the transport (`jaxrlhf.fleet.transport`); a replica that cannot take it is marked
failed and the others go on. A publish that no replica takes is an error unless a failed
replica can still come back (it answers, or the run restarts it): it then gets the weights
when it rejoins, and `generate` waits for it at most `no_replica_timeout`. A replica refusing an
update as malformed is an error (a defect, not a failure). Every call has a deadline
(`Timeouts`): a replica that misses one is treated as dead.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from jaxrlhf.fleet.delivery import DeliverySettings, WeightDelivery
from jaxrlhf.fleet.failures import REPLICA_DOWN, GeneratorError, describe
from jaxrlhf.fleet.lifecycle import LIVE, REJOINING, Lifecycle, Replica, served_identity
from jaxrlhf.fleet.rpc import generator_pb2
from jaxrlhf.fleet.rpc.client import DEFAULT_CHUNK_BYTES, GeneratorClient
from jaxrlhf.fleet.sample import Sample
from jaxrlhf.fleet.transport import (
    TRANSPORTS,
)

logger = logging.getLogger(__name__)

# gRPC backs off reconnecting to a dead server up to 2 minutes; a replica that comes back must
# be seen within a probe or two.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Deadlines of the calls to a replica, in seconds; a replica that misses one is failed.

    generate: 0 = derived per call from its work: 30 s + (rows x max_tokens) / 50, i.e. room
    for a replica as slow as 50 tokens/s. update: a weight update's, status: GetStatus's (also
    the probes').
    """

    generate: float = 0.0
    update: float = 600.0
    status: float = 5.0

    def generate_for(self, rows: int, max_tokens: int) -> float:
        return self.generate or 30.0 + rows * max_tokens / 50.0


def prompt_messages(prompts: Sequence[Sequence[int]], max_tokens: Sequence[int] = ()):
    """Prompt messages of one call (ids "0", "1", ...), each with its own max_tokens when
    `max_tokens` gives them (0 = the call's)."""
    limits = list(max_tokens) or [0] * len(prompts)
    return [generator_pb2.Prompt(id=str(i), token_ids=list(p), max_tokens=int(m))
            for i, (p, m) in enumerate(zip(prompts, limits, strict=True))]  # fmt: skip


class GeneratorPool:
    """Clients for one or more generator replicas (module docstring).

    `restart(target) -> new target` starts a replacement for a replica the caller started itself
    (None: replicas are someone else's; they are only probed). `log(message)` reports failures,
    failovers, restarts and rejoins.
    """

    def __init__(
        self,
        targets: Sequence[str],
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        retries: int = 1,
        backoff_seconds: float = 0.5,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        transport: str = "auto",
        timeouts: Timeouts = Timeouts(),
        probe_interval: float = 2.0,
        restart: Callable[[str], str] | None = None,
        max_restarts: int = 3,
        no_replica_timeout: float = 600.0,
        log: Callable[[str], None] | None = None,
        capacity: int = 0,
    ):
        if not targets:
            raise ValueError("at least one generator address is needed")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport must be one of {TRANSPORTS}, got {transport!r}")
        self._credentials = (auth_token, root_certificates)
        self.replicas = [
            Replica(GeneratorClient(t, auth_token, root_certificates)) for t in targets
        ]
        self.retries, self.backoff_seconds = retries, backoff_seconds
        self.chunk_bytes, self.transport_name = chunk_bytes, transport
        self.timeouts = timeouts
        self.no_replica_timeout = no_replica_timeout
        self.log = log or logger.warning
        if capacity < 0:
            raise ValueError(f"replica capacity must be >= 0 (0 = the engine's), got {capacity}")
        self.capacity = capacity
        self.counters: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=4 * len(targets) + 4)
        self._closed = threading.Event()
        self.lifecycle = Lifecycle(self.replicas, self._cond, self.counters, self._client,
                                   timeouts.status, probe_interval, restart, max_restarts,
                                   self.log)  # fmt: skip
        self.delivery = WeightDelivery(self.lifecycle, DeliverySettings(
            chunk_bytes, transport, retries, backoff_seconds, timeouts.update, timeouts.status,
            self._credentials,
        ), self.log)  # fmt: skip
        # Publishing is the delivery's (`WeightDelivery.publish`, `.sender_transport`).
        self.publish_weights = self.delivery.publish
        self.sender_transport = self.delivery.sender_transport

    def _client(self, target: str) -> GeneratorClient:
        return GeneratorClient(target, *self._credentials, options=RECONNECT_OPTIONS)

    # --- state -------------------------------------------------------------------------------

    def _in(self, *states: str) -> list[Replica]:
        return self.lifecycle.in_states(*states)

    def _fail(self, replica: Replica, reason: str) -> None:
        self.lifecycle.fail(replica, reason)

    def _live_summary(self) -> str:
        return self.lifecycle.summary()

    def metrics(self) -> dict[str, int]:
        """generators_live now; failures, failovers, restarts, rejoins, publish_retries since the
        pool began."""
        with self._cond:
            live = sum(r.state == LIVE for r in self.replicas)
            counts = dict(self.counters)
        return {"generators_live": live, **{k: counts.get(k, 0) for k in
                ("failures", "failovers", "restarts", "rejoins", "publish_retries")}}  # fmt: skip

    def occupancy(self) -> dict[str, tuple[float, float, int, float]]:
        """(idle seconds, request-seconds, capacity, uptime seconds) of each live replica since
        it started, on its own clock (GetStatus: idle_seconds, request_seconds, max_num_seqs,
        uptime_seconds), by target; asked in parallel, and a replica that does not answer
        within a second is left out (it is not failed for that: its calls decide)."""
        replicas = self._in(LIVE)
        futures = [self._calls.submit(r.client.status, timeout=min(self.timeouts.status, 1.0))
                   for r in replicas]  # fmt: skip
        out = {}
        for replica, future in zip(replicas, futures, strict=True):
            try:
                status = future.result()
            except grpc.RpcError:
                continue
            out[replica.target] = (status.idle_seconds, status.request_seconds,
                                   status.max_num_seqs, status.uptime_seconds)  # fmt: skip
        return out

    def needs_weights(self) -> bool:
        """Whether a replica answers again and waits for the current weights (a publish with
        `rejoining_only`)."""
        return bool(self._in(REJOINING))

    def wait_until_serving(self, timeout: float = 600.0) -> list[generator_pb2.GeneratorStatus]:
        """Every replica's status once it serves (at the start of a run: all must)."""
        statuses = []
        for replica in self.replicas:
            status = replica.client.wait_until_serving(timeout)
            replica.version = status.policy_version
            replica.capacity = self.capacity or status.max_num_seqs
            replica.identity = served_identity(status)
            statuses.append(status)
        return statuses

    # --- Generate ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        on_admitted: Callable[[], None] | None = None,
        min_version: int | None = None,
    ) -> list[Sample]:
        """All n completions of every prompt, prompt-major, from the live replicas (failover:
        module docstring); `sampling["prompt_max_tokens"]`, if given, is each prompt's own
        max_tokens (Prompt.max_tokens). `on_admitted()` runs once every first call was
        admitted (the server says so before its first completion: the batch's weight version
        is then fixed) or has ended. Replicas serving a version below `min_version` get no
        work; when none can take the batch at first, `on_admitted()` runs at once: the learner
        must not wait for an admission that needs it to bring a replica back (rejoin) or to
        publish first."""
        sampling = dict(sampling)
        limits = list(sampling.pop("prompt_max_tokens", ()))
        n = sampling.get("n", 1)
        done: dict[int, list[Sample]] = {}
        pending = list(range(len(prompts)))
        fired = on_admitted is None
        if not fired and not self._usable(min_version):
            fired = True
            on_admitted()
        attempt = 0
        while pending:
            replicas = self._wait_for_live(min_version)
            per = -(-len(pending) // len(replicas))
            parts = [(r, pending[i * per : (i + 1) * per]) for i, r in enumerate(replicas)]
            parts = [(r, part) for r, part in parts if part]
            countdown = [len(parts)]
            lock = threading.Lock()

            def settled(countdown=countdown, lock=lock) -> None:
                nonlocal fired
                with lock:
                    countdown[0] -= 1
                    if countdown[0] == 0 and not fired:
                        fired = True
                        on_admitted()

            futures = [
                self._calls.submit(self._generate_part, r,
                                   prompt_messages([prompts[i] for i in part],
                                                   [limits[i] for i in part] if limits else ()),
                                   self._part_sampling(sampling, slot, attempt), settled)
                for slot, (r, part) in enumerate(parts)
            ]  # fmt: skip
            failed = 0
            for (replica, part), future in zip(parts, futures, strict=True):
                completions, error = future.result()
                by_prompt: dict[int, list[Sample]] = collections.defaultdict(list)
                for c in completions:
                    index = part[c.prompt_index]
                    by_prompt[index].append(Sample(index, c.sample_index, tuple(c.token_ids),
                                                   tuple(c.logprobs), c.finish_reason,
                                                   c.policy_version,
                                                   tuple(c.token_policy_versions),
                                                   c.submitted_unix_time,
                                                   c.finished_unix_time))  # fmt: skip
                for index, samples in by_prompt.items():
                    if sorted(s.sample_index for s in samples) == list(range(n)):
                        done[index] = samples
                if error is not None:
                    failed += 1
                    self._fail(replica, error)
            left = [i for i in pending if i not in done]
            if left and failed:
                with self._cond:
                    self.counters["failovers"] += 1
                self.log(f"failover: {len(left)} of {len(prompts)} prompts go to the live "
                         f"replicas ({self._live_summary()})")  # fmt: skip
            pending, attempt = left, attempt + 1
        samples = [s for index in sorted(done) for s in done[index]]
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    @staticmethod
    def _part_sampling(sampling: dict[str, Any], slot: int, attempt: int) -> dict[str, Any]:
        """Sampling of one call: its own seed (distinct, reproducible streams per replica and
        per failover round)."""
        options = dict(sampling)
        if options.get("seed") is not None:
            options["seed"] += 7919 * slot + 104729 * attempt
        return options

    def _generate_part(self, replica: Replica, prompts, sampling, settled: Callable[[], None]):
        """(completions received, the error that ended the call or None)."""
        completions: list[Any] = []
        admitted = False
        timeout = self.timeouts.generate_for(len(prompts) * sampling.get("n", 1),
                                             sampling.get("max_tokens", 1))  # fmt: skip
        try:
            stream = replica.client.generate(prompts, timeout=timeout,
                                             **sampling)  # fmt: skip
            stream.initial_metadata()  # returns once the server admitted the call
            admitted = True
            settled()
            completions.extend(stream)
            return completions, None
        except grpc.RpcError as error:
            if error.code() not in REPLICA_DOWN:
                raise GeneratorError(describe(replica.target, error)) from error
            return completions, f"Generate: {error.code().name}: {error.details()}"
        finally:
            if not admitted:
                settled()

    def _wait_for_live(self, min_version: int | None) -> list[Replica]:
        """The live replicas (serving at least `min_version`); waits for one to (re)join."""
        deadline = time.monotonic() + self.no_replica_timeout
        with self._cond:
            while not self._usable(min_version):
                if self._closed.is_set():
                    raise GeneratorError("the generator pool is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._none_live(min_version)
                self._cond.wait(min(left, 1.0))
            return self._usable(min_version)

    def _none_live(self, min_version: int | None) -> GeneratorError:
        need = "" if min_version is None else f" at version >= {min_version}"
        states = "; ".join(f"{r.target}: {r.state}, version {r.version} ({r.error})"
                           for r in self.replicas)  # fmt: skip
        return GeneratorError(f"no generator replica live{need} for "
                              f"{self.no_replica_timeout:g} s: {states}")  # fmt: skip

    def _usable(self, min_version: int | None) -> list[Replica]:
        """The live replicas serving at least `min_version`."""
        with self._cond:
            return [r for r in self.replicas if r.state == LIVE
                    and (min_version is None or r.version >= min_version)]  # fmt: skip

    # --- leased calls (continuous generation) -------------------------------------------------

    def lease(self, cost: int, min_version: int | None, stop: threading.Event) -> Replica | None:
        """A live replica serving at least `min_version` with a sequence slot free, the one with
        the most; `cost` sequences are held on it until given back (`release`, sample by sample
        in `run_leased`). So a replica runs at most capacity + cost − 1 sequences: the few
        beyond its capacity wait in its engine's own queue and take a slot the moment one frees,
        instead of after a round trip to this process. Waits for a slot or a replica to
        (re)join; None once `stop` is set; raises GeneratorError after `no_replica_timeout` s
        with no usable replica at all."""
        deadline = time.monotonic() + self.no_replica_timeout
        with self._cond:
            while not stop.is_set():
                usable = self._usable(min_version)
                if usable:
                    deadline = time.monotonic() + self.no_replica_timeout
                # (a replica of unknown capacity, older than GetStatus.max_num_seqs, takes one
                # call at a time)
                free = [(r.capacity - r.in_use, r) for r in usable
                        if r.in_use == 0 or r.in_use < r.capacity]  # fmt: skip
                if free:
                    replica = max(free, key=lambda pair: pair[0])[1]
                    replica.in_use += cost
                    return replica
                if self._closed.is_set():
                    raise GeneratorError("the generator pool is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._none_live(min_version)
                self._cond.wait(min(left, 0.5))
        return None

    def release(self, replica: Replica, cost: int) -> None:
        with self._cond:
            replica.in_use -= cost
            self._cond.notify_all()

    def run_leased(
        self,
        replica: Replica,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        started: Callable[[Any], None] | None = None,
        max_tokens: Sequence[int] = (),
    ) -> tuple[list[Sample], str | None]:
        """One Generate call of `prompts` (n samples each; `max_tokens`: each prompt's own
        budget, 0 = the call's) on a leased `replica`, its lease given back sample by sample as
        each finishes (the engine's slot is free then) and the rest when it ends: (its samples,
        prompt_index the prompt's place in `prompts`, or [] if the call failed; the error that
        marks the replica failed, or None). `started(call)` gets the gRPC call, so that it can
        be cancelled. A refusal (not a replica failure) raises GeneratorError."""
        n = sampling.get("n", 1)
        timeout = self.timeouts.generate_for(n * len(prompts), sampling.get("max_tokens", 1))
        samples: list[Sample] = []
        held = n * len(prompts)
        try:
            stream = replica.client.generate(prompt_messages(prompts, max_tokens),
                                             timeout=timeout, **sampling)  # fmt: skip
            if started is not None:
                started(stream)
            for c in stream:
                samples.append(Sample(c.prompt_index, c.sample_index, tuple(c.token_ids),
                                      tuple(c.logprobs), c.finish_reason, c.policy_version,
                                      tuple(c.token_policy_versions), c.submitted_unix_time,
                                      c.finished_unix_time))  # fmt: skip
                if held > 0:
                    held -= 1
                    self.release(replica, 1)
        except grpc.RpcError as error:
            if error.code() not in REPLICA_DOWN:
                raise GeneratorError(describe(replica.target, error)) from error
            reason = f"Generate: {error.code().name}: {error.details()}"
            if error.code() != grpc.StatusCode.CANCELLED:
                self._fail(replica, reason)
            return [], reason
        finally:
            if held > 0:
                self.release(replica, held)
        expected = [(p, i) for p in range(len(prompts)) for i in range(n)]
        if sorted((s.prompt_index, s.sample_index) for s in samples) != expected:
            return [], f"Generate ended with {len(samples)} of {len(expected)} samples"
        return samples, None

    # --- weights -----------------------------------------------------------------------------

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        self.lifecycle.close()
        self.delivery.close()
        self._calls.shutdown(wait=False, cancel_futures=True)
        for replica in self.replicas:
            replica.client.close()
