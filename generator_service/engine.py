"""The vLLM engine of the service: validated requests in, version-tagged samples out, and swaps.

One `AsyncLLM` serves every call (continuous batching across calls). Every token is tagged with
the version of the weights that sampled it, from vLLM's weight-version spans (the engine labels
its weights with `update_weight_version` at every swap). Two swap modes (`SWAP_MODES`):

- "drain": the `VersionGate` admits a Generate call between swaps and the swap waits until the
  engine has finished all of the call's requests, so a call never spans a swap; the spans are
  checked against the call's version as a second line of defence.
- "in-flight": a call holds the gate only while its requests are handed to the engine. A swap
  pauses the scheduler with running requests frozen in place (`pause_generation(mode="keep")`),
  loads, relabels and resumes: they continue on the new weights. Their KV cache (`IN_FLIGHT_KV`)
  is kept ("keep": entries computed with the older weights stay, as PipelineRL does) or
  recomputed ("recompute": every running request is preempted and re-prefilled, prompt and
  tokens so far, with the new weights).

Seeded calls run alone in both modes; in "in-flight" mode a swap may still land in one, so
its tokens depend on when the swap came (reproducible only between swaps).

Prefix-cache entries never cross versions: every request's prompt is salted with the version it
was submitted under (`cache_salt`), and the prefix cache is reset at every swap where nothing
holds it. One exception, in "keep" mode: a request submitted under v and first scheduled after
a swap (queued behind `max_num_seqs`) reads blocks salted v, computed perhaps with v's weights,
which keep mode cannot reset under running requests; its first token is then tagged v (see
`_sample`), so that the sample's oldest tag is the oldest weights it may depend on.

A swap that fails while loading leaves the weights in an unknown state: the engine then aborts
every running request (in-flight mode) rather than continue it, and refuses new calls until a
complete update succeeds. Updates that are refused (malformed, stale) are refused
before the engine pauses, so running requests never notice them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from generator_service import failpoints
from generator_service.gate import VersionGate
from generator_service.requests import GenerateError, Sampling, validate_request
from generator_service.weights import (
    StagedTensor,
    TensorSpec,
    WeightUpdateError,
    expected_tensors,
)
from jaxrlhf_wire import IN_FLIGHT_KV, SWAP_MODES

logger = logging.getLogger(__name__)

# Reload that also repacks tied lm_heads (see worker_extension.py).
WORKER_EXTENSION = "generator_service.worker_extension.WeightReloadExtension"


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    # None: eager on CPU (no graph capture there), graphs elsewhere.
    enforce_eager: bool | None = None
    # vLLM's distributed_executor_backend ("mp", "uni"; None: vLLM's). "uni" on CPU also needs
    # VLLM_ENABLE_V1_MULTIPROCESSING=0 (`python -m generator_service --engine-executor`).
    executor: str | None = None
    max_num_seqs: int | None = None
    block_size: int | None = None  # None: vLLM's (128 on CPU: shorter prompts are never cached)
    # Where updates are staged before the engine loads them (RAM-backed if possible; see
    # weights.py). None: /dev/shm when writable, else the system temp folder.
    staging_dir: str | None = None
    # The KV cache's size in bytes (it takes precedence over VLLM_CPU_KVCACHE_SPACE). None: on
    # CPU, `default_cpu_kv_cache_bytes()` (unless VLLM_CPU_KVCACHE_SPACE says otherwise); on
    # GPUs, gpu_memory_utilization decides.
    kv_cache_bytes: int | None = None
    # See the module docstring.
    swap_mode: str = "drain"
    in_flight_kv: str = "keep"
    # Staged swaps (staging.py): the update is converted into the engine's layout while
    # generation goes on, and the pause only commits it. False: reload in the pause (one copy of
    # the weights instead of two). `stage_threads`: CPU threads of the staging thread (on a
    # CPU backend it shares the cores with generation).
    stage: bool = True
    stage_threads: int = 1

    def __post_init__(self) -> None:
        if self.swap_mode not in SWAP_MODES:
            raise ValueError(f"swap mode must be one of {SWAP_MODES}, got {self.swap_mode!r}")
        if self.in_flight_kv not in IN_FLIGHT_KV:
            raise ValueError(
                f"in-flight KV policy must be one of {IN_FLIGHT_KV}, got {self.in_flight_kv!r}"
            )


GIB = 1 << 30
# How often a swap asks the workers whether its update is staged: every 5 ms at first, then
# less and less often, down to every 50 ms (each ask is an RPC through the engine's loop, which
# costs CPU that the staging thread would otherwise have).
STAGE_POLL_SECONDS = (0.005, 0.05)
# How long a stopping service waits for its engine processes before killing them. vLLM's own
# default (5 s) is mostly spent after the work is done: its worker lingers ~3 s after its
# queues close, then the engine core ~2 s more until it is killed anyway.
ENGINE_STOP_TIMEOUT_S = 1.0


def default_cpu_kv_cache_bytes() -> int:
    """A quarter of the memory free now, between 0.5 and 4 GiB.

    vLLM's CPU backend otherwise reserves `gpu_memory_utilization` (0.9) of the NUMA node's
    memory and refuses to start when that much is not free, which on a shared 24 GB machine
    (a ~9.6 GB node) it never is.
    """
    import psutil

    return int(min(4 * GIB, max(GIB // 2, psutil.virtual_memory().available // 4)))


@dataclass
class _Request:
    request_id: str
    prompt_index: int
    prompt_id: str
    token_ids: list[int]
    sample_index: int
    submitted: float = 0.0  # Unix time it went to the engine


@dataclass(frozen=True)
class Sample:
    prompt_index: int
    prompt_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int  # of the first token
    token_policy_versions: list[int]  # of each token
    submitted_unix_time: float = 0.0
    finished_unix_time: float = 0.0


class Occupancy:
    """How busy the engine was: seconds with no request generating (none running, or the
    scheduler paused for a swap), and request-seconds (the number generating, at most the
    engine's `capacity` (its max_num_seqs: more are queued, not generating), integrated over
    time), since the engine started."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._started = self._since = time.monotonic()
        self._running = 0
        self._paused = False
        self.idle_seconds = 0.0
        self.request_seconds = 0.0

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self._since = now - self._since, now
        generating = 0 if self._paused else min(self._running, self.capacity)
        if generating == 0:
            self.idle_seconds += elapsed
        self.request_seconds += generating * elapsed

    def started(self) -> None:
        self._advance()
        self._running += 1

    def finished(self) -> None:
        self._advance()
        self._running -= 1

    def paused(self, paused: bool) -> None:
        self._advance()
        self._paused = paused

    def totals(self) -> tuple[float, float]:
        """(idle seconds, request-seconds) up to now (`seconds`: the span they cover)."""
        self._advance()
        return self.idle_seconds, self.request_seconds

    @property
    def seconds(self) -> float:
        """Seconds since the start, up to the last reading of the totals: the span they cover,
        on this clock. A client that divides their change between two readings by its own
        clock's interval instead is off by the difference of its two calls' latencies: above 1
        at a full engine when the first answer took longer than the second."""
        return self._since - self._started

    def fraction(self) -> float:
        """Request-seconds ÷ (seconds × capacity) since the start, in [0, 1]."""
        self._advance()
        seconds = self.seconds
        return self.request_seconds / (seconds * self.capacity) if seconds > 0 else 0.0


@dataclass(frozen=True)
class SwapTimes:
    """What a swap took: `stage_seconds` while generation went on (converting the update into
    the engine's layout; 0 when not staged), `pause_seconds` while it was held back, and
    `stage_tokens`, the tokens generated while the update was staged (a lower bound: read every
    few ms from the engine's running requests)."""

    stage_seconds: float = 0.0
    pause_seconds: float = 0.0
    stage_tokens: int = 0


class TokenCounter:
    """Counts the tokens that running requests generate between `__init__` and the last
    `update` (requests that finish in between count up to the last update that saw them)."""

    def __init__(self, request_states) -> None:
        self._states = request_states
        self._first = self._read()
        self._last = dict(self._first)

    def _read(self) -> dict[str, int]:
        return {
            request_id: state.detokenizer.num_output_tokens()
            for request_id, state in list(self._states.items())
        }

    def update(self) -> int:
        self._last.update(self._read())
        return sum(n - self._first.get(request_id, 0) for request_id, n in self._last.items())


def token_versions(spans, num_tokens: int) -> list[int] | None:
    """One version per token from vLLM's weight-version spans (None: spans missing, not
    covering every token in order, or with a label that is not a version)."""
    versions: list[int] = []
    for span in spans or ():
        if span.start != len(versions) or span.end < span.start:
            return None
        try:
            versions += [int(span.version)] * (span.end - span.start)
        except ValueError:
            return None
    return versions if len(versions) == num_tokens else None


def _resolve_model_dir(model: str) -> Path | None:
    """The local folder of `model` (a path, or a hub name already in the local cache)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means: no local folder to read headers from
        return None


def _default_staging_dir() -> str:
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class GeneratorEngine:
    """Owns the AsyncLLM, the policy version and the gate; created inside the server's loop."""

    def __init__(self, config: EngineConfig) -> None:
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.vllm_version: str = vllm.__version__
        enforce_eager = config.enforce_eager
        if enforce_eager is None:
            enforce_eager = current_platform.is_cpu()
        kv_cache_bytes = config.kv_cache_bytes
        if kv_cache_bytes is None and current_platform.is_cpu():
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kv_cache_bytes = default_cpu_kv_cache_bytes()
        elif kv_cache_bytes is not None and os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None):
            # vLLM's CPU worker would take its variable over the size asked for here.
            logger.info("VLLM_CPU_KVCACHE_SPACE is ignored: the KV cache's size is given")
        self.kv_cache_bytes = kv_cache_bytes
        if kv_cache_bytes is not None:
            logger.info("KV cache: %.2f GiB", kv_cache_bytes / GIB)
        args = AsyncEngineArgs(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.tensor_parallel_size,
            gpu_memory_utilization=config.gpu_memory_utilization,
            seed=config.seed,
            enforce_eager=enforce_eager,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            kv_cache_memory_bytes=kv_cache_bytes,
            # Logprobs of the distribution actually sampled (temperature, top-k/p applied),
            # which is what the learner's importance ratios need.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            worker_extension_cls=WORKER_EXTENSION,
            distributed_executor_backend=config.executor,
        )
        self._llm = AsyncLLM.from_engine_args(args)
        model_config = self._llm.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.dtype: str = str(model_config.dtype).removeprefix("torch.")
        self.staging_dir = config.staging_dir or _default_staging_dir()
        self.policy_version = 0
        self.serving = True
        self.num_updates = 0
        self.last_update_unix_time = 0.0
        self.weight_specs: dict[str, TensorSpec] | None = None
        self.weight_specs_error = ""
        model_dir = _resolve_model_dir(config.model)
        try:
            if model_dir is None:
                raise FileNotFoundError(f"no local folder for {config.model}")
            self.weight_specs = expected_tensors(model_dir)
        except FileNotFoundError as error:
            self.weight_specs_error = f"weight updates are unavailable: {error}"
            logger.warning(self.weight_specs_error)
        self._gate = VersionGate()
        self._calls = VersionGate()  # "in-flight" mode: seeded calls alone, without swaps
        # The engine's own limit on requests generating at once.
        self.max_num_seqs: int = self._llm.vllm_config.scheduler_config.max_num_seqs
        # vLLM 0.32's CPU backend fails a step (the engine dies: "CPU Generator does not use
        # offset") when a request with its own seed is in a prefill that chunked prefill split
        # (seen on SmolLM2 with ~40 requests at once); short prompts alone never hit it.
        self.per_request_seeds = not current_platform.is_cpu()
        self.occupancy = Occupancy(self.max_num_seqs)
        # Why this engine's updates cannot be staged (they are then reloaded in the pause).
        self.stage_unsupported = ""
        self._stage_id = 0  # the number of the last stage begun (`begin_stage`)
        self._stage_tokens: TokenCounter | None = None

    async def start(self) -> None:
        """Labels the engine's weights with version 0 (vLLM's weight-version spans)."""
        await self._llm.update_weight_version(str(self.policy_version))

    @property
    def dead(self) -> bool:
        """Whether vLLM's engine died (a worker or the engine core process is gone)."""
        return self._llm.errored

    @property
    def num_requests_running(self) -> int:
        return self._llm.get_num_unfinished_requests()

    @property
    def num_calls_waiting(self) -> int:
        return self._gate.readers_waiting + self._calls.readers_waiting

    @property
    def swap_pending(self) -> bool:
        return self._gate.writer_pending

    def validate(self, prompts: Sequence[tuple[str, Sequence[int]]], sampling: Sampling) -> None:
        """Raises GenerateError(INVALID_ARGUMENT) naming the first problem found, or
        FAILED_PRECONDITION for what this engine cannot do."""
        validate_request(prompts, sampling, self.vocab_size, self.max_model_len)
        if sampling.seed_per_request and not self.per_request_seeds:
            raise GenerateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "seed_per_request is not available on vLLM's CPU backend (a request with its "
                "own seed in a chunked prefill kills the engine); send `seed` alone",
            )
        if sampling.max_running and self.in_flight:
            raise GenerateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f'max_running={sampling.max_running} needs "drain" swaps: under "in-flight" '
                "ones a sample submitted after a swap would run on weights its call was not "
                "admitted under",
            )

    def _sampling_params(
        self, sampling: Sampling, seed: int | None = None, max_tokens: int | None = None
    ):
        """vLLM's params of one request; `seed`: its own (GenerateRequest.seed_per_request),
        `max_tokens`: its prompt's (Prompt.max_tokens)."""
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        # One engine request per sample (n=1): each streams back as soon as it finishes, and
        # n>1 with streamed outputs held only one of the n samples in the last output (seen
        # with vLLM 0.32 on CPU). vLLM fans n out the same way.
        # A seeded call runs alone on a re-seeded engine by default, which also repeats its
        # batching, and with it the numerics; `seed_per_request` seeds each request instead
        # (exact on CPU since vLLM 0.32; older versions crashed: "CPU Generator does not use
        # offset").
        return SamplingParams(
            seed=seed,
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            max_tokens=max_tokens or sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    @property
    def in_flight(self) -> bool:
        return self.config.swap_mode == "in-flight"

    async def generate(
        self,
        prompts: Sequence[tuple[str, Sequence[int]]],
        sampling: Sampling,
        on_admitted: Callable[[int], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Sample]:
        """Yields samples in finishing order; call `validate` first.

        `on_admitted(version)` runs once the call's requests are in the engine, `version` the
        one they were submitted under (in "drain" mode, that of every token).
        """
        params = self._sampling_params(sampling)
        queue: asyncio.Queue[Sample | None] = asyncio.Queue()
        admitted = asyncio.Event()  # set once the call is admitted (or has ended)
        call_id = uuid.uuid4().hex

        def request_params(prompt_index: int, sample_index: int):
            if not (sampling.seed_per_request or sampling.prompt_max_tokens):
                return params
            seed = None
            if sampling.seed_per_request:
                seed = (sampling.seed + prompt_index * sampling.n + sample_index) % (1 << 63)
            return self._sampling_params(sampling, seed, sampling.max_tokens_of(prompt_index))

        async def run_call() -> None:
            seeded = sampling.seed is not None and not sampling.seed_per_request
            # A seeded call runs alone, so that nothing else draws from the re-seeded RNG. In
            # "drain" mode one gate orders calls and swaps; in "in-flight" mode calls hold the
            # swap gate only while they are handed to the engine, and `_calls` orders them.
            in_flight = self.in_flight
            alone = seeded and not in_flight
            calls = contextlib.nullcontext()
            if in_flight:
                calls = self._calls.write() if seeded else self._calls.read()
            requests = [
                _Request(f"{call_id}-{prompt_index}-{sample_index}", prompt_index, prompt_id,
                         list(token_ids), sample_index)
                for prompt_index, (prompt_id, token_ids) in enumerate(prompts)
                for sample_index in range(sampling.n)
            ]  # fmt: skip
            # GenerateRequest.max_running: the first `limit` go in at once, the rest as slots
            # free (one by one; a seeded call's in whole groups, each admitted together).
            limit = sampling.max_running or len(requests)
            async with calls, contextlib.AsyncExitStack() as held:
                await held.enter_async_context(self._gate.write() if alone else self._gate.read())
                if not self.serving:
                    raise GenerateError(
                        grpc.StatusCode.UNAVAILABLE,
                        "the weights are in an unknown state after a failed swap; "
                        "send a complete weight update",
                    )
                version = self.policy_version
                paused = False
                if seeded:
                    # Requests queue while the scheduler is paused and are admitted together
                    # on resume: the same batches every time, drawing from a re-seeded RNG.
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                    paused = True
                try:
                    async with asyncio.TaskGroup() as group:
                        submitted: list[str] = []
                        freed = asyncio.Semaphore(0)  # one release per ended request

                        async def submit(batch: Sequence[_Request]) -> list[asyncio.Task]:
                            tasks = []
                            for request in batch:
                                collector = await self._submit(
                                    request, request_params(request.prompt_index,
                                                            request.sample_index), version,
                                )  # fmt: skip
                                submitted.append(collector.request_id)
                                tasks.append(
                                    group.create_task(
                                        self._collect(queue, request, collector, version, freed)
                                    )
                                )
                            return tasks

                        try:
                            wave = await submit(requests[:limit])
                            if seeded:
                                await self._llm.collective_rpc(
                                    "jaxrlhf_reseed", kwargs={"seed": sampling.seed % (1 << 63)}
                                )
                            if paused:
                                await self._llm.resume_generation()
                                paused = False
                            if in_flight:
                                # In the engine: a swap may now proceed under them.
                                await held.aclose()
                            if on_admitted is not None:
                                await on_admitted(version)
                            admitted.set()
                            for start in range(limit, len(requests), limit):
                                if seeded:
                                    await asyncio.wait(wave)
                                    await self._llm.pause_generation(mode="keep",
                                                                     clear_cache=False)  # fmt: skip
                                    paused = True
                                    wave = await submit(requests[start : start + limit])
                                    await self._llm.resume_generation()
                                    paused = False
                                    continue
                                for request in requests[start : start + limit]:
                                    await freed.acquire()
                                    await submit([request])
                        except BaseException:
                            # The call's requests already in the engine go with it (their
                            # collectors may be cancelled before they ever ran).
                            await asyncio.shield(self._llm.abort(submitted, internal=True))
                            raise
                finally:
                    if paused:
                        await self._llm.resume_generation()

        def ended(_) -> None:
            admitted.set()
            queue.put_nowait(None)

        runner = asyncio.create_task(run_call())
        runner.add_done_callback(ended)
        try:
            while (sample := await queue.get()) is not None:
                # Not before `on_admitted` is done: a request that finishes while the call's
                # last ones are still being submitted must not be sent before the call's
                # initial metadata (two writes at once on one gRPC call: the call breaks).
                await admitted.wait()
                yield sample
            error = runner.exception()
            if error is not None:
                raise _first_error(error)
        finally:
            if not runner.done():
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    async def _submit(self, request: _Request, params, version: int):
        """Hands one request to the engine; returns vLLM's output collector for it. The prompt
        is salted with `version`: prefix-cache entries of other versions never match it."""
        from vllm.inputs import tokens_input

        prompt = tokens_input(request.token_ids, cache_salt=f"policy-{version}")
        request.submitted = time.time()
        return await self._llm.add_request(request.request_id, prompt, params)

    async def _collect(
        self,
        queue: asyncio.Queue,
        request: _Request,
        collector,
        version: int,
        freed: asyncio.Semaphore,
    ):
        """Waits for the request's final output (as vLLM's `AsyncLLM.generate` does) and queues
        its Sample, then releases `freed` (its slot of the call); aborts the request if the call
        goes away first."""
        final = None
        self.occupancy.started()
        try:
            while final is None or not final.finished:
                final = collector.get_nowait() or await collector.get()
        except asyncio.CancelledError:
            await self._llm.abort(collector.request_id, internal=True)
            raise
        finally:
            self.occupancy.finished()
        queue.put_nowait(self._sample(request, final, version))
        freed.release()

    def _sample(self, request: _Request, final, version: int) -> Sample:
        if final is None or not final.outputs:
            raise GenerateError(
                grpc.StatusCode.INTERNAL, f"no output for request {request.request_id}"
            )
        completion = final.outputs[0]
        if completion.finish_reason == "abort":
            raise GenerateError(
                grpc.StatusCode.UNAVAILABLE,
                "the engine aborted the request"
                + ("" if self.serving else " (a weight swap failed while it ran)"),
            )
        tokens = list(completion.token_ids)
        spans = completion.weight_versions
        versions = token_versions(spans, len(tokens))
        allowed = (lambda v: v >= version) if self.in_flight else (lambda v: v == version)
        if versions is None or not all(map(allowed, versions)):
            # Never hand out a wrongly tagged completion: in "drain" mode the gate makes a
            # mixed one impossible, and no token predates the version it was submitted under.
            raise GenerateError(
                grpc.StatusCode.INTERNAL,
                f"request {request.request_id} submitted under version {version} ran on weight "
                f"versions {[(s.version, s.start, s.end) for s in spans or ()]}",
            )
        if (
            self.in_flight
            and self.config.in_flight_kv == "keep"
            and versions
            and versions[0] > version
            and (final.num_cached_tokens or 0) > 0
        ):
            # First scheduled after a swap, its prompt read prefix-cache blocks salted with the
            # version it was submitted under: blocks computed, perhaps, with those older
            # weights and kept (keep mode cannot reset the cache under running requests).
            # Tagged conservatively: its first token carries that version, the oldest weights
            # the sample may depend on, as a request running across the swap would.
            versions[0] = version
        step_logprobs = completion.logprobs or []
        return Sample(
            prompt_index=request.prompt_index,
            prompt_id=request.prompt_id,
            sample_index=request.sample_index,
            token_ids=tokens,
            logprobs=[
                step[token].logprob for token, step in zip(tokens, step_logprobs, strict=True)
            ],
            finish_reason=completion.finish_reason or "",
            policy_version=versions[0] if versions else version,
            token_policy_versions=versions,
            submitted_unix_time=request.submitted,
            finished_unix_time=time.time(),
        )

    @property
    def stages(self) -> bool:
        """Whether updates are staged (`EngineConfig.stage`, and the model can be)."""
        return self.config.stage and not self.stage_unsupported

    async def begin_stage(self, expected: Sequence[str]) -> int:
        """Begins staging an update of the tensors named `expected` before any of them has
        come: `feed_stage` then hands in each tensor once its bytes are in the staging file,
        and `swap_weights(..., stage_id=...)` waits for the rest and commits. Returns the
        stage's number, or 0 when this engine does not stage (nothing begun)."""
        if not self.stages:
            return 0
        self._stage_id += 1
        reasons = await self._llm.collective_rpc(
            "jaxrlhf_begin_stage",
            kwargs={
                "expected": list(expected),
                "threads": self.config.stage_threads,
                "stage_id": self._stage_id,
            },
        )
        if any(reasons):
            await self._staging_off([*filter(None, reasons)][0])
            return 0
        self._stage_tokens = TokenCounter(self._llm.output_processor.request_states)
        return self._stage_id

    async def feed_stage(self, stage_id: int, path: str, tensors: list[StagedTensor]) -> None:
        """Hands stage `stage_id` these complete tensors of `path` (`begin_stage`); raises
        RuntimeError when a worker no longer has that stage (dropped, or another begun)."""
        fed = await self._llm.collective_rpc(
            "jaxrlhf_feed_stage",
            kwargs={"path": path, "tensors": _manifest(tensors), "stage_id": stage_id},
        )
        if not all(fed):
            raise RuntimeError(f"stage {stage_id} is gone from a worker; nothing was fed")

    async def swap_weights(
        self,
        staging_path: str,
        tensors: list[StagedTensor],
        policy_version: int,
        allow_rollback: bool = False,
        stage_id: int = 0,
    ) -> SwapTimes:
        """Loads a validated, complete update staged in `staging_path` as `policy_version`.

        Staged (`EngineConfig.stage`, see staging.py): the update is first converted into the
        engine's layout while generation goes on, then committed in the pause; with
        `stage_id`, the stage `begin_stage` began, fed every one of `tensors`. A stage that
        fails is refused with the served weights untouched (still SERVING). `pause_seconds`:
        in "drain" mode from when new calls were held at the gate, through the drain and the
        commit (or load); in "in-flight" mode the commit (or load).

        A caller cancelled (a client's cancel or deadline) before the pause begins leaves
        everything as it was; once the pause has begun, the cancellation waits for it to end:
        the swap completes, or fails and leaves the server NOT_SERVING. It never stops with the
        scheduler paused, nor with new or partial weights serving under the old version."""
        manifest = _manifest(tensors)
        staging = self.stages or stage_id != 0
        staged, stage_seconds, stage_tokens = 0, 0.0, 0
        try:
            self._check_newer(policy_version, allow_rollback)
            if staging:
                started = time.monotonic()
                staged, stage_tokens = await self._stage(
                    staging_path, tensors, policy_version, stage_id
                )
                stage_seconds = time.monotonic() - started
            started = time.monotonic()
            async with self._gate.write():
                reload = self._reload(
                    staging_path, manifest, policy_version, allow_rollback, staged
                )
                await finish_despite_cancellation(asyncio.ensure_future(reload))
            pause_seconds = time.monotonic() - started
        finally:
            if staging:  # (also when cancelled or refused while staging)
                await finish_despite_cancellation(asyncio.ensure_future(self.drop_stage()))
        return SwapTimes(stage_seconds, pause_seconds, stage_tokens)

    def _check_newer(self, policy_version: int, allow_rollback: bool) -> None:
        if policy_version <= self.policy_version and not allow_rollback:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"policy_version {policy_version} is not newer than the served version "
                f"{self.policy_version}",
            )

    async def _stage(
        self, path: str, tensors: list[StagedTensor], policy_version: int, stage_id: int
    ) -> tuple[int, int]:
        """Goes on with the stage `begin_stage` began as `stage_id` and fed (or, without one,
        begins a stage of the whole update in `path` and feeds it at once) and waits until
        every worker has it; returns (the stage's number, tokens generated meanwhile). (0, 0):
        this model cannot be staged (logged once; it is then reloaded in the pause). Raises
        WeightUpdateError if the stage fails, or a worker has another stage or none."""
        if not stage_id:
            stage_id = await self.begin_stage([t.name for t in tensors])
            if not stage_id:
                return 0, 0
            await self.feed_stage(stage_id, path, tensors)
        tokens = self._stage_tokens or TokenCounter(self._llm.output_processor.request_states)
        poll = STAGE_POLL_SECONDS[0]
        while True:
            statuses = await self._llm.collective_rpc(
                "jaxrlhf_stage_status", kwargs={"stage_id": stage_id}
            )
            generated = tokens.update()
            unsupported = [s["error"] for s in statuses if s["state"] == "unsupported"]
            if unsupported:
                await self._staging_off(unsupported[0])
                return 0, 0
            failed = [s["error"] for s in statuses if s["state"] in ("failed", "none")]
            if failed:
                await self.drop_stage()
                # The worker's error (an exception of torch or vLLM) is for the log only.
                logger.error("staging policy_version %d failed: %s", policy_version,
                             failed[0] or "the stage was gone")  # fmt: skip
                raise WeightUpdateError(
                    grpc.StatusCode.INTERNAL,
                    f"staging policy_version {policy_version} failed in the engine's worker "
                    "(see the server's log); the served weights (policy_version "
                    f"{self.policy_version}) are unchanged",
                )
            if all(s["state"] == "done" for s in statuses):
                logger.info(
                    "policy_version %d staged in %.3fs (load %.3fs, process %.3fs, waiting for "
                    "tensors %.3fs) while %d tokens were generated",
                    policy_version,
                    max(s["seconds"] for s in statuses),
                    max(s.get("load", 0.0) for s in statuses),
                    max(s.get("process", 0.0) for s in statuses),
                    max(s.get("wait", 0.0) for s in statuses),
                    generated,
                )
                return stage_id, generated
            await asyncio.sleep(poll)
            poll = min(2 * poll, STAGE_POLL_SECONDS[1])

    async def _staging_off(self, reason: str) -> None:
        """This model cannot be staged: its updates are reloaded in the pause from now on."""
        await self.drop_stage()
        self.stage_unsupported = reason
        logger.warning("staged swaps are off: %s", reason)

    async def drop_stage(self) -> None:
        """Stops and frees a staged or staging update, if any."""
        self._stage_tokens = None
        try:
            await self._llm.collective_rpc("jaxrlhf_drop_staged")
        except Exception:  # noqa: BLE001 - the engine's watchdog reports a dead engine
            logger.exception("dropping a staged update failed")

    async def _reload(
        self, path: str, manifest: list, policy_version: int, allow_rollback: bool, staged: int
    ) -> None:
        """Loads the update in the pause: commits stage `staged` (0: reloads from `path`)."""
        self._check_newer(policy_version, allow_rollback)
        await self._hold(failpoints.hit("pause_for_swap"))  # (chaos tests only)
        # "drain": the gate already drained our calls; "wait" also covers anything else in the
        # engine. "in-flight": running requests stay where they are, frozen.
        await self._llm.pause_generation(
            mode="keep" if self.in_flight else "wait", clear_cache=False
        )
        self.occupancy.paused(True)
        try:
            if staged:
                await self._llm.collective_rpc("jaxrlhf_commit_staged", kwargs={"stage_id": staged})
            else:
                await self._llm.collective_rpc(
                    "jaxrlhf_reload_weights",
                    kwargs={"path": path, "tensors": manifest},
                )
            await self._hold(failpoints.hit("reload_weights"))  # (chaos tests only)
            recompute = self.in_flight and self.config.in_flight_kv == "recompute"
            if recompute or self._llm.get_num_unfinished_requests() == 0:
                # (With requests running and their KV kept, blocks are in use and the cache
                # cannot be reset; the salts keep its old entries from matching new requests.)
                await self._llm.reset_prefix_cache(reset_running_requests=recompute)
            await self._llm.update_weight_version(str(policy_version))
        except Exception as error:
            self.serving = False
            logger.exception("weight reload failed")
            if self.in_flight:
                # Running requests must not go on with weights in an unknown state.
                await self._llm.pause_generation(mode="abort", clear_cache=False)
            raise WeightUpdateError(
                grpc.StatusCode.INTERNAL,
                f"the engine failed while loading policy_version {policy_version} (see the "
                "server's log); its weights are now in an unknown state and it reports "
                "NOT_SERVING until a complete update succeeds",
            ) from error
        finally:
            self.occupancy.paused(False)
            await self._llm.resume_generation()
        self.policy_version = policy_version
        self.serving = True
        self.num_updates += 1
        self.last_update_unix_time = time.time()

    async def _hold(self, hold: str | None) -> None:
        """Performs a failpoint's hold (`failpoints.HOLDS`): `tokens=N` or `sleep=S`."""
        if hold is None:
            return
        kind, _, value = hold.partition("=")
        if kind == "tokens":
            await self._wait_for_tokens(int(value))
        else:
            await asyncio.sleep(float(value))

    async def _wait_for_tokens(self, count: int, timeout: float = 120.0) -> None:
        """Waits until every running request (one with a token: those still queued behind the
        engine's `max_num_seqs` have none) has generated `count` tokens (or `timeout`), so that
        the swap after it lands at a known place in them (the `pause_for_swap` failpoint).
        Reads vLLM's own record of each request's output tokens, which it keeps even though
        the outputs themselves are only sent once finished."""
        states = self._llm.output_processor.request_states

        def reached() -> bool:
            counts = [state.detokenizer.num_output_tokens() for state in states.values()]
            running = [n for n in counts if n > 0]
            return bool(running) and min(running) >= count

        deadline = time.monotonic() + timeout
        while not reached():
            if time.monotonic() > deadline:
                logger.warning("failpoint: running requests never reached %d tokens", count)
                return
            await asyncio.sleep(0.001)

    def shutdown(self, timeout: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Stops the engine processes: SIGTERM, and SIGKILL for those still there after
        `timeout` s. Drops our reference at once so that AsyncLLM.__del__ (which shuts down
        again) runs now, not during interpreter teardown where it fails."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown(timeout=timeout)
            del llm
            gc.collect()


async def finish_despite_cancellation(task: asyncio.Future):
    """`task`'s result, awaited to its end even if the awaiting task is cancelled meanwhile;
    that cancellation is raised once `task` is done (its own error, if any, is then left to
    its own handling: the swap logs it and reports NOT_SERVING)."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = cancelled or not task.done()
        except Exception:  # noqa: BLE001 - the task's own failure, raised by result() below
            pass
    if cancelled:
        if not task.cancelled():
            task.exception()  # retrieved: not reported again as "never retrieved"
        raise asyncio.CancelledError
    return task.result()


def _manifest(tensors: list[StagedTensor]) -> list:
    """The tensors as the worker's RPCs take them: [name, wire dtype, shape, byte position]."""
    return [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]


def _first_error(error: BaseException) -> BaseException:
    """The first leaf of a TaskGroup's exception group, mapped to a GenerateError if unknown.
    vLLM's refusal of a request keeps its reason (it is about the request); what else failed
    goes to the log, and the client is told what happened, not the server's internals."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, GenerateError):
        return error
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(error, VLLMClientError):
        return GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    logger.error("a Generate call failed", exc_info=error)
    if isinstance(error, EngineDeadError):
        return GenerateError(
            grpc.StatusCode.UNAVAILABLE,
            "the engine died (see the server's log); the server exits, to be restarted",
        )
    return GenerateError(
        grpc.StatusCode.INTERNAL,
        "the call failed on an internal error of the server (see the server's log)",
    )
