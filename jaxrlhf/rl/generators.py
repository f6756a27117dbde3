"""The learner's side of the generator service: prompts spread over replicas, weights broadcast.

`publish_weights` converts the (possibly sharded) Flax parameters to the Hugging Face layout one
tensor at a time (`iter_hf_tensors`) and streams them in bounded chunks to every replica at once:
each tensor is pulled from the devices once and fanned out, so the host never holds a second
copy of the model. The conversion runs in a thread of its own, a few chunks ahead of the
sending, so that converting the next tensor overlaps with sending the last one.

When every replica runs on this host (`transport` "auto" or "shared"), the tensors are instead
converted once into a shared-memory file (`jaxrlhf.rpc.shared`) and every replica is sent only
where they lie (`UpdateWeightsShared`): no weight byte crosses a socket.

A replica whose stream breaks (it died, it refused the update) is dropped from the fan-out at
once and the others go on. Then the replicas that could not be reached are retried alone, with
exponential back-off; one that rejected the update (a bad tensor, a stale version) is not. The
error names every replica that failed and says which ones swapped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from jaxrlhf.rl.rollout import Sample
from jaxrlhf.rpc import generator_pb2
from jaxrlhf.rpc.client import DEFAULT_CHUNK_BYTES, GeneratorClient, encode_weight_chunks
from jaxrlhf.rpc.shared import SharedWeightsFile

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# "auto": a shared file when every replica is on this host (see `jaxrlhf.rpc.shared`), else
# streamed chunks; "stream" and "shared" force one (forcing "shared" fails where it cannot work).
TRANSPORTS = ("auto", "stream", "shared")
# Chunks queued ahead of each replica's stream: bounds the host memory of a broadcast to this
# many chunks per replica, plus the tensor being converted.
CHUNKS_AHEAD = 4


class GeneratorError(RuntimeError):
    """A generator replica failed; the message names the replica and the gRPC status."""


@dataclasses.dataclass
class PublishStats:
    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    attempts: int
    # The longest time a replica paused generation for the swap (its reload, repack and reset).
    pause_seconds: float = 0.0


def _describe(target: str, error: grpc.RpcError) -> str:
    return f"generator {target}: {error.code().name}: {error.details()}"


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


def _outcomes(
    futures: dict[GeneratorClient, concurrent.futures.Future],
) -> dict[GeneratorClient, Any]:
    """Waits for each client's call; its result, or the gRPC error it raised."""
    outcomes: dict[GeneratorClient, Any] = {}
    for client, future in futures.items():
        try:
            outcomes[client] = future.result()
        except grpc.RpcError as error:
            outcomes[client] = error
    return outcomes


def _is_local_target(target: str) -> bool:
    """Whether a gRPC target names this host: a Unix socket, localhost or a loopback address."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.split("///")[-1].removeprefix("ipv4:").removeprefix("ipv6:")
    if host.startswith("["):  # [::1]:port
        host = host[1 : host.find("]")]
    elif host.count(":") == 1:  # host:port (more colons: a bare IPv6 address)
        host = host.split(":")[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _shared_unavailable(clients: Sequence[GeneratorClient]) -> str:
    """Why the replicas cannot take shared-file updates from this process ("" if they can)."""
    remote = [c.target for c in clients if not _is_local_target(c.target)]
    if remote:
        return f"generators {', '.join(remote)} are not addressed on this host"
    folders = {c.target: c.status().shared_weights_dir for c in clients}
    if "" in folders.values():
        return f"generators {[t for t, f in folders.items() if not f]} take no shared updates"
    if len(set(folders.values())) > 1:
        return f"the generators map shared files from different folders: {folders}"
    folder = next(iter(folders.values()))
    if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        return f"the generators' shared folder {folder} is not writable here"
    return ""


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
        transport: str = "auto",
    ):
        if not targets:
            raise ValueError("at least one generator address is needed")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport must be one of {TRANSPORTS}, got {transport!r}")
        self.clients = [GeneratorClient(t, auth_token, root_certificates) for t in targets]
        self.retries = retries
        self.backoff_seconds = backoff_seconds
        self.chunk_bytes = chunk_bytes
        self.transport = transport
        self._shared: SharedWeightsFile | None = None
        self._shared_dir: str | None = None  # decided at the first publish with specs
        # A thread per replica for Generate calls, another for UpdateWeights (concurrent).
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
        specs: Sequence[tuple[str, tuple[int, ...], Any]] | None = None,
    ) -> PublishStats:
        """Sends one stream of tensors to every replica as `policy_version`; returns once every
        replica has swapped, or raises GeneratorError naming each replica that did not.

        `tensor_stream()` is called once per attempt of a streamed update (a retry converts the
        tensors again). `specs` ([(name, shape, dtype)] of the stream, in order) allows the
        same-host shared-file path (`transport`): the tensors are converted once into the file,
        and only their positions are sent. `allow_rollback`: replicas accept a version not
        newer than theirs (resuming a run)."""
        started = time.perf_counter()
        shared = specs is not None and self._use_shared()
        if shared:
            if self._shared is None or self._shared.specs != [
                (n, tuple(sh), np.dtype(dt)) for n, sh, dt in specs
            ]:
                if self._shared is not None:
                    self._shared.close()
                self._shared = SharedWeightsFile(self._shared_dir, specs)
            self._shared.write(tensor_stream())
            request = self._shared.request(policy_version, allow_rollback)
        responses: dict[str, generator_pb2.UpdateWeightsResponse] = {}
        failures: dict[str, grpc.RpcError] = {}
        pending = list(self.clients)
        delay = self.backoff_seconds
        for attempt in range(1, self.retries + 2):
            if shared:
                outcomes = self._call_each(pending, lambda c: c.update_weights_shared(request))
            else:
                outcomes = self._broadcast(
                    pending, tensor_stream, num_tensors, policy_version, allow_rollback
                )
            pending = []
            for client, outcome in outcomes.items():
                if isinstance(outcome, grpc.RpcError):
                    failures[client.target] = outcome
                    if outcome.code() in RETRYABLE:
                        pending.append(client)
                else:
                    responses[client.target] = outcome
                    failures.pop(client.target, None)
            if not pending or attempt > self.retries:
                break
            time.sleep(delay)
            delay = min(delay * 2, 30.0)
        if failures:
            swapped = f"; swapped: {', '.join(responses)}" if responses else "; none swapped"
            raise GeneratorError(
                f"weight update {policy_version} failed on {len(failures)} of "
                f"{len(self.clients)} generators after {attempt} attempt(s): "
                + "; ".join(_describe(target, error) for target, error in failures.items())
                + swapped
            )
        first = next(iter(responses.values()))
        return PublishStats(
            policy_version=policy_version,
            num_tensors=num_tensors,
            num_bytes=int(first.num_bytes),
            seconds=time.perf_counter() - started,
            attempts=attempt,
            pause_seconds=max(r.pause_seconds for r in responses.values()),
        )

    def _use_shared(self) -> bool:
        """Whether updates go through a shared file: `transport` "shared", or "auto" when every
        replica runs on this host and shares one folder that this process can write to."""
        if self.transport == "stream":
            return False
        if self._shared_dir is None:
            try:
                reason = _shared_unavailable(self.clients)
                folder = "" if reason else self.clients[0].status().shared_weights_dir
            except grpc.RpcError as error:  # undecided: stream this time (it retries), ask again
                if self.transport == "shared":
                    message = f"cannot set up the shared weight file: {error}"
                    raise GeneratorError(message) from error
                return False
            if reason and self.transport == "shared":
                raise GeneratorError(f"weight transport 'shared' is not possible: {reason}")
            self._shared_dir = folder
        return bool(self._shared_dir)

    def _call_each(
        self, clients: Iterable[GeneratorClient], call: Callable[[GeneratorClient], Any]
    ) -> dict[GeneratorClient, Any]:
        """`call(client)` for every client at once; each one's result or gRPC error."""
        return _outcomes({client: self._pool.submit(call, client) for client in clients})

    def _broadcast(
        self,
        clients: Iterable[GeneratorClient],
        tensor_stream: Callable[[], Iterator[tuple[str, Any]]],
        num_tensors: int,
        policy_version: int,
        allow_rollback: bool,
    ) -> dict[GeneratorClient, generator_pb2.UpdateWeightsResponse | grpc.RpcError]:
        """One UpdateWeights call per client, all fed from one conversion of the tensors (in a
        producer thread); returns each call's response or error. Re-raises the producer's error
        (the conversion failed) once every call has ended."""
        chunks = encode_weight_chunks(
            tensor_stream(), policy_version, self.chunk_bytes, num_tensors, allow_rollback
        )
        feeds = {client: _ReplicaFeed(CHUNKS_AHEAD) for client in clients}
        futures = {}
        for client, feed in feeds.items():
            future = self._pool.submit(client.update_weights_encoded, feed.chunks())
            future.add_done_callback(lambda _, feed=feed: feed.close())
            futures[client] = future
        # A thread of its own, not the pool's: the calls above wait for it.
        produced: list[BaseException | None] = []
        producer = threading.Thread(
            target=lambda: produced.append(_produce(chunks, list(feeds.values()))),
            name="weight-producer",
            daemon=True,
        )
        producer.start()
        outcomes = _outcomes(futures)
        producer.join()
        if produced[0] is not None:
            raise produced[0]
        return outcomes

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()
