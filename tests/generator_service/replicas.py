"""Stand-in generator replicas for fan-out tests, beside the suite's one real (vLLM) server.

A second vLLM engine would cost the suite another engine start and both cores, so:

- `RecordingReplica` runs the real service code (`add_generator_service`, `GeneratorServicer`:
  decoding, validation, preloading) in this process, on an engine stand-in that records the
  preloaded tensors instead of loading them into vLLM.
- `DyingReplica` is a separate process that accepts an UpdateWeights stream and SIGKILLs itself
  after a few chunks: a replica that dies mid-stream, connection and all.
- `FakeGenerator` answers Generate and GetStatus without a model, in this process: replicas of
  a chosen version, and replicas that die after sending part of a call's completions.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from generator_service.status import Occupancy, SwapTimes
from generator_service.updates.tensors import WeightUpdateError

REPO_ROOT = Path(__file__).resolve().parents[2]


class RecordingEngine:
    """What `GeneratorServicer.UpdateWeights` and `GetStatus` need of an engine; swaps record
    the preloaded bytes. `fail_swaps` > 0: that many next swaps fail half-way as the engine's do
    (INTERNAL, and NOT_SERVING until a complete update succeeds). A swap passes the engine's
    `reload_weights` failpoint (`generator_service.failpoints`) as the real one does, after it
    loaded the weights and before it labels them: a `sleep=S` hold there holds the swap
    (`swapping` is set meanwhile)."""

    def __init__(self, specs) -> None:
        self.weight_specs = specs
        self.weight_specs_error = ""
        self.policy_version = 0
        self.serving = True
        self._update_id = ""
        self.fail_swaps = 0
        self.update_dir = tempfile.gettempdir()
        self.swaps: list[tuple[int, dict[str, tuple[str, bytes]]]] = []
        # GetStatus's fields (a drain-mode replica that generates nothing):
        self.config = types.SimpleNamespace(
            model="recording", swap_mode="drain", in_flight_kv="", preload=False, lora=False,
            max_lora_rank=0, max_loras=0,
        )  # fmt: skip
        self.adapter_versions: list[int] = []
        self.preload_unsupported = ""
        self.preloads = False  # (streams are not preloaded as they arrive)
        self.in_flight = self.swap_pending = False
        self.max_model_len, self.vocab_size, self.dtype, self.vllm_version = 0, 0, "", ""
        self.num_requests_running = self.num_calls_waiting = self.num_updates = 0
        self.last_update_unix_time = 0.0
        self.max_num_seqs = 1
        self.occupancy = Occupancy(self.max_num_seqs)
        self.swapping = threading.Event()

    @property
    def update_id(self) -> str:  # as the engine's: set with the version, cleared if unknown
        return self._update_id if self.serving else ""

    def update_specs(self, lora):
        from generator_service.updates.adapter import update_specs

        return update_specs(self.weight_specs, lora, 0)  # a full-weights server

    async def swap_weights(self, update_path, tensors, policy_version, allow_rollback=False,
                           preload_id=0, update_id="", lora=None):  # fmt: skip
        from generator_service import failpoints
        from generator_service.updates.swap import finish_despite_cancellation

        hold = failpoints.hit("reload_weights")
        if hold is None or not hold.startswith("sleep="):
            return self._swap(update_path, tensors, policy_version, update_id)

        async def held():
            self.swapping.set()
            await asyncio.sleep(float(hold.removeprefix("sleep=")))
            return self._swap(update_path, tensors, policy_version, update_id)

        # As the engine's: in its pause a swap runs to its end, its caller gone or not.
        return await finish_despite_cancellation(asyncio.ensure_future(held()))

    def _swap(self, update_path, tensors, policy_version, update_id):
        if self.fail_swaps > 0:
            self.fail_swaps -= 1
            self.serving = False
            raise WeightUpdateError(grpc.StatusCode.INTERNAL, "the swap failed half-way")
        self.serving = True
        with open(update_path, "rb") as file:
            data = file.read()
        received = {
            t.name: (t.wire_dtype, data[t.position : t.position + t.nbytes]) for t in tensors
        }
        self.swaps.append((policy_version, received))
        self.policy_version, self._update_id = policy_version, update_id
        return SwapTimes()


class RecordingReplica:
    """The service's gRPC code on a `RecordingEngine`, served from a thread of this process;
    `senders_timeout`: the server's --senders-timeout."""

    def __init__(self, specs, senders_timeout: float = 60.0) -> None:
        from grpc_health.v1 import health

        from generator_service.server import GeneratorServicer, add_generator_service
        from jaxrlhf_wire.chunks import CHANNEL_OPTIONS

        self.engine = RecordingEngine(specs)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def start():
            server = grpc.aio.server(options=list(CHANNEL_OPTIONS))
            servicer = GeneratorServicer(self.engine, health.aio.HealthServicer(),
                                         senders_timeout)  # fmt: skip
            add_generator_service(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self._server, port = self._run(start())
        self.address = f"127.0.0.1:{port}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=60)

    def received(self, policy_version: int) -> dict[str, tuple[str, bytes]]:
        """{name: (wire dtype, bytes)} of the update swapped in as `policy_version`."""
        (received,) = [
            tensors for version, tensors in self.engine.swaps if version == policy_version
        ]
        return received

    def stop(self) -> None:
        self._run(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)


class DyingReplica:
    """A process that takes UpdateWeights streams and kills itself (SIGKILL) at chunk `after`."""

    def __init__(self, after: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.generator_service.replicas", "--die-after", str(after)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        port = self.process.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"the dying replica did not start ({self.process.wait()})")
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(timeout=30)


class FakeGenerator:
    """Generate, GetStatus and UpdateWeights without a model, served from this process (pool
    tests).

    Sample k of a prompt is the prompt's tokens + [k], its log-probs all `tag` (which replica
    answered) and its version `version`. Completions go out sample-major (sample 0 of every
    prompt, then sample 1, ...), so that a replica dying part-way leaves prompts with only some
    of their samples sent. `die_after=m`: after its m-th completion (over all calls) the replica
    is dead: the call ends UNAVAILABLE, as does every later call, GetStatus included.
    `capacity`: the max_num_seqs it reports. `hold(token_ids)`: called with each call's first
    prompt before it answers (a test blocks it there); `requests` keeps every GenerateRequest,
    `max_running` the most calls it answered at once, `max_sequences` the most samples it owed
    at once (a sample is owed from its call's start until it is sent).

    `finish_after(token_ids, k)`: seconds after its call's start at which sample k of the prompt
    finishes (an engine's sequences of different lengths): each goes out then, so a call's
    samples come back in the order they finish. `linger(token_ids)`: called once every
    completion of a call was sent, before the call ends. `sequence_seconds` integrates the
    samples owed, at most `capacity` of them (what an engine of that capacity would be
    generating), over time; `call_starts` keeps each call's start (`time.monotonic`).

    UpdateWeights takes any stream of chunks: the first chunk's policy_version becomes the
    served version (refused FAILED_PRECONDITION unless newer, or allow_rollback), and its
    update_id the one GetStatus reports; `updates` counts the updates taken.
    """

    def __init__(
        self, version: int = 0, tag: float = 0.0, die_after: int | None = None,
        capacity: int = 0, hold=None, workers: int = 4, finish_after=None, linger=None,
    ) -> None:  # fmt: skip
        from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2

        self.version, self.tag, self.die_after = version, tag, die_after
        self.capacity, self.hold = capacity, hold
        self.finish_after, self.linger = finish_after, linger
        self.update_id, self.updates = "", 0
        self.model = ""  # what GetStatus says it serves
        self.sequence_seconds, self._since = 0.0, time.monotonic()
        self.call_starts: list[float] = []
        self.dead = False
        self.calls: list[list[str]] = []  # the prompt ids of each Generate call
        self.requests: list = []
        self.running = self.max_running = 0
        self.sequences = self.max_sequences = 0
        self._lock = threading.Lock()
        self._sent = 0
        pb = generator_pb2
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate,
                request_deserializer=pb.GenerateRequest.FromString,
                response_serializer=pb.Completion.SerializeToString,
            ),
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                self._status,
                request_deserializer=pb.GetStatusRequest.FromString,
                response_serializer=pb.GeneratorStatus.SerializeToString,
            ),
            "UpdateWeights": grpc.stream_unary_rpc_method_handler(
                self._update_weights,
                request_deserializer=pb.WeightChunk.FromString,
                response_serializer=pb.UpdateWeightsResponse.SerializeToString,
            ),
        }
        self._server = grpc.server(ThreadPoolExecutor(max_workers=workers))
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def _alive(self, context) -> None:
        if self.dead:
            context.abort(grpc.StatusCode.UNAVAILABLE, "this replica is dead")

    def _status(self, request, context):
        from jaxrlhf_wire.stubs import generator_pb2

        self._alive(context)
        return generator_pb2.GeneratorStatus(policy_version=self.version, serving=True,
                                              max_num_seqs=self.capacity,
                                              update_id=self.update_id,
                                              model=self.model)  # fmt: skip

    def _update_weights(self, chunks, context):
        from jaxrlhf_wire.stubs import generator_pb2

        self._alive(context)
        first = None
        for chunk in chunks:
            first = first or chunk
        if first is None:
            context.abort(grpc.StatusCode.DATA_LOSS, "no chunk")
        if first.policy_version <= self.version and not first.allow_rollback:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"policy_version {first.policy_version} is not newer than the served "
                          f"version {self.version}")  # fmt: skip
        self.version, self.update_id = first.policy_version, first.update_id
        self.updates += 1
        return generator_pb2.UpdateWeightsResponse(policy_version=self.version,
                                                    num_tensors=first.num_tensors)  # fmt: skip

    def _owe(self, count: int) -> None:
        """`count` more samples owed from now (negative: sent); integrates what was owed."""
        with self._lock:
            now = time.monotonic()
            generating = min(self.sequences, self.capacity) if self.capacity else self.sequences
            self.sequence_seconds += generating * (now - self._since)
            self._since = now
            self.sequences += count
            self.max_sequences = max(self.max_sequences, self.sequences)

    def _generate(self, request, context):
        from jaxrlhf_wire import ADMITTED_VERSION_HEADER

        self._alive(context)
        owed = (request.sampling.n or 1) * len(request.prompts)
        with self._lock:
            self.calls.append([prompt.id for prompt in request.prompts])
            self.requests.append(request)
            self.call_starts.append(time.monotonic())
            self.running += 1
            self.max_running = max(self.max_running, self.running)
        self._owe(owed)
        try:
            version = self.version
            context.send_initial_metadata(((ADMITTED_VERSION_HEADER, str(version)),))
            if self.hold is not None:
                self.hold(tuple(request.prompts[0].token_ids))
            for completion in self._completions(request, context, version):
                self._owe(-1)
                owed -= 1
                yield completion
            if self.linger is not None:
                self.linger(tuple(request.prompts[0].token_ids))
        finally:
            with self._lock:
                self.running -= 1
            self._owe(-owed)

    def _completions(self, request, context, version: int):
        from jaxrlhf_wire.stubs import generator_pb2

        order = [(k, index) for k in range(request.sampling.n or 1)
                 for index in range(len(request.prompts))]  # fmt: skip
        started = time.monotonic()
        if self.finish_after is not None:
            due = {(k, i): self.finish_after(tuple(request.prompts[i].token_ids), k)
                   for k, i in order}  # fmt: skip
            order.sort(key=due.get)
        for k, index in order:
            prompt = request.prompts[index]
            if self.finish_after is not None:
                time.sleep(max(0.0, started + due[k, index] - time.monotonic()))
            if self.die_after is not None and self._sent >= self.die_after:
                self.dead = True
                context.abort(grpc.StatusCode.UNAVAILABLE, "the replica died mid-call")
            self._sent += 1
            tokens = [*prompt.token_ids, k]
            yield generator_pb2.Completion(
                prompt_id=prompt.id,
                prompt_index=index,
                sample_index=k,
                token_ids=tokens,
                logprobs=[self.tag] * len(tokens),
                finish_reason="length",
                policy_version=version,
                token_policy_versions=[version] * len(tokens),
            )

    def stop(self) -> None:
        self._server.stop(0).wait()


def _serve_until_chunk(after: int) -> None:
    from jaxrlhf_wire.chunks import CHANNEL_OPTIONS
    from jaxrlhf_wire.stubs import SERVICE_NAME

    def update_weights(request_iterator, context):
        for count, _ in enumerate(request_iterator, start=1):
            if count == after:
                os.kill(os.getpid(), signal.SIGKILL)
        context.abort(grpc.StatusCode.INTERNAL, "the stream ended before this replica died")

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"UpdateWeights": grpc.stream_unary_rpc_method_handler(update_weights)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=list(CHANNEL_OPTIONS))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--die-after", type=int, required=True)
    _serve_until_chunk(parser.parse_args().die_after)
