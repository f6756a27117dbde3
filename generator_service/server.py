"""The gRPC face of the generator: the Generator service, health, reflection, auth and shutdown.

Messages are translated here and nowhere else; the engine deals in plain Python values.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from generator_service.auth import TokenAuthInterceptor
from generator_service.engine import EngineConfig, GeneratorEngine
from generator_service.requests import GenerateError, Sampling
from generator_service.weights import WeightAssembler, WeightUpdateError
from jaxrlhf.rpc import SERVICE_NAME, generator_pb2, generator_pb2_grpc
from jaxrlhf.rpc.client import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)

READY_LINE = "GENERATOR_SERVICE_READY"
# Initial metadata of every Generate call, sent once the call is admitted between weight swaps.
ADMITTED_VERSION_HEADER = "x-jaxrlhf-policy-version"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    auth_token: str | None = None
    tls: grpc.ServerCredentials | None = None
    # Seconds that in-flight calls get to finish after SIGTERM.
    shutdown_grace: float = 10.0


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: GeneratorEngine, health_servicer: health.aio.HealthServicer):
        self._engine = engine
        self._health = health_servicer
        # One update at a time: each buffers a whole model, and versions must apply in order.
        self._update_lock = asyncio.Lock()

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
        )
        try:
            self._engine.validate(prompts, sampling)

            async def admitted(version: int) -> None:
                # Tells the client the call is in, and on which version, before any completion.
                await context.send_initial_metadata(((ADMITTED_VERSION_HEADER, str(version)),))

            async for sample in self._engine.generate(prompts, sampling, admitted):
                yield generator_pb2.Completion(
                    prompt_id=sample.prompt_id,
                    sample_index=sample.sample_index,
                    token_ids=sample.token_ids,
                    logprobs=sample.logprobs,
                    finish_reason=sample.finish_reason,
                    policy_version=sample.policy_version,
                    prompt_index=sample.prompt_index,
                )
        except GenerateError as error:
            await context.abort(error.code, error.message)

    async def UpdateWeights(self, request_iterator, context) -> generator_pb2.UpdateWeightsResponse:
        specs = self._engine.weight_specs
        if specs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, self._engine.weight_specs_error
            )
        async with self._update_lock:
            started = time.monotonic()
            assembler = WeightAssembler(specs, self._engine.policy_version)
            try:
                async for chunk in request_iterator:
                    assembler.add(
                        chunk.policy_version,
                        chunk.num_tensors,
                        chunk.name,
                        chunk.dtype,
                        chunk.shape,
                        chunk.offset,
                        chunk.data,
                        chunk.allow_rollback,
                    )
                tensors = assembler.finish()
                pause_seconds = await self._engine.swap_weights(
                    tensors, assembler.policy_version, assembler.allow_rollback
                )
            except WeightUpdateError as error:
                logger.warning("weight update refused: %s", error.message)
                await context.abort(error.code, error.message)
            finally:
                await self._publish_health()
        logger.info(
            "policy_version %d live: %d tensors, %d bytes, %.2fs (paused %.2fs)",
            assembler.policy_version,
            len(tensors),
            assembler.num_bytes,
            time.monotonic() - started,
            pause_seconds,
        )
        return generator_pb2.UpdateWeightsResponse(
            policy_version=assembler.policy_version,
            num_tensors=len(tensors),
            num_bytes=assembler.num_bytes,
            seconds=time.monotonic() - started,
            pause_seconds=pause_seconds,
        )

    async def GetStatus(self, request, context) -> generator_pb2.GeneratorStatus:
        engine = self._engine
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
            num_weight_tensors=len(engine.weight_specs or ()),
            vllm_version=engine.vllm_version,
            swap_pending=engine.swap_pending,
        )

    async def _publish_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._engine.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(engine_config: EngineConfig, options: ServerOptions) -> None:
    """Runs until SIGTERM/SIGINT, then drains calls for `shutdown_grace` seconds and exits."""
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

    engine = GeneratorEngine(engine_config)
    try:
        await engine.start()
        health_servicer = health.aio.HealthServicer()
        generator_pb2_grpc.add_GeneratorServicer_to_server(
            GeneratorServicer(engine, health_servicer), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
        )
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        logger.info(
            "serving %s on %s (%s, %s)",
            engine_config.model,
            _bind_address(options.host, port),
            "TLS" if options.tls else "plaintext",
            "token required" if options.auth_token else "no token",
        )
        print(f"{READY_LINE} {_bind_address(options.host, port)}", flush=True)
        await stop.wait()
        logger.info("shutting down: %.0fs grace for in-flight calls", options.shutdown_grace)
        await health_servicer.enter_graceful_shutdown()
        await server.stop(options.shutdown_grace)
    finally:
        engine.shutdown()
