"""The gRPC face of the generator: the Generator service, health, reflection, auth and shutdown.

Messages are translated here and nowhere else; the engine and the update paths deal in plain
Python values. Weight chunks are decoded by hand (`jaxrlhf_wire.chunks.decode_weight_chunk`) so
that their data stays a view of the received message, written to the update file without
another copy (updates/receive_stream.py). The wire contract (stubs, chunk format, loopback rule,
readiness line) comes from `jaxrlhf_wire`; this package never imports the learner's `jaxrlhf`.

| call | handled by |
|---|---|
| Generate | the engine (engine.py, calls.py) |
| UpdateWeights | updates/receive_stream.py (senders joined: updates/join.py), updates/apply.py |
| UpdateWeightsShared | updates/receive_shared.py, then updates/apply.py |
| GetStatus | the engine's records (status.py) and the last update's (updates/apply.py) |
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from generator_service import failpoints
from generator_service.auth import TokenAuthInterceptor
from generator_service.engine import GeneratorEngine
from generator_service.engine_config import EngineConfig
from generator_service.memory import keep_freed_memory
from generator_service.requests import GenerateError, Sampling
from generator_service.updates.adapter import LoraSettings
from generator_service.updates.apply import Applied, UpdateApplier
from generator_service.updates.receive_shared import SharedFile, SharedUpdates
from generator_service.updates.receive_stream import StreamedUpdates
from generator_service.updates.tensors import WeightUpdateError
from jaxrlhf_wire import ADMITTED_VERSION_HEADER, READY_LINE
from jaxrlhf_wire.chunks import CHANNEL_OPTIONS, MalformedChunkError, decode_weight_chunk
from jaxrlhf_wire.hosts import is_local_peer
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2, generator_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    auth_token: str | None = None
    tls: grpc.ServerCredentials | None = None
    # Seconds that in-flight calls get to finish after SIGTERM.
    shutdown_grace: float = 10.0
    # Seconds an update from several senders waits for all of them (generator_service.updates.join).
    senders_timeout: float = 60.0


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: GeneratorEngine, health_servicer: health.aio.HealthServicer,
                 senders_timeout: float = 60.0):  # fmt: skip
        self._engine = engine
        # One update at a time: they share the update file, and versions apply in order.
        self._applier = UpdateApplier(engine, health_servicer, asyncio.Lock())
        self._streams = StreamedUpdates(self._applier, senders_timeout)
        self._shared = SharedUpdates(self._applier, senders_timeout)

    async def Generate(self, request: generator_pb2.GenerateRequest, context):
        prompts = [(prompt.id, list(prompt.token_ids)) for prompt in request.prompts]
        options = request.sampling
        sampling = Sampling(
            n=options.n,
            temperature=options.temperature,
            top_p=options.top_p or 1.0,
            top_k=options.top_k,
            max_tokens=options.max_tokens,
            stop_token_ids=tuple(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
            min_tokens=options.min_tokens,
            seed=request.seed if request.HasField("seed") else None,
            seed_per_request=request.seed_per_request,
            max_running=request.max_running,
            prompt_max_tokens=(
                tuple(p.max_tokens for p in request.prompts)
                if any(p.max_tokens for p in request.prompts)
                else ()
            ),
        )
        try:
            self._engine.validate(prompts, sampling)

            async def admitted(version: int) -> None:
                # Tells the client the call is in, and on which version, before any completion.
                await context.send_initial_metadata(((ADMITTED_VERSION_HEADER, str(version)),))

            async for sample in self._engine.generate(prompts, sampling, admitted):
                failpoints.hit("generate_completion")  # (chaos tests only)
                yield generator_pb2.Completion(
                    prompt_id=sample.prompt_id,
                    sample_index=sample.sample_index,
                    token_ids=sample.token_ids,
                    logprobs=sample.logprobs,
                    finish_reason=sample.finish_reason,
                    policy_version=sample.policy_version,
                    prompt_index=sample.prompt_index,
                    token_policy_versions=sample.token_policy_versions,
                    submitted_unix_time=sample.submitted_unix_time,
                    finished_unix_time=sample.finished_unix_time,
                )
        except GenerateError as error:
            await context.abort(error.code, error.message)

    async def UpdateWeights(self, request_iterator, context) -> generator_pb2.UpdateWeightsResponse:
        """Receives a stream of `ReceivedChunk`s (see `add_generator_service`): the whole update,
        or one sender's part of it (updates/receive_stream.py)."""
        if self._engine.weight_specs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, self._engine.weight_specs_error
            )
        try:
            return _response(await self._streams.receive(request_iterator))
        except MalformedChunkError as error:
            logger.warning("weight update refused: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except WeightUpdateError as error:
            logger.warning("weight update refused: %s", error.message)
            await context.abort(error.code, error.message)

    async def UpdateWeightsShared(
        self, request: generator_pb2.SharedWeights, context
    ) -> generator_pb2.UpdateWeightsResponse:
        """Swaps in an update the learner wrote into a file of the shared folder, from this host
        only (updates/receive_shared.py): the model's weights, or in "lora" mode an adapter
        (`lora` set)."""
        if self._engine.weight_specs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, self._engine.weight_specs_error
            )
        if not is_local_peer(context.peer()):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"UpdateWeightsShared is only accepted from this host, not from {context.peer()}; "
                "stream the weights with UpdateWeights",
            )
        shared = SharedFile(
            path=request.path,
            tensors=[(t.name, t.dtype, tuple(t.shape), t.position) for t in request.tensors],
            policy_version=request.policy_version,
            allow_rollback=request.allow_rollback,
            progressive=request.progressive,
            update_id=request.update_id,
            lora=LoraSettings.of(request.lora) if request.HasField("lora") else None,
        )
        try:
            return _response(await self._shared.apply(shared))
        except WeightUpdateError as error:
            await context.abort(error.code, error.message)

    def close(self) -> None:
        """Deletes the update file; call once the server has stopped."""
        self._streams.close()

    async def GetStatus(self, request, context) -> generator_pb2.GeneratorStatus:
        engine, applier = self._engine, self._applier
        (idle_seconds, request_seconds), uptime_seconds = (engine.occupancy.totals(),
                                                           engine.occupancy.seconds)  # fmt: skip
        return generator_pb2.GeneratorStatus(
            model=engine.config.model,
            policy_version=engine.policy_version,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            dtype=engine.dtype,
            num_requests_running=engine.num_requests_running,
            num_calls_waiting=engine.num_calls_waiting,
            last_update_unix_time=engine.last_update_unix_time,
            num_updates=engine.num_updates,
            serving=engine.serving,
            num_weight_tensors=0 if engine.config.lora else len(engine.weight_specs or ()),
            vllm_version=engine.vllm_version,
            swap_pending=engine.swap_pending,
            shared_weights_dir=engine.update_dir if engine.weight_specs is not None else "",
            swap_mode=engine.config.swap_mode,
            in_flight_kv=engine.config.in_flight_kv if engine.in_flight else "",
            idle_seconds=idle_seconds,
            request_seconds=request_seconds,
            uptime_seconds=uptime_seconds,
            max_num_seqs=engine.max_num_seqs,
            occupancy=engine.occupancy.fraction(),
            preload_seconds=applier.last_swap.preload_seconds,
            pause_seconds=applier.last_swap.pause_seconds,
            preload_tokens=applier.last_swap.preload_tokens,
            preloaded_swaps=engine.preloads,
            preloaded_swaps_off=_preload_off(engine),
            shared_progress=True,
            update_id=engine.update_id,
            max_lora_rank=engine.config.max_lora_rank,
            max_loras=engine.config.max_loras if engine.config.lora else 0,
            adapter_versions=engine.adapter_versions,
        )


def _preload_off(engine: GeneratorEngine) -> str:
    """Why the engine's updates are not preloaded ("" when they are)."""
    if engine.config.lora:
        return "LoRA mode: adapters are loaded by vLLM (add_lora), with no pause"
    if engine.preload_unsupported:
        return engine.preload_unsupported
    return "" if engine.config.preload else "started with --no-preload"


def _response(applied: Applied) -> generator_pb2.UpdateWeightsResponse:
    return generator_pb2.UpdateWeightsResponse(
        policy_version=applied.policy_version,
        num_tensors=applied.num_tensors,
        num_bytes=applied.num_bytes,
        seconds=applied.seconds,
        pause_seconds=applied.swap.pause_seconds,
        preload_seconds=applied.swap.preload_seconds,
        preload_tokens=applied.swap.preload_tokens,
    )


@dataclass(frozen=True)
class UndecodableRequest:
    """Request bytes that are not the method's message (see `_lenient`)."""

    message_type: str
    error: str


def _lenient(message_class):
    """A deserializer that hands undecodable bytes to the handler as an UndecodableRequest:
    raising, it would make gRPC answer UNKNOWN ("Unexpected DecodeError"), not the client's
    error."""

    def deserialize(raw: bytes):
        try:
            return message_class.FromString(raw)
        except DecodeError as error:
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, str(error))

    return deserialize


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, UndecodableRequest):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the request is not a valid {request.message_type}: {request.error}",
        )


def _checked_unary(behavior):
    """`behavior` behind the INVALID_ARGUMENT answer to undecodable requests."""

    async def handle(request, context):
        await _refuse_undecodable(request, context)
        return await behavior(request, context)

    return handle


def _checked_unary_stream(behavior):
    async def handle(request, context):
        await _refuse_undecodable(request, context)
        async for response in behavior(request, context):
            yield response

    return handle


def add_generator_service(servicer: GeneratorServicer, server: grpc.aio.Server) -> None:
    """Registers the Generator service, as the generated `add_GeneratorServicer_to_server` does,
    but with UpdateWeights' requests decoded by `decode_weight_chunk` and every undecodable
    request answered INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _checked_unary_stream(servicer.Generate),
            request_deserializer=_lenient(generator_pb2.GenerateRequest),
            response_serializer=generator_pb2.Completion.SerializeToString,
        ),
        "UpdateWeights": grpc.stream_unary_rpc_method_handler(
            servicer.UpdateWeights,
            request_deserializer=decode_weight_chunk,
            response_serializer=generator_pb2.UpdateWeightsResponse.SerializeToString,
        ),
        "UpdateWeightsShared": grpc.unary_unary_rpc_method_handler(
            _checked_unary(servicer.UpdateWeightsShared),
            request_deserializer=_lenient(generator_pb2.SharedWeights),
            response_serializer=generator_pb2.UpdateWeightsResponse.SerializeToString,
        ),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            _checked_unary(servicer.GetStatus),
            request_deserializer=_lenient(generator_pb2.GetStatusRequest),
            response_serializer=generator_pb2.GeneratorStatus.SerializeToString,
        ),
    }
    methods = generator_pb2.DESCRIPTOR.services_by_name["Generator"].methods_by_name
    if set(handlers) != set(methods):
        raise RuntimeError(
            f"the server handles {sorted(handlers)} but the .proto defines {sorted(methods)}"
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EngineDiedError(RuntimeError):
    """vLLM's engine died under a running server."""


async def _watch_engine(engine: GeneratorEngine, stop: asyncio.Event, every: float = 1.0) -> None:
    """Sets `stop` when the engine dies: a server whose engine is gone answers every call with
    an error, so it leaves (exit 1) for its supervisor (or the learner) to restart it."""
    while not stop.is_set():
        if engine.dead:
            stop.set()
            return
        await asyncio.sleep(every)


async def serve(engine_config: EngineConfig, options: ServerOptions) -> None:
    """Runs until SIGTERM/SIGINT, then drains calls for `shutdown_grace` seconds and exits; raises
    `EngineDiedError` at once if vLLM's engine dies under it."""
    keep_freed_memory(trim_bytes=256 << 20)
    interceptors = [TokenAuthInterceptor(options.auth_token)] if options.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=list(CHANNEL_OPTIONS))
    address = _bind_address(options.host, options.port)
    # Bind before the slow engine start, so a taken port fails at once.
    if options.tls is not None:
        port = server.add_secure_port(address, options.tls)
    else:
        port = server.add_insecure_port(address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # Before the engine's processes exist: whatever happens to this process, they die with it.
    subprocess.Popen([sys.executable, "-m", "generator_service.reaper", str(os.getpid())])
    engine = GeneratorEngine(engine_config)
    servicer = None
    try:
        await engine.start()
        health_servicer = health.aio.HealthServicer()
        servicer = GeneratorServicer(engine, health_servicer, options.senders_timeout)
        add_generator_service(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        logger.info(
            "serving %s on %s (%s, %s, swaps: %s)",
            engine_config.model,
            _bind_address(options.host, port),
            "TLS" if options.tls else "plaintext",
            "token required" if options.auth_token else "no token",
            engine_config.swap_mode
            + (f", KV {engine_config.in_flight_kv}" if engine.in_flight else ""),
        )
        print(f"{READY_LINE} {_bind_address(options.host, port)}", flush=True)
        watchdog = asyncio.create_task(_watch_engine(engine, stop))
        await stop.wait()
        if engine.dead:  # no call can succeed any more: exit, so that it can be restarted
            logger.error("the vLLM engine died (see above); the service exits")
            await health_servicer.enter_graceful_shutdown()
            await server.stop(0)
            raise EngineDiedError(
                "the vLLM engine died while serving (a worker or the engine core was killed, "
                "e.g. by the kernel's OOM killer; see the log above)"
            )
        watchdog.cancel()
        logger.info("shutting down: %.0fs grace for in-flight calls", options.shutdown_grace)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(options.shutdown_grace)
    finally:
        if servicer is not None:
            servicer.close()
        engine.shutdown()
