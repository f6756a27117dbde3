"""Weights as a stream of gRPC chunks (UpdateWeights), to replicas on any host.

The learner's tensors are converted and encoded once per attempt, in a producer thread of their
own, and every chunk is fanned out to every replica's stream at once: each tensor is pulled
from the devices once, and the host holds a few chunks per replica, never a second copy of the
model. A replica whose call ended (it died, hung past its deadline, refused the update) is
dropped from the fan-out at once and the others go on.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Iterator, Sequence

import grpc

from jaxrlhf.rl.transport.base import Outcome, TensorStream, WeightTransport
from jaxrlhf.rpc.client import DEFAULT_CHUNK_BYTES, GeneratorClient, encode_weight_chunks

# Chunks queued ahead of each replica's stream: bounds the host memory of a broadcast to this
# many chunks per replica, plus the tensor being converted.
CHUNKS_AHEAD = 4


class _End:
    """Marks the end of a replica's chunk stream; carries the producer's error, if it failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class _ReplicaFeed:
    """The chunks on their way to one replica's UpdateWeights stream, a few at most.

    Once the replica's call has ended (it failed, or it answered early) the feed is closed: what
    is queued is dropped and later chunks are not queued, so a dead replica never blocks the
    producer, and so never the other replicas.
    """

    def __init__(self, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._closed = threading.Event()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def put(self, item: bytes | _End) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return

    def chunks(self) -> Iterator[bytes]:
        """The request stream (iterated by gRPC's thread); raises if the producer failed, which
        cancels the call."""
        while True:
            item = self._queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise RuntimeError("the weight stream failed on the learner") from item.error
                return
            yield item


def _produce(chunks: Iterator[bytes], feeds: Sequence[_ReplicaFeed]) -> BaseException | None:
    """Hands every chunk to every open feed, then the end mark; returns the stream's error."""
    error = None
    try:
        for chunk in chunks:
            if all(feed.closed for feed in feeds):
                break  # every call has ended: converting the rest would be wasted
            for feed in feeds:
                feed.put(chunk)
    except BaseException as caught:  # noqa: BLE001 - handed to the caller, which re-raises it
        error = caught
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    for feed in feeds:
        feed.put(_End(error))
    return error


class StreamTransport(WeightTransport):
    """UpdateWeights streams of `chunk_bytes` chunks (module docstring)."""

    name = "stream"

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_calls: int = 16) -> None:
        self.chunk_bytes = chunk_bytes
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=max_calls)

    def send(self, clients, tensor_stream: TensorStream, num_tensors, policy_version,
             allow_rollback, timeout) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        chunks = encode_weight_chunks(
            tensor_stream(), policy_version, self.chunk_bytes, num_tensors, allow_rollback
        )
        feeds = {client: _ReplicaFeed(CHUNKS_AHEAD) for client in clients}
        futures = {}
        for client, feed in feeds.items():
            future = self._calls.submit(client.update_weights_encoded, feed.chunks(), timeout)
            future.add_done_callback(lambda _, feed=feed: feed.close())
            futures[client] = future
        # A thread of its own, not the executor's: the calls above wait for it.
        produced: list[BaseException | None] = []
        producer = threading.Thread(
            target=lambda: produced.append(_produce(chunks, list(feeds.values()))),
            name="weight-producer",
            daemon=True,
        )
        producer.start()
        outcomes = collect(futures)
        producer.join()
        if produced[0] is not None:
            raise produced[0]
        return outcomes

    def close(self) -> None:
        self._calls.shutdown(wait=False, cancel_futures=True)


def collect(futures: dict[GeneratorClient, concurrent.futures.Future]) -> dict:
    """Waits for each client's call; its result, or the gRPC error it raised."""
    outcomes = {}
    for client, future in futures.items():
        try:
            outcomes[client] = future.result()
        except grpc.RpcError as error:
            outcomes[client] = error
    return outcomes
