"""Weights from every process of a multi-process learner at once, with no gather.

Each process streams the slices of the tensors that its own devices hold
(`jaxrlhf.models.iter_hf_slices`) to every replica, as one of `num_senders` streams of the
update; the generator assembles them into one version and answers every stream alike
(`WeightChunk.num_senders` in the .proto). No process holds more than its own shards and its
send buffer (a few chunks); nothing is gathered, so no collective runs during a publish.

The driver's pool decides each attempt (which replicas, retries, failures) as for one stream:
`DriverSenders.send` first announces the attempt to the other processes (`announce`, a
broadcast), then sends its own part. Each other process runs `FollowerSenders.send` on the
announced attempt: its own part, to the same replicas, at the same time. The server's answer to
the driver's stream stands for the update (the others get the same one).

Through the shared file (same host), the same way: `SharedSenders` announces a `FileWrite`,
every process writes its own slices into the driver's file at their places
(`SharedWeightsFile.write_slices`), all check that all succeeded (a collective), and the
driver sends the one request that points the replicas at the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxrlhf.distributed import all_succeeded
from jaxrlhf.fleet.rpc.client import GeneratorClient
from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile
from jaxrlhf.fleet.transport.base import Outcome, TensorStream, WeightTransport, WeightUpdate
from jaxrlhf.fleet.transport.shared_file import SharedFileTransport
from jaxrlhf.fleet.transport.stream import StreamTransport


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of one update, as the driver announces it to the other senders."""

    targets: tuple[str, ...]
    credentials: tuple  # (auth token, root certificates) of the pool's clients
    update: WeightUpdate
    timeout: float | None
    chunk_bytes: int
    num_senders: int


@dataclasses.dataclass(frozen=True)
class FileWrite:
    """Every process writes its slices into the shared file at `path` (laid out for `specs`)."""

    path: str
    specs: tuple


def write_own_slices(path: str, specs, tensor_stream: TensorStream) -> None:
    """This process's slices into the shared file, then a check that every process's write
    succeeded (a collective: every process calls it, whatever happened)."""
    error = None
    try:
        with SharedWeightsFile.attach(path, specs) as file:
            file.write_slices(tensor_stream())
    except Exception as caught:  # noqa: BLE001 - raised below, after the collective
        error = caught
    if not all_succeeded(error is None):
        raise RuntimeError("a learner process failed to write its slices into the shared "
                           "weight file") from error  # fmt: skip


class SharedSenders(WeightTransport):
    """The driver's side through the shared file: a new version is written by every process
    (each its own slices); the request goes from the driver."""

    name = "shared"

    def __init__(self, shared: SharedFileTransport, announce: Callable[[FileWrite], None]):
        self._shared = shared
        self._announce = announce

    def send(self, clients, tensor_stream: TensorStream, update: WeightUpdate,
             timeout) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        def write(file: SharedWeightsFile) -> None:
            self._announce(FileWrite(file.path, tuple(file.specs)))
            write_own_slices(file.path, file.specs, tensor_stream)

        return self._shared.send(clients, tensor_stream, update, timeout, write=write)

    def close(self) -> None:
        """The file is the pool's transport's, kept for the next publish."""


class DriverSenders(WeightTransport):
    """The driver's side (sender 0): announces each attempt, then streams its own slices."""

    name = "stream"

    def __init__(self, chunk_bytes: int, num_senders: int, credentials: tuple,
                 announce: Callable[[Attempt], None]) -> None:  # fmt: skip
        self._own = StreamTransport(chunk_bytes, num_senders=num_senders, sender=0)
        self._credentials = credentials
        self._announce = announce

    def send(self, clients, tensor_stream: TensorStream, update: WeightUpdate,
             timeout) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        own = self._own
        self._announce(Attempt(tuple(c.target for c in clients), self._credentials, update,
                               timeout, own.chunk_bytes, own.num_senders))  # fmt: skip
        return own.send(clients, tensor_stream, update, timeout)

    def close(self) -> None:
        self._own.close()


class FollowerSenders:
    """Another process's side: its own slices, for each attempt the driver announces. Keeps a
    client per replica address across publishes."""

    def __init__(self) -> None:
        self._clients: dict[tuple, GeneratorClient] = {}

    def send(self, attempt: Attempt | FileWrite, tensor_stream: TensorStream,
             sender: int | None) -> None:  # fmt: skip
        """Streams this process's part (as `sender`) to the attempt's replicas, or writes it
        into the shared file; the answers are the driver's to judge (each is the same as the
        one its own stream gets)."""
        if isinstance(attempt, FileWrite):
            write_own_slices(attempt.path, attempt.specs, tensor_stream)
            return
        if sender is None:
            return  # this process holds no shard of its own to send
        clients = [self._client(target, attempt.credentials) for target in attempt.targets]
        transport = StreamTransport(attempt.chunk_bytes, attempt.num_senders, sender)
        transport.send(clients, tensor_stream, attempt.update, attempt.timeout)

    def _client(self, target: str, credentials: tuple) -> GeneratorClient:
        key = (target, *credentials)
        if key not in self._clients:
            self._clients[key] = GeneratorClient(target, *credentials)
        return self._clients[key]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
