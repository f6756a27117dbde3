"""The weight-transport interface: one version of the weights to a set of replicas.

Keyed by the policy version: `send` makes one attempt to deliver a `WeightUpdate` to each of
`clients` and returns each one's `UpdateWeightsResponse` or the `grpc.RpcError` its call ended
with (a dead, hung or refusing replica does not stop the others). Retrying, and deciding what an
error means for the replica, is the pool's job. `PublishStats` is what a whole publish (all its
attempts) reports.
"""

from __future__ import annotations

import abc
import dataclasses
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from jaxrlhf.fleet.rpc import GeneratorClient, generator_pb2

# "auto": the shared file when every replica is on this host, else streamed chunks.
TRANSPORTS = ("auto", "stream", "shared")

TensorStream = Callable[[], Iterator[tuple[str, Any]]]
Outcome = generator_pb2.UpdateWeightsResponse | grpc.RpcError


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """What every attempt of one publish says about the update it carries (the header of each
    WeightChunk, or the SharedWeights request). `update_id` names this publish: the same over
    its attempts and its senders' streams, so that a replica that swapped in an attempt whose
    answer was lost reports it (GeneratorStatus.update_id) and the retry counts as delivered.
    `lora`: the tensors are a LoRA adapter with these settings (a `generator_pb2.LoraAdapter`,
    for a "lora" server); None: the model's weights."""

    policy_version: int
    num_tensors: int
    allow_rollback: bool = False
    update_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    lora: Any = None


@dataclasses.dataclass
class PublishStats:
    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    attempts: int
    # The longest time a replica paused generation for the swap (its reload, repack and reset).
    pause_seconds: float = 0.0
    # The longest time a replica took to receive and check the update before pausing.
    preload_seconds: float = 0.0
    swapped: tuple[str, ...] = ()  # the replicas that serve `policy_version` now
    failed: tuple[str, ...] = ()  # the replicas this publish gave up on (marked failed)


class WeightTransport(abc.ABC):
    """Delivers one version of the weights to replicas (module docstring)."""

    name: str

    @abc.abstractmethod
    def send(
        self,
        clients: Sequence[GeneratorClient],
        tensor_stream: TensorStream,
        update: WeightUpdate,
        timeout: float | None,
    ) -> dict[GeneratorClient, Outcome]:
        """One attempt to every client; each one's response or gRPC error. Errors of the
        learner's own stream (its conversion failed) are raised, after every call ended."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases what the transport holds (files, threads)."""
