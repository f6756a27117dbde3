"""The learner's side of the generator service: prompts spread over replicas, weights broadcast.

`publish_weights` converts the (possibly sharded) Flax parameters to the Hugging Face layout one
tensor at a time (`iter_hf_tensors`) and streams them in bounded chunks to every replica at once:
each tensor is pulled from the devices once and fanned out, so the host never holds a second
copy of the model. A replica that cannot be reached is retried with exponential back-off; a
replica that rejects the update (a bad tensor, a stale version) fails at once with its message.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from jaxrlhf.rl.rollout import Sample
from jaxrlhf.rpc import generator_pb2
from jaxrlhf.rpc.client import DEFAULT_CHUNK_BYTES, GeneratorClient, iter_weight_chunks

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class GeneratorError(RuntimeError):
    """A generator replica failed; the message names the replica and the gRPC status."""


@dataclasses.dataclass
class PublishStats:
    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    attempts: int


def _describe(target: str, error: grpc.RpcError) -> str:
    return f"generator {target}: {error.code().name}: {error.details()}"


class GeneratorPool:
    """Clients for one or more generator replicas."""

    def __init__(
        self,
        targets: Sequence[str],
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        retries: int = 5,
        backoff_seconds: float = 1.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if not targets:
            raise ValueError("at least one generator address is needed")
        self.clients = [GeneratorClient(t, auth_token, root_certificates) for t in targets]
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.chunk_bytes = chunk_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * len(targets))

    def _with_retries(self, target: str, call: Callable[[], Any]) -> tuple[Any, int]:
        delay = self.backoff_seconds
        for attempt in range(1, self.retries + 2):
            try:
                return call(), attempt
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE or attempt > self.retries:
                    raise GeneratorError(_describe(target, error)) from error
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
        raise AssertionError("unreachable")

    def wait_until_serving(self, timeout: float = 600.0) -> list[generator_pb2.GeneratorStatus]:
        return [client.wait_until_serving(timeout) for client in self.clients]

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: dict[str, Any],
        on_admitted: Callable[[], None] | None = None,
    ) -> list[Sample]:
        """Splits prompts into contiguous slices, one per replica, generated concurrently.

        `on_admitted()` runs once every replica has admitted its call (the server says so in
        the call's initial metadata, before any completion), i.e. once the weight version of
        every sample of this batch is fixed.
        """
        per = -(-len(prompts) // len(self.clients))
        slices = [(i * per, prompts[i * per : (i + 1) * per]) for i in range(len(self.clients))]
        slices = [(offset, part) for offset, part in slices if part]
        pending = [len(slices)]
        lock = threading.Lock()

        def admitted() -> None:
            with lock:
                pending[0] -= 1
                if pending[0] == 0 and on_admitted is not None:
                    on_admitted()

        def run(client: GeneratorClient, offset: int, part: Sequence[Sequence[int]]):
            options = dict(sampling)
            if options.get("seed") is not None:  # distinct, reproducible streams per replica
                options["seed"] += 7919 * (offset // per)

            def call():
                stream = client.generate([list(p) for p in part], **options)
                stream.initial_metadata()  # returns once the server admitted the call
                admitted()
                return list(stream)

            completions, _ = self._with_retries(client.target, call)
            return [
                Sample(
                    prompt_index=offset + c.prompt_index,
                    sample_index=c.sample_index,
                    token_ids=tuple(c.token_ids),
                    logprobs=tuple(c.logprobs),
                    finish_reason=c.finish_reason,
                    policy_version=c.policy_version,
                )
                for c in completions
            ]

        futures = [
            self._pool.submit(run, client, offset, part)
            for client, (offset, part) in zip(self.clients, slices, strict=False)
        ]
        samples = [s for f in futures for s in f.result()]
        return sorted(samples, key=lambda s: (s.prompt_index, s.sample_index))

    def publish_weights(
        self,
        tensor_stream: Callable[[], Iterator[tuple[str, Any]]],
        num_tensors: int,
        policy_version: int,
        allow_rollback: bool = False,
    ) -> PublishStats:
        """Sends one stream of tensors to every replica as `policy_version`; returns on swap.

        `allow_rollback`: replicas accept a version not newer than theirs (resuming a run)."""
        started = time.perf_counter()
        for attempt in range(1, self.retries + 2):
            try:
                responses = self._broadcast(
                    tensor_stream, num_tensors, policy_version, allow_rollback
                )
                break
            except grpc.RpcError as error:
                if error.code() not in RETRYABLE or attempt > self.retries:
                    raise GeneratorError(
                        f"weight update {policy_version} failed: {error.details()}"
                    ) from error
                time.sleep(min(self.backoff_seconds * 2 ** (attempt - 1), 30.0))
        return PublishStats(
            policy_version=policy_version,
            num_tensors=num_tensors,
            num_bytes=int(responses[0].num_bytes),
            seconds=time.perf_counter() - started,
            attempts=attempt,
        )

    def _broadcast(self, tensor_stream, num_tensors: int, policy_version: int, allow_rollback):
        chunks = iter_weight_chunks(
            tensor_stream(), policy_version, self.chunk_bytes, num_tensors, allow_rollback
        )
        if len(self.clients) == 1:
            client = self.clients[0]
            return [client.stub.UpdateWeights(chunks, metadata=client.metadata)]
        # Fan-out: each chunk is produced once and handed to every replica's request stream.
        done = object()
        queues = [queue.Queue(maxsize=8) for _ in self.clients]

        def feed():
            for chunk in chunks:
                for q in queues:
                    q.put(chunk)
            for q in queues:
                q.put(done)

        def drain(q: queue.Queue):
            while (item := q.get()) is not done:
                yield item

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        futures = [
            self._pool.submit(client.stub.UpdateWeights, drain(q), metadata=client.metadata)
            for client, q in zip(self.clients, queues, strict=True)
        ]
        responses = [f.result() for f in futures]
        feeder.join()
        return responses

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()
