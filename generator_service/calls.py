"""Generate calls: validated prompts in, samples tagged with the version of every token out.

One `AsyncLLM` serves every call (continuous batching across calls); each sample is one engine
request (n=1), streamed back as soon as it finishes. Every token is tagged with the version of
the weights that sampled it, read from vLLM's weight-version spans (a swap labels the engine's
weights, updates/swap.py).

Admission (the `VersionGate` orders calls and swaps, gate.py):

- "drain" swaps: a call holds the gate, as a reader, until the engine has finished all of its
  requests, so a call never spans a swap; the spans are checked against the call's version
  as a second line of defence.
- "in-flight" swaps: a call holds the gate only while its requests are handed to the engine;
  a swap may then land in it, and no token may be older than the version the call was
  admitted under.
- A call is admitted under the served version (`Served`), and refused while a failed swap has
  left the weights unknown. `on_admitted(version)` runs once its first requests are in the
  engine, before any sample is handed out.
- A seeded call (`seed` without `seed_per_request`) runs alone, so that nothing else draws from
  the re-seeded RNG: in "drain" mode it holds the gate as a writer; in "in-flight" mode
  seeded calls hold a second gate of the calls alone as writers, the others as readers (a swap
  may still land in a seeded call: its tokens depend on when, reproducible only between swaps).
  Its requests queue while the scheduler is paused and are admitted together on resume: the
  same batches every time, drawing from a re-seeded RNG.
- `GenerateRequest.max_running`: the first `max_running` requests go in at once, the rest as
  slots free (one by one; a seeded call's in whole groups, each admitted together). It needs
  "drain" swaps: under "in-flight" ones a request submitted after a swap would run on weights
  its call was not admitted under.
- A call that ends early (its client gone, a request failed) aborts its requests already in
  the engine.

"lora" swap mode (updates/adapters.py): the base weights never change, and a call runs on the
adapter served when it was admitted (none for version 0), which it holds until its last request
has ended; as in "drain" mode it holds the gate for its whole run (only a seeded call, as a
writer, ever waits there: adapter swaps never take it), and all of its tokens carry the
adapter's version (the engine's weight-version spans stay at the base's 0, checked).

Prefix-cache entries never cross versions: every request's prompt is salted with the version
it was submitted under (`cache_salt`), and a swap resets the prefix cache where nothing holds
it. One exception, in "keep" mode: a request submitted under v and first scheduled after a swap
(queued behind `max_num_seqs`) reads blocks salted v, computed perhaps with v's weights, which
keep mode cannot reset under running requests; its first token is then tagged v (`_tagged`),
so that the sample's oldest tag is the oldest weights it may depend on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from generator_service.gate import VersionGate
from generator_service.requests import GenerateError, Sampling, validate_request
from generator_service.status import Occupancy, Served

logger = logging.getLogger(__name__)


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


class Calls:
    """The Generate calls of one engine (module docstring)."""

    def __init__(self, llm, gate: VersionGate, served: Served, occupancy: Occupancy, *,
                 in_flight: bool, in_flight_kv: str, per_request_seeds: bool,
                 adapters=None) -> None:  # fmt: skip
        self.llm = llm
        # "lora" mode: the engine's AdapterSwaps (`use` holds the served adapter for a call).
        self.adapters = adapters
        self.gate = gate
        self.seeded_gate = VersionGate()  # "in-flight" mode: seeded calls alone, without swaps
        self.served = served
        self.occupancy = occupancy
        self.in_flight = in_flight
        self._keep_kv = in_flight and in_flight_kv == "keep"
        self._per_request_seeds = per_request_seeds

    @property
    def num_waiting(self) -> int:
        """Calls waiting to be admitted."""
        return self.gate.readers_waiting + self.seeded_gate.readers_waiting

    def validate(self, prompts: Sequence[tuple[str, Sequence[int]]], sampling: Sampling,
                 vocab_size: int, max_model_len: int) -> None:  # fmt: skip
        """Raises GenerateError(INVALID_ARGUMENT) naming the first problem found, or
        FAILED_PRECONDITION for what this engine cannot do."""
        validate_request(prompts, sampling, vocab_size, max_model_len)
        if sampling.seed_per_request and not self._per_request_seeds:
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
        call = _Call(self, prompts, sampling, on_admitted)
        runner = asyncio.create_task(call.run())
        runner.add_done_callback(call.ended)
        try:
            while (sample := await call.samples.get()) is not None:
                # Not before `on_admitted` is done: a request that finishes while the call's
                # last ones are still being submitted must not be sent before the call's
                # initial metadata (two writes at once on one gRPC call: the call breaks).
                await call.admitted.wait()
                yield sample
            error = runner.exception()
            if error is not None:
                raise _first_error(error)
        finally:
            if not runner.done():
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    def sample(self, request: _Request, final, version: int) -> Sample:
        """The Sample of `request`'s final output, submitted under `version`; GenerateError
        when there is none, it was aborted, or its tokens' versions are not allowed."""
        if final is None or not final.outputs:
            raise GenerateError(
                grpc.StatusCode.INTERNAL, f"no output for request {request.request_id}"
            )
        completion = final.outputs[0]
        if completion.finish_reason == "abort":
            raise GenerateError(
                grpc.StatusCode.UNAVAILABLE,
                "the engine aborted the request"
                + ("" if self.served.serving else " (a weight swap failed while it ran)"),
            )
        tokens = list(completion.token_ids)
        versions = self._tagged(request, final, version, len(tokens))
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

    def adapter_of_call(self):
        """A context that holds the served adapter for a call and gives vLLM's request for it
        (None: the base, or not "lora" mode)."""
        return contextlib.nullcontext() if self.adapters is None else self.adapters.use()

    def _tagged(self, request: _Request, final, version: int, num_tokens: int) -> list[int]:
        """The version of each of the request's tokens (module docstring)."""
        spans = final.outputs[0].weight_versions
        versions = token_versions(spans, num_tokens)
        if self.adapters is not None:  # the base never moves: every token is the adapter's
            if versions is not None and not any(versions):
                return [version] * num_tokens
            allowed = lambda v: False  # the base must stay version 0: refused below
        else:
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
            self._keep_kv
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
        return versions


def sampling_params(sampling: Sampling, seed: int | None = None, max_tokens: int | None = None):
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


class _Call:
    """One Generate call's requests, from admission until each has its sample in `samples`
    (None after the last, once the call has ended: `ended`). Module docstring: the rules."""

    def __init__(self, calls: Calls, prompts: Sequence[tuple[str, Sequence[int]]],
                 sampling: Sampling,
                 on_admitted: Callable[[int], Awaitable[None]] | None) -> None:  # fmt: skip
        self._calls = calls
        self._llm = calls.llm
        self._sampling = sampling
        self._on_admitted = on_admitted
        self._params = sampling_params(sampling)
        self._seeded = sampling.seed is not None and not sampling.seed_per_request
        call_id = uuid.uuid4().hex
        self._requests = [
            _Request(f"{call_id}-{prompt_index}-{sample_index}", prompt_index, prompt_id,
                     list(token_ids), sample_index)
            for prompt_index, (prompt_id, token_ids) in enumerate(prompts)
            for sample_index in range(sampling.n)
        ]  # fmt: skip
        # GenerateRequest.max_running: how many go in at once.
        self._limit = sampling.max_running or len(self._requests)
        self.samples: asyncio.Queue[Sample | None] = asyncio.Queue()
        self.admitted = asyncio.Event()  # set once the call is admitted (or has ended)
        self._submitted: list[str] = []  # the request ids in the engine
        self._freed = asyncio.Semaphore(0)  # one release per ended request
        self._paused = False  # the scheduler, by this (seeded) call
        self._lora = None  # "lora" mode: vLLM's request of the adapter the call holds

    def ended(self, _) -> None:
        self.admitted.set()
        self.samples.put_nowait(None)

    async def run(self) -> None:
        """Admits the call (module docstring) and submits its requests; returns when every one
        has its sample, or raises (its requests in the engine aborted)."""
        calls, in_flight = self._calls, self._calls.in_flight
        alone = self._seeded and not in_flight
        seeded_gate = contextlib.nullcontext()
        if in_flight:
            seeded_gate = calls.seeded_gate.write() if self._seeded else calls.seeded_gate.read()
        async with seeded_gate, contextlib.AsyncExitStack() as held:
            await held.enter_async_context(calls.gate.write() if alone else calls.gate.read())
            if not calls.served.serving:
                raise GenerateError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the weights are in an unknown state after a failed swap; "
                    "send a complete weight update",
                )
            version = calls.served.policy_version
            with calls.adapter_of_call() as self._lora:  # with the version: no await between
                await self._run_admitted(held, version)

    async def _run_admitted(self, held: contextlib.AsyncExitStack, version: int) -> None:
        """`run` once admitted under `version`: submits the requests, waits for every one."""
        if self._seeded:
            await self._pause()
        try:
            async with asyncio.TaskGroup() as group:
                try:
                    wave = await self._admit(group, held, version)
                    await self._submit_the_rest(group, wave, version)
                except BaseException:
                    # The call's requests already in the engine go with it (their
                    # collectors may be cancelled before they ever ran).
                    await asyncio.shield(self._llm.abort(self._submitted, internal=True))
                    raise
        finally:
            if self._paused:
                await self._llm.resume_generation()

    async def _admit(self, group: asyncio.TaskGroup, held: contextlib.AsyncExitStack,
                     version: int) -> list[asyncio.Task]:  # fmt: skip
        """Submits the first `limit` requests and lets the call in; returns their tasks."""
        wave = await self._submit(group, self._requests[: self._limit], version)
        if self._seeded:
            await self._llm.collective_rpc(
                "jaxrlhf_reseed", kwargs={"seed": self._sampling.seed % (1 << 63)}
            )
        if self._paused:
            await self._resume()
        if self._calls.in_flight:
            await held.aclose()  # in the engine: a swap may now proceed under them
        if self._on_admitted is not None:
            await self._on_admitted(version)
        self.admitted.set()
        return wave

    async def _submit_the_rest(self, group: asyncio.TaskGroup, wave: list[asyncio.Task],
                               version: int) -> None:  # fmt: skip
        """The requests after the first `limit`: as slots free, or (seeded) wave by wave."""
        for start in range(self._limit, len(self._requests), self._limit):
            batch = self._requests[start : start + self._limit]
            if self._seeded:
                await asyncio.wait(wave)
                await self._pause()
                wave = await self._submit(group, batch, version)
                await self._resume()
                continue
            for request in batch:
                await self._freed.acquire()
                await self._submit(group, [request], version)

    async def _pause(self) -> None:
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def _resume(self) -> None:
        await self._llm.resume_generation()
        self._paused = False

    async def _submit(self, group: asyncio.TaskGroup, batch: Sequence[_Request],
                      version: int) -> list[asyncio.Task]:  # fmt: skip
        """Hands `batch` to the engine; returns the tasks that collect their samples. Each
        prompt is salted with `version`: prefix-cache entries of other versions never match."""
        from vllm.inputs import tokens_input

        tasks = []
        for request in batch:
            params = self._request_params(request)
            prompt = tokens_input(request.token_ids, cache_salt=f"policy-{version}")
            request.submitted = time.time()
            collector = await self._llm.add_request(
                request.request_id, prompt, params, lora_request=self._lora
            )
            self._submitted.append(collector.request_id)
            tasks.append(group.create_task(self._collect(request, collector, version)))
        return tasks

    def _request_params(self, request: _Request):
        sampling = self._sampling
        if not (sampling.seed_per_request or sampling.prompt_max_tokens):
            return self._params
        seed = None
        if sampling.seed_per_request:
            index = request.prompt_index * sampling.n + request.sample_index
            seed = (sampling.seed + index) % (1 << 63)
        return sampling_params(sampling, seed, sampling.max_tokens_of(request.prompt_index))

    async def _collect(self, request: _Request, collector, version: int) -> None:
        """Waits for the request's final output (as vLLM's `AsyncLLM.generate` does) and queues
        its Sample, then frees its slot of the call; aborts the request if the call goes away
        first."""
        occupancy = self._calls.occupancy
        final = None
        occupancy.started()
        try:
            while final is None or not final.finished:
                final = collector.get_nowait() or await collector.get()
        except asyncio.CancelledError:
            await self._llm.abort(collector.request_id, internal=True)
            raise
        finally:
            occupancy.finished()
        self.samples.put_nowait(self._calls.sample(request, final, version))
        self._freed.release()


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
