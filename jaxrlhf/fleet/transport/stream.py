"""Weights as a stream of gRPC chunks (UpdateWeights), to replicas on any host.

The learner's tensors are converted and encoded once per attempt, in a producer thread of their
own, and every chunk is fanned out to every replica's stream at once: each tensor is pulled
from the devices once, and the host holds a few chunks, never a second copy of the model. Every
replica's call runs at once, in a thread of its own for the attempt, however many replicas
there are. A replica whose call ended (it died, hung past its deadline, refused the update) is
dropped from the fan-out at once and the others go on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Iterator, Sequence

import grpc

from jaxrlhf.fleet.rpc.client import DEFAULT_CHUNK_BYTES, GeneratorClient, encode_weight_chunks
from jaxrlhf.fleet.transport.base import Outcome, TensorStream, WeightTransport, WeightUpdate

# Chunks queued ahead of each replica's stream. The feeds hold the same chunk objects, so the
# host holds at most this many chunks (plus one in the hands of each call, and the tensor being
# converted) whatever the number of replicas: the depth need not grow with them.
CHUNKS_AHEAD = 4


class _End:
    """Marks the end of a replica's chunk stream; carries the producer's error, if it failed."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class _ReplicaFeed:
    """The chunks on their way to one replica's UpdateWeights stream, a few at most.

    Once the replica's call has ended (it failed, or it answered early) the feed is closed: what
    is queued is dropped, later chunks are not queued, so a dead replica never blocks the
    producer, and so never the other replicas; and gRPC's request thread, if it waits for a
    chunk, is woken to end the stream (else it would wait forever: one thread lost per refused
    or timed-out update).
    """

    def __init__(self, depth: int) -> None:
        self._depth = depth
        self._items: collections.deque[bytes | _End] = collections.deque()
        self._changed = threading.Condition()
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: bytes | _End) -> None:
        """Queues `item` once there is room; drops it if the feed is (or gets) closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(self._items) < self._depth)
            if not self._closed:
                self._items.append(item)
                self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._items.clear()
            self._changed.notify_all()

    def _take(self) -> bytes | _End | None:
        """The next item, waiting for one; None once the feed is closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or self._items)
            if self._closed:
                return None
            item = self._items.popleft()
            self._changed.notify_all()
            return item

    def chunks(self) -> Iterator[bytes]:
        """The request stream (iterated by gRPC's thread); raises if the producer failed, which
        cancels the call; ends when the feed is closed."""
        while (item := self._take()) is not None:
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

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, num_senders: int = 0,
                 sender: int = 0) -> None:  # fmt: skip
        self.chunk_bytes = chunk_bytes
        # One of several streams of each update (`jaxrlhf.fleet.transport.senders`); 0: the
        # only one.
        self.num_senders, self.sender = num_senders, sender

    def send(self, clients, tensor_stream: TensorStream, update: WeightUpdate,
             timeout) -> dict[GeneratorClient, Outcome]:  # fmt: skip
        chunks = encode_weight_chunks(
            tensor_stream(),
            update.policy_version,
            self.chunk_bytes,
            num_tensors=update.num_tensors,
            allow_rollback=update.allow_rollback,
            num_senders=self.num_senders,
            sender=self.sender,
            update_id=update.update_id,
            lora=update.lora,
        )
        feeds = {client: _ReplicaFeed(CHUNKS_AHEAD) for client in clients}
        # A thread per replica, for this attempt only: every call must run at once, since the
        # producer feeds them in step (a call left waiting for a thread would let its feed
        # fill and stall the producer, and with it every running call, until their deadline).
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(clients)), thread_name_prefix="weight-call"
        ) as calls:
            futures = {}
            for client, feed in feeds.items():
                future = calls.submit(client.update_weights_encoded, feed.chunks(), timeout)
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
        """Nothing to release: each attempt's call threads end with it."""


def collect(futures: dict[GeneratorClient, concurrent.futures.Future]) -> dict:
    """Waits for each client's call; its result, or the gRPC error it raised."""
    outcomes = {}
    for client, future in futures.items():
        try:
            outcomes[client] = future.result()
        except grpc.RpcError as error:
            outcomes[client] = error
    return outcomes
