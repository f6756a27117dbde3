"""The gRPC face of the generator: the Generator service, health, reflection, auth and shutdown.

Messages are translated here and nowhere else; the engine deals in plain Python values. Weight
chunks are decoded by hand (`jaxrlhf_wire.chunks.decode_weight_chunk`) so that their data stays
a view of the received message, written to the staging file without another copy. The wire
contract (stubs, chunk format, loopback rule, readiness line) comes from `jaxrlhf_wire`; this
package never imports the learner's `jaxrlhf`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from generator_service import failpoints
from generator_service.assembler import WeightAssembler
from generator_service.auth import TokenAuthInterceptor
from generator_service.engine import GeneratorEngine
from generator_service.engine_config import EngineConfig
from generator_service.feeder import StageFeeder, write_and_feed
from generator_service.memory import keep_freed_memory
from generator_service.requests import GenerateError, Sampling
from generator_service.staging_file import StagingFile, minimum_update_bytes
from generator_service.status import SwapTimes
from generator_service.swaps import finish_despite_cancellation
from generator_service.updates import Update, UpdateJoiner
from generator_service.weights import (
    WeightUpdateError,
    check_progress_page,
    check_shared_layout,
    shared_file_path,
    shared_file_size,
)
from jaxrlhf_wire import ADMITTED_VERSION_HEADER, READY_LINE
from jaxrlhf_wire.chunks import CHANNEL_OPTIONS, MalformedChunkError, decode_weight_chunk
from jaxrlhf_wire.files import PROGRESS_ABANDONED, read_progress_count
from jaxrlhf_wire.hosts import is_local_peer
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2, generator_pb2_grpc

logger = logging.getLogger(__name__)

# How often a progressive shared update's count is read: from 1 ms, doubling to 20 ms while
# it stands still.
PROGRESS_POLL_SECONDS = (0.001, 0.02)


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051
    auth_token: str | None = None
    tls: grpc.ServerCredentials | None = None
    # Seconds that in-flight calls get to finish after SIGTERM.
    shutdown_grace: float = 10.0
    # Seconds an update from several senders waits for all of them (generator_service.updates).
    senders_timeout: float = 60.0


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, engine: GeneratorEngine, health_servicer: health.aio.HealthServicer,
                 senders_timeout: float = 60.0):  # fmt: skip
        self._engine = engine
        self._health = health_servicer
        # One update at a time: they share the staging file, and versions apply in order.
        self._update_lock = asyncio.Lock()
        # The streams of an update sent by several learner processes, joined into one.
        self._updates = UpdateJoiner(self._update_lock, senders_timeout, self._prepare,
                                     self._release)  # fmt: skip
        # The last successful update's (stage, pause) seconds, for GetStatus.
        self.last_swap = SwapTimes()
        # The update_id of the update that put the served weights in place (`_swap_in`).
        self._served_update_id = ""
        self._staging: StagingFile | None = None  # created by the first update

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
        or one sender's part of it (`generator_service.updates`)."""
        if self._engine.weight_specs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, self._engine.weight_specs_error
            )
        chunks = request_iterator.__aiter__()
        try:
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                raise WeightUpdateError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the weight stream was empty"
                ) from None
            update, sender = self._updates.join(first.header)
            return await self._receive(update, sender, first, chunks)
        except MalformedChunkError as error:
            logger.warning("weight update refused: %s", error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except WeightUpdateError as error:
            logger.warning("weight update refused: %s", error.message)
            await context.abort(error.code, error.message)

    async def _receive(self, update: Update, sender: int, chunk, chunks):
        """One sender's stream into `update`; the update's answer (module `updates`)."""
        swapping, updates_before = False, self._engine.num_updates
        try:
            await update.wait_ready()
            while chunk is not None:
                if (error := update.error()) is not None:
                    raise error
                header = chunk.header
                if header.sender != sender:
                    raise WeightUpdateError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"a chunk of sender {sender}'s stream says sender {header.sender}",
                    )
                pieces = update.assembler.add(
                    header.policy_version,
                    header.num_tensors,
                    header.name,
                    header.dtype,
                    header.shape,
                    header.offset,
                    chunk.data,
                    header.allow_rollback,
                    header.slice_start,
                    header.slice_shape,
                    header.num_senders,
                    update_id=header.update_id,
                )
                await write_and_feed(update.assembler, update.staging, pieces, update.feeder)
                chunk = await anext(chunks, None)
            if (error := update.error()) is not None:  # refused while this stream was ending
                raise error  # (its lock is released: it must never be swapped in)
            update.finished.add(sender)
            if not update.all_finished:
                return await asyncio.shield(update.result)
            swapping, updates_before = True, self._engine.num_updates
            response = await self._swap(update)
            update.succeed(response)
            return response
        except MalformedChunkError as error:
            update.fail(WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
            raise update.error() from None
        except WeightUpdateError as error:
            update.fail(error)
            raise update.error() from None
        except asyncio.CancelledError:
            if swapping and self._engine.num_updates > updates_before:
                # Cancelled in the pause, which the swap finished: the update is live, and the
                # other senders are told so (this call's timings are lost with it).
                update.succeed(generator_pb2.UpdateWeightsResponse(
                    policy_version=update.key.policy_version,
                    num_tensors=update.key.num_tensors,
                    num_bytes=update.assembler.num_bytes,
                    seconds=time.monotonic() - update.started,
                ))  # fmt: skip
            elif swapping or not update.all_finished:
                update.fail(WeightUpdateError(
                    grpc.StatusCode.ABORTED,
                    f"sender {sender}'s call was cancelled before the update was swapped "
                    "in (GetStatus tells which version serves)",
                ))  # fmt: skip
            raise
        except Exception:
            # Every sender gets the same answer, which names no internals (the log has them).
            logger.exception("weight update of policy_version %d failed",
                             update.key.policy_version)  # fmt: skip
            update.fail(self._internal_error(update.key.policy_version))
            raise update.error() from None

    def _internal_error(self, policy_version: int) -> WeightUpdateError:
        """The answer to an update that failed on an unexpected error of the server's own
        (logged by the caller): INTERNAL, what the engine serves now, and no class names,
        messages or paths of the server's."""
        version = self._engine.policy_version
        served = (
            f"the served weights (policy_version {version}) are unchanged"
            if self._engine.serving
            else "the served weights are in an unknown state (NOT_SERVING until a complete "
            "update succeeds)"
        )
        return WeightUpdateError(
            grpc.StatusCode.INTERNAL,
            f"policy_version {policy_version} was refused on an internal error of the server "
            f"(see the server's log); {served}",
        )

    async def _prepare(self, update: Update) -> None:
        """Under the update lock, before any byte is received: the assembler and the staging
        file of `update`."""
        update.started = time.monotonic()
        specs = self._engine.weight_specs
        update.assembler = WeightAssembler(specs, self._engine.policy_version)
        if self._staging is None:
            self._staging = StagingFile(self._engine.staging_dir)
        self._staging.check_space(minimum_update_bytes(specs))
        update.staging = self._staging
        if self._engine.stages:
            # Staged as it arrives (generator_service/feeder.py).
            try:
                stage_id = await self._engine.begin_stage(list(specs))
            except Exception:  # noqa: BLE001 - staged after the stream instead
                logger.exception("beginning a stage failed")
                stage_id = 0
            if stage_id:
                path = self._staging.path

                async def feed(tensors) -> None:
                    await self._engine.feed_stage(stage_id, path, tensors)

                update.stage_id, update.feeder = stage_id, StageFeeder(feed)

    async def _release(self, update: Update) -> None:
        """Before the update lock is released: every write `update` queued has settled, and
        a stage begun for it and not handed to a swap is dropped."""
        if update.staging is not None:
            await update.staging.settle()
        if update.feeder is not None:  # refused before its swap
            await update.feeder.abandon()
            update.feeder = None
            await self._engine.drop_stage()
        await self._publish_health()

    async def _swap(self, update: Update) -> generator_pb2.UpdateWeightsResponse:
        """The received update checked complete and swapped in."""
        assembler, staging = update.assembler, update.staging
        tensors = assembler.finish()
        await staging.flush(assembler.staged_bytes)
        received_seconds = time.monotonic() - update.started
        failpoints.hit("update_weights")  # (chaos tests only)
        stage_id = 0
        if update.feeder is not None:  # the stage goes to the swap, which drops it after
            fed = await update.feeder.close()
            if fed:
                stage_id = update.stage_id
            else:  # staged from scratch by the swap
                await finish_despite_cancellation(asyncio.ensure_future(self._engine.drop_stage()))
            update.feeder = None  # (after the drop: if it is cancelled, `_release` drops it)
        swap = await self._swap_in(
            staging.path, tensors, assembler.policy_version, assembler.allow_rollback,
            stage_id, update.key.update_id,
        )  # fmt: skip
        self.last_swap = swap = dataclasses.replace(
            swap, stage_seconds=received_seconds + swap.stage_seconds
        )
        seconds = time.monotonic() - update.started
        logger.info(
            "policy_version %d live: %d tensors, %d bytes in %d chunks from %d sender(s), "
            "%.2fs (received in %.2fs, staged by %.2fs, paused %.2fs)",
            assembler.policy_version,
            len(tensors),
            assembler.num_bytes,
            assembler.num_chunks,
            update.key.num_senders,
            seconds,
            received_seconds,
            swap.stage_seconds,
            swap.pause_seconds,
        )
        return generator_pb2.UpdateWeightsResponse(
            policy_version=assembler.policy_version,
            num_tensors=len(tensors),
            num_bytes=assembler.num_bytes,
            seconds=seconds,
            pause_seconds=swap.pause_seconds,
            stage_seconds=swap.stage_seconds,
            stage_tokens=swap.stage_tokens,
        )

    async def _swap_in(
        self,
        path: str,
        tensors: list,
        policy_version: int,
        allow_rollback: bool,
        stage_id: int,
        update_id: str,
    ) -> SwapTimes:
        """`Engine.swap_weights`, keeping the update_id of the served weights (GetStatus):
        `update_id` once the swap is done, also when this call is cancelled after the swap's
        pause began (the swap then runs to its end: the engine serves `policy_version`, and a
        learner whose answer was lost can tell its update was applied); empty once a swap left
        the weights unknown. A cancelled rollback to the version already served cannot be told
        from one dropped before its pause: empty then (unknown), never another update's id."""
        served_before = self._engine.policy_version
        try:
            swap = await self._engine.swap_weights(
                path, tensors, policy_version, allow_rollback, stage_id=stage_id
            )
        except asyncio.CancelledError:
            if self._engine.serving and self._engine.policy_version == policy_version:
                self._served_update_id = update_id if policy_version != served_before else ""
            raise
        except Exception:
            if not self._engine.serving:
                self._served_update_id = ""
            raise
        self._served_update_id = update_id
        return swap

    async def UpdateWeightsShared(
        self, request: generator_pb2.SharedWeights, context
    ) -> generator_pb2.UpdateWeightsResponse:
        """Swaps in an update the learner wrote into a file of the shared folder: no bytes are
        received, the engine maps the learner's file directly. A `progressive` update is staged
        as the learner writes it (`_follow`)."""
        specs = self._engine.weight_specs
        if specs is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, self._engine.weight_specs_error
            )
        if not is_local_peer(context.peer()):
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"UpdateWeightsShared is only accepted from this host, not from {context.peer()}; "
                "stream the weights with UpdateWeights",
            )
        async with self._update_lock:
            started = time.monotonic()
            stage_id = 0
            try:
                path = shared_file_path(request.path, self._engine.staging_dir)
                tensors = check_shared_layout(
                    specs,
                    self._engine.policy_version,
                    request.policy_version,
                    [(t.name, t.dtype, tuple(t.shape), t.position) for t in request.tensors],
                    shared_file_size(path),
                    request.allow_rollback,
                )
                if request.progressive:
                    check_progress_page(tensors)
                    if self._engine.stages:
                        try:
                            stage_id = await self._engine.begin_stage([t.name for t in tensors])
                        except Exception:  # noqa: BLE001 - staged after the writes instead
                            logger.exception("beginning a stage failed")
                    stage_id = await self._follow(path, tensors, stage_id, request.policy_version)
                checked_seconds = time.monotonic() - started
                failpoints.hit("update_weights")  # (chaos tests only)
                handed, stage_id = stage_id, 0  # the swap drops it from here on
                swap = await self._swap_in(
                    path, tensors, request.policy_version, request.allow_rollback, handed,
                    request.update_id,
                )  # fmt: skip
                self.last_swap = swap = dataclasses.replace(
                    swap, stage_seconds=checked_seconds + swap.stage_seconds
                )
            except WeightUpdateError as error:
                logger.warning("shared weight update refused: %s", error.message)
                await context.abort(error.code, error.message)
            except Exception:
                logger.exception("shared weight update of policy_version %d failed",
                                 request.policy_version)  # fmt: skip
                error = self._internal_error(request.policy_version)
                await context.abort(error.code, error.message)
            finally:
                if stage_id:  # begun, and the update ended before its swap
                    await finish_despite_cancellation(
                        asyncio.ensure_future(self._engine.drop_stage())
                    )
                await self._publish_health()
        seconds = time.monotonic() - started
        num_bytes = sum(tensor.nbytes for tensor in tensors)
        logger.info(
            "policy_version %d live: %d tensors, %d bytes from shared file %s%s, %.2fs "
            "(staged by %.2fs, paused %.2fs)",
            request.policy_version,
            len(tensors),
            num_bytes,
            path,
            " (staged as written)" if request.progressive else "",
            seconds,
            swap.stage_seconds,
            swap.pause_seconds,
        )
        return generator_pb2.UpdateWeightsResponse(
            policy_version=request.policy_version,
            num_tensors=len(tensors),
            num_bytes=num_bytes,
            seconds=seconds,
            pause_seconds=swap.pause_seconds,
            stage_seconds=swap.stage_seconds,
            stage_tokens=swap.stage_tokens,
        )

    async def _follow(self, path: str, tensors: list, stage_id: int, version: int) -> int:
        """Until the learner has written every tensor of a progressive shared update (its count
        in the file's first 8 bytes: `SharedWeights.progressive`, read under the file's lock:
        `jaxrlhf_wire.files.read_progress_count`), handing each written tensor
        to stage `stage_id` (0: none); returns the stage, or 0 when feeding it failed (it is
        then dropped, and the swap stages from scratch). Raises WeightUpdateError if the writer
        gives up or the count stands still for `senders_timeout` seconds (ABORTED: it may be
        sent again), the count goes wrong, or the file cannot be read."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION, f"the shared file cannot be read: {error}"
            ) from error
        try:
            fed, moved, poll = 0, time.monotonic(), PROGRESS_POLL_SECONDS[0]
            while fed < len(tensors):
                try:
                    count = read_progress_count(fd)
                except OSError as error:
                    raise WeightUpdateError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"the shared file's count cannot be read: {error}",
                    ) from error
                if count is None:  # a store holds the lock: no news yet
                    count = fed
                elif count == PROGRESS_ABANDONED:
                    raise WeightUpdateError(
                        grpc.StatusCode.ABORTED,
                        f"the learner gave up writing policy_version {version} into the shared "
                        f"file after {fed} of {len(tensors)} tensors; the served weights are "
                        "unchanged",
                    )
                if not fed <= count <= len(tensors):
                    raise WeightUpdateError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the shared file's count of written tensors is {count}, after "
                        f"{fed}, of {len(tensors)}: a count only grows, up to the tensors listed",
                    )
                if count > fed:
                    if stage_id:
                        try:
                            await self._engine.feed_stage(stage_id, path, tensors[fed:count])
                        except Exception:  # noqa: BLE001 - the swap stages from scratch
                            logger.exception("feeding the stage failed")
                            await finish_despite_cancellation(
                                asyncio.ensure_future(self._engine.drop_stage())
                            )
                            stage_id = 0
                    fed, moved, poll = count, time.monotonic(), PROGRESS_POLL_SECONDS[0]
                elif time.monotonic() - moved > self._updates.join_timeout:
                    # Transient (a learner slow to convert, on busy cores): ABORTED, not a
                    # precondition, so that the learner fails this replica and brings it back
                    # instead of ending its run.
                    raise WeightUpdateError(
                        grpc.StatusCode.ABORTED,
                        f"the shared file of policy_version {version} gained no tensor for "
                        f"{self._updates.join_timeout:g} s ({fed} of {len(tensors)} written): "
                        "the learner's writes stalled; the update is refused, the served "
                        "weights are unchanged, and it may be sent again",
                    )
                else:
                    await asyncio.sleep(poll)
                    poll = min(2 * poll, PROGRESS_POLL_SECONDS[1])
        finally:
            os.close(fd)
        return stage_id

    def close(self) -> None:
        """Deletes the staging file; call once the server has stopped."""
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    async def GetStatus(self, request, context) -> generator_pb2.GeneratorStatus:
        engine = self._engine
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
            num_weight_tensors=len(engine.weight_specs or ()),
            vllm_version=engine.vllm_version,
            swap_pending=engine.swap_pending,
            shared_weights_dir=engine.staging_dir if engine.weight_specs is not None else "",
            swap_mode=engine.config.swap_mode,
            in_flight_kv=engine.config.in_flight_kv if engine.in_flight else "",
            idle_seconds=idle_seconds,
            request_seconds=request_seconds,
            uptime_seconds=uptime_seconds,
            max_num_seqs=engine.max_num_seqs,
            occupancy=engine.occupancy.fraction(),
            stage_seconds=self.last_swap.stage_seconds,
            pause_seconds=self.last_swap.pause_seconds,
            stage_tokens=self.last_swap.stage_tokens,
            staged_swaps=engine.stages,
            staged_swaps_off=engine.stage_unsupported
            or ("" if engine.config.stage else "started with --no-stage"),
            shared_progress=True,
            update_id=self._served_update_id,
        )

    async def _publish_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._engine.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)


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
