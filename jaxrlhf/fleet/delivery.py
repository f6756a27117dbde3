"""How a version of the weights reaches the generator replicas: through a transport
(`jaxrlhf.fleet.transport`: streamed chunks, or the same-host shared file), to every live and
rejoining replica, with retries and the meaning of each failure. The pool
(`jaxrlhf.fleet.pool.GeneratorPool`) owns the replicas and their lifecycle; this is its publishing.

- A replica that takes the update is live at its version; a live replica known to serve that
  very version already (the pool saw it take it) gets nothing, except in a rollback (there the
  number may name another run's weights).
- A rejoining replica always gets the update, with rollback allowed, whatever version it
  reports: the number is its own word, and may name another run's weights (one that missed the
  rollback of a resume, `jaxrlhf.rl.trainer.begin`, still serves the killed run's, at the
  learner's number or a newer one). It serves nothing before it took the update.
- UNAVAILABLE may be a blip: sent once more (`retries`, with back-off), unless the replica's
  status shows it took the attempt whose answer was lost (its GeneratorStatus.update_id is this
  update's); a retry refused by a replica that serves this very update counts as delivered.
- Any other refusal is a defect and raised (GeneratorError); any other failure (down, hung, a
  stalled update answered ABORTED) marks the replica failed, and its lifecycle brings it back.
- A publish that no replica took is an error unless a failed replica can still come back.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from jaxrlhf.fleet.failures import REPLICA_DOWN, GeneratorError, describe
from jaxrlhf.fleet.lifecycle import LIVE, REJOINING, Lifecycle, Replica
from jaxrlhf.fleet.rpc import generator_pb2
from jaxrlhf.fleet.transport import (
    PublishStats,
    SharedFileTransport,
    StreamTransport,
    WeightTransport,
    WeightUpdate,
)
from jaxrlhf.fleet.transport.senders import DriverSenders, SharedSenders
from jaxrlhf_wire.hosts import is_local_target


@dataclasses.dataclass
class _Delivery:
    """How one publish went so far: the replicas that took it, their answers, the failures by
    replica, the attempts made."""

    swapped: list[str] = dataclasses.field(default_factory=list)
    responses: list[generator_pb2.UpdateWeightsResponse] = dataclasses.field(default_factory=list)
    failures: dict[str, str] = dataclasses.field(default_factory=dict)
    attempts: int = 0

    def took(self, target: str, response: generator_pb2.UpdateWeightsResponse) -> None:
        self.responses.append(response)
        self.swapped.append(target)
        self.failures.pop(target, None)


@dataclasses.dataclass(frozen=True)
class DeliverySettings:
    """The pool's settings its publishing reads: the chunk size of streamed updates, the
    transport ("auto", "stream" or "shared"), retries of an UNAVAILABLE attempt and the first
    back-off between them, the deadlines of an update and of GetStatus, and the credentials
    (auth token, root certificates) the senders of a multi-process learner connect with."""

    chunk_bytes: int
    transport: str
    retries: int
    backoff_seconds: float
    update_timeout: float
    status_timeout: float
    credentials: tuple[str | None, bytes | None]


class WeightDelivery:
    """The pool's publishing (module docstring): `publish` one version, `sender_transport` for
    the senders of a multi-process learner, `close` the transport. It sees the replicas only
    through their `Lifecycle` (which are live or rejoining, failing one, joining one at a
    version, counting retries): the pool's interface to it."""

    def __init__(self, lifecycle: Lifecycle, settings: DeliverySettings,
                 log: Callable[[str], None]):  # fmt: skip
        self.lifecycle, self.settings, self.log = lifecycle, settings, log
        self._transport: WeightTransport | None = None

    def publish(
        self,
        tensor_stream: Callable[[], Iterator[tuple[str, Any]]] | None,
        num_tensors: int,
        policy_version: int,
        allow_rollback: bool = False,
        specs: Sequence[tuple[str, tuple[int, ...], Any]] | None = None,
        rejoining_only: bool = False,
        transport: WeightTransport | None = None,
        lora=None,
    ) -> PublishStats:
        """Sends `policy_version` to every live and rejoining replica (only the rejoining ones
        with `rejoining_only`); returns once each has swapped or was marked failed.

        `tensor_stream()` gives the tensors (called once per attempt of a streamed update).
        `specs` ([(name, shape, dtype)] of the stream, in order) allows the same-host shared
        file. `allow_rollback`: replicas accept a version not newer than theirs (resuming); a
        rejoining replica always does, and always gets the update, whatever version it reports
        (it takes the current weights whatever it served: module docstring).
        `transport`: this publish's, instead of the pool's (`sender_transport`). `lora` (a
        `generator_pb2.LoraAdapter`): the tensors are a LoRA adapter for "lora" servers, sent
        as the model's weights would be (streamed, or in the shared file laid out as `specs`).
        Raises GeneratorError when no replica took it and none can come back (module
        docstring), or one refused it as malformed."""
        started = time.perf_counter()
        targets = (
            self.lifecycle.in_states(REJOINING)
            if rejoining_only
            else self.lifecycle.in_states(LIVE, REJOINING)
        )
        # Only a live replica's version is the pool's own knowledge (it saw the replica take
        # it): one known to serve this very version needs nothing, except in a rollback (there
        # the number may name another run's weights). A rejoining replica's version is what it
        # reports: never trusted, it always takes the update (module docstring).
        already = [r for r in targets if r.state == LIVE and r.version == policy_version
                   and not allow_rollback]  # fmt: skip
        rejoining = any(r.state == REJOINING for r in targets)
        # A rejoining replica takes the current weights whatever it served, a newer version
        # too (a killed run's); a live one serves this run's versions, none newer than this.
        update = WeightUpdate(policy_version, num_tensors, allow_rollback or rejoining,
                              lora=lora)  # fmt: skip
        pending = [r for r in targets if r not in already]
        delivery = _Delivery(swapped=[r.target for r in already])
        if pending:
            self._deliver(pending, transport or self._transport_for(specs), tensor_stream,
                          update, delivery)  # fmt: skip
        if targets and not delivery.swapped and not rejoining_only:
            self._none_took(policy_version, len(targets), delivery.failures)
        responses = delivery.responses
        return PublishStats(
            policy_version=policy_version,
            num_tensors=num_tensors,
            num_bytes=max((int(r.num_bytes) for r in responses), default=0),
            seconds=time.perf_counter() - started,
            attempts=delivery.attempts,
            pause_seconds=max((r.pause_seconds for r in responses), default=0.0),
            preload_seconds=max((r.preload_seconds for r in responses), default=0.0),
            swapped=tuple(delivery.swapped),
            failed=tuple(delivery.failures),
        )

    def _deliver(self, pending: list[Replica], transport: WeightTransport, tensor_stream,
                 update: WeightUpdate, delivery: _Delivery) -> None:  # fmt: skip
        """Attempts of `update` to `pending` through `transport`, recorded in `delivery`:

        - a replica that answers is live at the update's version;
        - UNAVAILABLE may be a blip: the replica is sent the update once more (at most
          `retries` times, with back-off), unless its status then shows it took the attempt
          whose answer was lost (its GeneratorStatus.update_id is this update's);
        - a retry refused by a replica that turns out to serve this very update (that status
          again) counts as delivered: its first attempt was applied;
        - any other refusal is a defect and raised (GeneratorError); any other failure
          (replica down, hung, or a stalled update answered ABORTED) marks it failed, and its
          lifecycle brings it back."""
        delay = self.settings.backoff_seconds
        for attempt in range(1, self.settings.retries + 2):
            if attempt > 1:  # an attempt whose answer was lost may have been applied
                pending = [r for r in pending if not self._took(r, update, delivery)]
                if not pending:
                    break
            delivery.attempts = attempt
            by_client = {r.client: r for r in pending}
            outcomes = transport.send(list(by_client), tensor_stream, update,
                                      self.settings.update_timeout)  # fmt: skip
            pending = []
            for client, outcome in outcomes.items():
                replica = by_client[client]
                if not isinstance(outcome, grpc.RpcError):
                    delivery.took(replica.target, outcome)
                    self.lifecycle.join(replica, update.policy_version)
                elif (attempt > 1 and outcome.code() not in REPLICA_DOWN
                      and self._took(replica, update, delivery)):  # fmt: skip
                    pass  # a retry refused (not newer): the lost attempt was applied
                elif outcome.code() not in REPLICA_DOWN:
                    raise GeneratorError(f"weight update {update.policy_version} refused: "
                                         + describe(replica.target, outcome))  # fmt: skip
                else:
                    delivery.failures[replica.target] = describe(replica.target, outcome)
                    if outcome.code() == grpc.StatusCode.UNAVAILABLE:
                        pending.append(replica)  # maybe a blip: once more
                    else:
                        self.lifecycle.fail(replica, delivery.failures[replica.target])
            if not pending or attempt > self.settings.retries:
                break
            self.lifecycle.count("publish_retries", len(pending))
            again = ", ".join(r.target for r in pending)
            self.log(f"weight update {update.policy_version} ended UNAVAILABLE at {again}: "
                     "sending it once more")  # fmt: skip
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
        for replica in pending:
            if not self._took(replica, update, delivery):
                self.lifecycle.fail(replica, delivery.failures[replica.target])

    def _took(self, replica: Replica, update: WeightUpdate, delivery: _Delivery) -> bool:
        """Whether `replica` serves this very update (GeneratorStatus.update_id): an attempt
        whose answer was lost was applied. If so it is live at the update's version, and its
        answer (built from its status) is recorded in `delivery`."""
        try:
            status = replica.client.status(timeout=self.settings.status_timeout)
        except grpc.RpcError:
            return False
        if not (status.serving and status.policy_version == update.policy_version
                and status.update_id == update.update_id):  # fmt: skip
            return False
        self.log(f"generator {replica.target} already serves weight update "
                 f"{update.policy_version} (an attempt whose answer was lost)")  # fmt: skip
        delivery.took(replica.target, generator_pb2.UpdateWeightsResponse(
            policy_version=update.policy_version, num_tensors=update.num_tensors,
            pause_seconds=status.pause_seconds, preload_seconds=status.preload_seconds,
        ))  # fmt: skip
        self.lifecycle.join(replica, update.policy_version)
        return True

    def _none_took(self, policy_version: int, count: int, failures: dict[str, str]) -> None:
        """A publish reached no replica: an error, unless one can come back (then it gets the
        weights when it rejoins, within `no_replica_timeout` for `generate`)."""
        message = (
            f"weight update {policy_version} reached none of {count} generator(s): "
            + "; ".join(failures.values())
        )
        if not self.lifecycle.may_come_back():
            raise GeneratorError(message)
        self.log(f"{message}; it goes to the first that rejoins")

    @property
    def transport(self) -> WeightTransport | None:
        """The transport decided at the first publish (None before it, or while undecided)."""
        return self._transport

    def sender_transport(self, specs, num_senders: int, announce) -> WeightTransport:
        """The driver's transport when the `num_senders` processes of a multi-process learner
        each send their own slices (`jaxrlhf.fleet.transport.senders`): streams, or writes into
        the shared file, as the pool's transport goes; `announce` hands each attempt to the
        other processes."""
        transport = self._transport_for(specs)
        if isinstance(transport, SharedFileTransport):
            return SharedSenders(transport, announce)
        return DriverSenders(
            self.settings.chunk_bytes, num_senders, self.settings.credentials, announce
        )

    def _transport_for(self, specs) -> WeightTransport:
        """The transport, decided at the first publish: the shared file when `transport` is
        "shared", or "auto" and every replica runs on this host and shares one folder this
        process can write to (a replica that does not answer leaves "auto" undecided: this
        publish streams); else the stream."""
        if self._transport is not None:
            return self._transport
        if self.settings.transport == "stream":
            self._transport = StreamTransport(self.settings.chunk_bytes)
            return self._transport
        reason, decided = self._shared_unavailable()
        if specs is None:
            reason, decided = "the publish gave no tensor layout", False
        if reason and self.settings.transport == "shared":
            raise GeneratorError(f"weight transport 'shared' is not possible: {reason}")
        if reason:
            transport = StreamTransport(self.settings.chunk_bytes)
            if decided:
                self._transport = transport
            return transport
        statuses = [
            r.client.status(timeout=self.settings.status_timeout) for r in self.lifecycle.replicas
        ]
        # Written while the replicas preload it, when every one of them takes that.
        progressive = all(status.shared_progress for status in statuses)
        self._transport = SharedFileTransport(
            statuses[0].shared_weights_dir, specs, progressive=progressive
        )
        return self._transport

    def _shared_unavailable(self) -> tuple[str, bool]:
        """(why the replicas cannot take shared-file updates from this process, or "";
        whether that is settled rather than a replica not answering now)."""
        remote = [r.target for r in self.lifecycle.replicas if not is_local_target(r.target)]
        if remote:
            return f"generators {', '.join(remote)} are not addressed on this host", True
        try:
            timeout = self.settings.status_timeout
            folders = {r.target: r.client.status(timeout=timeout).shared_weights_dir
                       for r in self.lifecycle.replicas}  # fmt: skip
        except grpc.RpcError as error:
            return f"a generator did not answer ({error.code().name})", False
        if "" in folders.values():
            return (
                f"generators {[t for t, f in folders.items() if not f]} take no shared updates",
                True,
            )
        if len(set(folders.values())) > 1:
            return f"the generators map shared files from different folders: {folders}", True
        folder = next(iter(folders.values()))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            return f"the generators' shared folder {folder} is not writable here", True
        return "", True

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
