"""The vLLM engine of the service: validated requests in, version-tagged samples out, and swaps.

One `AsyncLLM` serves every call (continuous batching across calls). Exact version tags come
from the `VersionGate`: a Generate call enters between swaps, is tagged with the version live at
that moment, and the swap waits until the engine has finished all of the call's requests. vLLM's
own per-token weight-version spans are checked against the tag as a second line of defence.
"""

from __future__ import annotations

import asyncio
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

from generator_service.gate import VersionGate
from generator_service.requests import GenerateError, Sampling, validate_request
from generator_service.weights import (
    StagedTensor,
    TensorSpec,
    WeightUpdateError,
    expected_tensors,
)

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
    max_num_seqs: int | None = None
    # Where updates are staged before the engine loads them (RAM-backed if possible; see
    # weights.py). None: /dev/shm when writable, else the system temp folder.
    staging_dir: str | None = None
    # The KV cache's size in bytes. None: on CPU, `default_cpu_kv_cache_bytes()` (unless
    # VLLM_CPU_KVCACHE_SPACE says otherwise); on GPUs, gpu_memory_utilization decides.
    kv_cache_bytes: int | None = None


GIB = 1 << 30


def default_cpu_kv_cache_bytes() -> int:
    """A quarter of the memory free now, between 0.5 and 4 GiB.

    vLLM's CPU backend otherwise reserves `gpu_memory_utilization` (0.9) of the NUMA node's
    memory and refuses to start when that much is not free, which on a shared 24 GB machine
    (a ~9.6 GB node) it never is.
    """
    import psutil

    return int(min(4 * GIB, max(GIB // 2, psutil.virtual_memory().available // 4)))


@dataclass(frozen=True)
class Sample:
    prompt_index: int
    prompt_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int


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
            kv_cache_memory_bytes=kv_cache_bytes,
            # Logprobs of the distribution actually sampled (temperature, top-k/p applied),
            # which is what the learner's importance ratios need.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            worker_extension_cls=WORKER_EXTENSION,
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
        return self._gate.readers_waiting

    @property
    def swap_pending(self) -> bool:
        return self._gate.writer_pending

    def validate(self, prompts: Sequence[tuple[str, Sequence[int]]], sampling: Sampling) -> None:
        """Raises GenerateError(INVALID_ARGUMENT) naming the first problem found."""
        validate_request(prompts, sampling, self.vocab_size, self.max_model_len)

    def _sampling_params(self, sampling: Sampling):
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        # One engine request per sample (n=1): each streams back as soon as it finishes, and
        # n>1 with streamed outputs loses samples (DESIGN §6). vLLM fans n out the same way.
        # No per-request seed: it crashes on CPU; the engine is seeded instead.
        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=max(sampling.top_k, 0),
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def generate(
        self,
        prompts: Sequence[tuple[str, Sequence[int]]],
        sampling: Sampling,
        on_admitted: Callable[[int], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Sample]:
        """Yields samples in finishing order; call `validate` first.

        `on_admitted(version)` runs once the call holds the gate and its requests are queued.
        """
        params = self._sampling_params(sampling)
        queue: asyncio.Queue[Sample | None] = asyncio.Queue()
        call_id = uuid.uuid4().hex

        async def run_call() -> None:
            seeded = sampling.seed is not None
            # A seeded call runs alone, so that nothing else draws from the re-seeded RNG.
            async with self._gate.write() if seeded else self._gate.read():
                if not self.serving:
                    raise GenerateError(
                        grpc.StatusCode.UNAVAILABLE,
                        "the weights are in an unknown state after a failed swap; "
                        "send a complete weight update",
                    )
                version = self.policy_version
                if seeded:
                    # Requests queue while the scheduler is paused and are admitted together
                    # on resume: the same batches every time, drawing from a re-seeded RNG.
                    await self._llm.pause_generation(mode="keep", clear_cache=False)
                try:
                    async with asyncio.TaskGroup() as group:
                        for prompt_index, (prompt_id, token_ids) in enumerate(prompts):
                            for sample_index in range(sampling.n):
                                group.create_task(
                                    self._run_request(
                                        queue, params, call_id, version,
                                        prompt_index, prompt_id, list(token_ids), sample_index,
                                    )
                                )  # fmt: skip
                        if seeded:
                            await self._wait_admitted(len(prompts) * sampling.n)
                            await self._llm.collective_rpc(
                                "jaxrlhf_reseed", kwargs={"seed": sampling.seed % (1 << 63)}
                            )
                            await self._llm.resume_generation()
                            seeded = False
                        if on_admitted is not None:
                            await on_admitted(version)
                finally:
                    if seeded:
                        await self._llm.resume_generation()

        runner = asyncio.create_task(run_call())
        runner.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (sample := await queue.get()) is not None:
                yield sample
            error = runner.exception()
            if error is not None:
                raise _first_error(error)
        finally:
            if not runner.done():
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    async def _wait_admitted(self, count: int, timeout: float = 60.0) -> None:
        """Waits until `count` requests are queued in the engine."""
        deadline = time.monotonic() + timeout
        while self._llm.output_processor.get_num_unfinished_requests() < count:
            if time.monotonic() > deadline:
                raise GenerateError(grpc.StatusCode.INTERNAL, "requests were not admitted")
            await asyncio.sleep(0.002)

    async def _run_request(
        self,
        queue: asyncio.Queue,
        params,
        call_id: str,
        version: int,
        prompt_index: int,
        prompt_id: str,
        token_ids: list[int],
        sample_index: int,
    ) -> None:
        from vllm.inputs import tokens_input

        request_id = f"{call_id}-{prompt_index}-{sample_index}"
        final = None
        async for output in self._llm.generate(tokens_input(token_ids), params, request_id):
            final = output
        if final is None or not final.outputs:
            raise GenerateError(grpc.StatusCode.INTERNAL, f"no output for request {request_id}")
        completion = final.outputs[0]
        if completion.finish_reason == "abort":
            raise GenerateError(grpc.StatusCode.UNAVAILABLE, "the engine aborted the request")
        spans = completion.weight_versions or []
        if any(span.version != str(version) for span in spans):
            # The gate makes this impossible; never hand out a wrongly tagged completion.
            raise GenerateError(
                grpc.StatusCode.INTERNAL,
                f"request {request_id} tagged version {version} ran on weight versions "
                f"{[(s.version, s.start, s.end) for s in spans]}",
            )
        tokens = list(completion.token_ids)
        step_logprobs = completion.logprobs or []
        queue.put_nowait(
            Sample(
                prompt_index=prompt_index,
                prompt_id=prompt_id,
                sample_index=sample_index,
                token_ids=tokens,
                logprobs=[
                    step[token].logprob for token, step in zip(tokens, step_logprobs, strict=True)
                ],
                finish_reason=completion.finish_reason or "",
                policy_version=version,
            )
        )

    async def swap_weights(
        self,
        staging_path: str,
        tensors: list[StagedTensor],
        policy_version: int,
        allow_rollback: bool = False,
    ) -> float:
        """Loads a validated, complete update staged in `staging_path` as `policy_version`;
        returns the seconds generation was paused. Only the reload runs with the gate closed."""
        async with self._gate.write():
            return await self._reload(staging_path, tensors, policy_version, allow_rollback)

    async def _reload(
        self,
        staging_path: str,
        tensors: list[StagedTensor],
        policy_version: int,
        allow_rollback: bool,
    ) -> float:
        if policy_version <= self.policy_version and not allow_rollback:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"policy_version {policy_version} is not newer than the served version "
                f"{self.policy_version}",
            )
        started = time.monotonic()
        # The gate already drained our calls; "wait" also covers anything else in the engine.
        await self._llm.pause_generation(mode="wait")
        try:
            manifest = [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]
            await self._llm.collective_rpc(
                "jaxrlhf_reload_weights", kwargs={"path": staging_path, "tensors": manifest}
            )
            await self._llm.reset_prefix_cache()
            await self._llm.update_weight_version(str(policy_version))
        except Exception as error:
            self.serving = False
            logger.exception("weight reload failed")
            raise WeightUpdateError(
                grpc.StatusCode.INTERNAL,
                f"the engine failed while loading policy_version {policy_version}: {error}; "
                "its weights are now in an unknown state and it reports NOT_SERVING until a "
                "complete update succeeds",
            ) from error
        finally:
            await self._llm.resume_generation()
        self.policy_version = policy_version
        self.serving = True
        self.num_updates += 1
        self.last_update_unix_time = time.time()
        return time.monotonic() - started

    def shutdown(self) -> None:
        """Stops the engine processes. Drops our reference at once so that AsyncLLM.__del__
        (which shuts down again) runs now, not during interpreter teardown where it fails."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            del llm
            gc.collect()


def _first_error(error: BaseException) -> BaseException:
    """The first leaf of a TaskGroup's exception group, mapped to a GenerateError if unknown."""
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    if isinstance(error, GenerateError):
        return error
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    if isinstance(error, VLLMClientError):
        return GenerateError(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    if isinstance(error, EngineDeadError):
        return GenerateError(grpc.StatusCode.UNAVAILABLE, f"the engine died: {error}")
    return GenerateError(grpc.StatusCode.INTERNAL, f"{type(error).__name__}: {error}")
