"""Weights through a file in the replicas' shared memory folder (UpdateWeightsShared), same host.

The learner writes every tensor once into a `SharedWeightsFile`
(`jaxrlhf.fleet.rpc.weights_file`) in the folder the replicas map from
(`GeneratorStatus.shared_weights_dir`, normally /dev/shm) and each replica is sent only where
the tensors lie: no weight byte crosses a socket. The file holds one
version: a later attempt for the same version (a retry, a replica rejoining) is sent the same
file without converting anything again.

The tensors are those of `specs`: the model's, or in a run publishing adapters to "lora"
servers (`WeightUpdate.lora`) the adapter's PEFT tensors, a few MB; the request then carries
the adapter's settings (SharedWeights.lora).

`progressive` (every replica's status says `shared_progress`): a new version's request goes out
before the file is written, and the file counts the tensors written as they are
(`SharedWeightsFile.write(..., progress=True)`), so that the replicas preload the layers already
written while the learner converts and writes the next.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrlhf.fleet.rpc.client import GeneratorClient
from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile
from jaxrlhf.fleet.transport.base import Outcome, TensorStream, WeightTransport, WeightUpdate
from jaxrlhf.fleet.transport.stream import collect


class SharedFileTransport(WeightTransport):
    """UpdateWeightsShared requests pointing at one file (module docstring)."""

    name = "shared"

    def __init__(self, directory: str, specs: Sequence[tuple[str, tuple[int, ...], Any]],
                 progressive: bool = False) -> None:  # fmt: skip
        self.directory = directory
        self.progressive = progressive
        self.specs = [(n, tuple(shape), np.dtype(dtype)) for n, shape, dtype in specs]
        self._file: SharedWeightsFile | None = None
        self._version: int | None = None  # the version the file holds

    def holds(self, policy_version: int) -> bool:
        """Whether the file already holds `policy_version` (a rejoining replica can take it)."""
        return self._file is not None and self._version == policy_version

    def send(self, clients, tensor_stream: TensorStream | None, update: WeightUpdate, timeout,
             write=None) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        """`write(file)`: how a new version gets into the file (default: this process writes
        `tensor_stream()` whole; `senders.SharedSenders`: every process its slices)."""
        version = update.policy_version
        if not self.holds(version):
            if tensor_stream is None:
                raise ValueError(f"the shared file does not hold version {version}")
            if self._file is None:
                self._file = SharedWeightsFile(self.directory, self.specs)
            self._version = None  # being rewritten: it holds no whole version meanwhile
            if write is None and self.progressive:
                return self._send_while_writing(clients, tensor_stream, update, timeout)
            if write is None:
                self._file.write(tensor_stream())
            else:
                write(self._file)
            self._version = version
        request = self._file.request(version, update.allow_rollback,
                                     update_id=update.update_id, lora=update.lora)  # fmt: skip
        with _calls(clients) as calls:
            futures = {
                client: calls.submit(client.update_weights_shared, request, timeout)
                for client in clients
            }
            return collect(futures)

    def _send_while_writing(self, clients, tensor_stream, update: WeightUpdate,
                            timeout) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        """The request first, then the file written tensor by tensor, counted (module
        docstring). A write that fails leaves the file abandoned: the replicas refuse it, and
        the error is raised once they have answered."""
        self._file.begin_progress()
        request = self._file.request(update.policy_version, update.allow_rollback,
                                     progressive=True, update_id=update.update_id,
                                     lora=update.lora)  # fmt: skip
        with _calls(clients) as calls:
            futures = {
                client: calls.submit(client.update_weights_shared, request, timeout)
                for client in clients
            }
            try:
                self._file.write(tensor_stream(), progress=True)
            except BaseException:
                concurrent.futures.wait(futures.values())
                raise
            self._version = update.policy_version
            return collect(futures)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _calls(clients) -> concurrent.futures.ThreadPoolExecutor:
    """A thread per replica for one attempt: every replica swaps at once, however many."""
    return concurrent.futures.ThreadPoolExecutor(
        max_workers=max(1, len(clients)), thread_name_prefix="weight-call"
    )
