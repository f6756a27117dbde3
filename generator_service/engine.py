"""The engine of the service: one vLLM `AsyncLLM`, and `GeneratorEngine`, the façade the server
talks to. Validated requests go in, version-tagged samples come out, and weight updates are
swapped in.

`GeneratorEngine` owns the AsyncLLM, the record of the served weights (`Served`) and the
`VersionGate` that orders calls and swaps, and hands each job to the module that holds its
rules:

| job | module |
|---|---|
| Generate calls: admission, submission, samples, the version of every token | calls.py |
| swaps: the pause ("drain" or "in-flight"), a failed or cancelled swap | updates/swap.py |
| "lora" mode: adapters loaded, served, held by calls and unloaded | updates/adapters.py |
| preloads: begin, feed, wait for and drop one; preloading off | updates/engine_preload.py |
| what it reports: the served version, occupancy, a swap's times | status.py |
| its settings, and how vLLM is started from them | engine_config.py |

It is created inside the server's loop, labelled with version 0 (`start`), and stopped by the
server (`shutdown`).
"""

from __future__ import annotations

import gc
import logging

# tests/rl/test_batch.py (outside this package's tests) drives `engine.Occupancy` with a fake
# clock patched in through `engine.time`: kept reachable here for it.
import time  # noqa: F401
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from generator_service.calls import Calls, Sample
from generator_service.engine_config import (
    EngineConfig,
    default_update_dir,
    open_llm,
    served_weight_specs,
)
from generator_service.gate import VersionGate
from generator_service.requests import Sampling
from generator_service.status import Occupancy, Served, SwapTimes
from generator_service.updates.adapter import LoraSettings, update_specs
from generator_service.updates.adapters import AdapterSwaps, adapters_root
from generator_service.updates.engine_preload import PreloadControl
from generator_service.updates.swap import Swaps
from generator_service.updates.tensors import PreloadTensor, TensorSpec

logger = logging.getLogger(__name__)

# How long a stopping service waits for its engine processes before killing them. vLLM's own
# default (5 s) is mostly spent after the work is done: its worker lingers ~3 s after its
# queues close, then the engine core ~2 s more until it is killed anyway.
ENGINE_STOP_TIMEOUT_S = 1.0


class GeneratorEngine:
    """The engine's jobs behind one face (module docstring); created inside the server's loop."""

    def __init__(self, config: EngineConfig) -> None:
        import vllm
        from vllm.platforms import current_platform

        self.config = config
        self.vllm_version: str = vllm.__version__
        self._llm = open_llm(config)
        model_config = self._llm.model_config
        self.max_model_len: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.dtype: str = str(model_config.dtype).removeprefix("torch.")
        self.update_dir = config.update_dir or default_update_dir()
        self.weight_specs, self.weight_specs_error = served_weight_specs(config.model)
        # The engine's own limit on requests generating at once.
        self.max_num_seqs: int = self._llm.vllm_config.scheduler_config.max_num_seqs
        self.occupancy = Occupancy(self.max_num_seqs)
        self._served = Served()
        self._gate = VersionGate()
        self._preloads = PreloadControl(
            self._llm, self._served, config.preload, config.preload_threads
        )
        self._swaps = Swaps(self._llm, self._gate, self._served, self.occupancy, self._preloads,
                            config.in_flight, config.in_flight_kv)  # fmt: skip
        self.adapters = None  # "lora" mode's AdapterSwaps
        if config.lora:
            self.adapters = AdapterSwaps(self._llm, self._served, adapters_root(self.update_dir),
                                         config.model)  # fmt: skip
        self._calls = Calls(
            self._llm, self._gate, self._served, self.occupancy,
            in_flight=config.in_flight, in_flight_kv=config.in_flight_kv,
            # vLLM 0.32's CPU backend fails a step (the engine dies: "CPU Generator does not
            # use offset") when a request with its own seed is in a prefill that chunked
            # prefill split (seen on SmolLM2 with ~40 requests at once); short prompts alone
            # never hit it.
            per_request_seeds=not current_platform.is_cpu(),
            adapters=self.adapters,
        )  # fmt: skip

    async def start(self) -> None:
        """Labels the engine's weights with version 0 (vLLM's weight-version spans)."""
        await self._llm.update_weight_version(str(self.policy_version))

    @property
    def dead(self) -> bool:
        """Whether vLLM's engine died (a worker or the engine core process is gone)."""
        return self._llm.errored

    @property
    def policy_version(self) -> int:
        return self._served.policy_version

    @property
    def update_id(self) -> str:
        """The sender's name for the update that put the served weights in place ("" when
        unnamed, or while they are unknown)."""
        return self._served.update_id if self._served.serving else ""

    @property
    def serving(self) -> bool:
        """False after a swap that failed half-way, until a complete update succeeds."""
        return self._served.serving

    @property
    def num_updates(self) -> int:
        return self._served.num_updates

    @property
    def last_update_unix_time(self) -> float:
        return self._served.last_update_unix_time

    @property
    def num_requests_running(self) -> int:
        return self._llm.get_num_unfinished_requests()

    @property
    def num_calls_waiting(self) -> int:
        return self._calls.num_waiting

    @property
    def swap_pending(self) -> bool:
        return self._gate.writer_pending

    @property
    def in_flight(self) -> bool:
        return self.config.in_flight

    @property
    def preloads(self) -> bool:
        """Whether updates are preloaded (`EngineConfig.preload`, and the model can be)."""
        return self._preloads.enabled

    @property
    def preload_unsupported(self) -> str:
        """Why this engine's updates cannot be preloaded (they are then reloaded in the pause)."""
        return self._preloads.unsupported

    @property
    def adapter_versions(self) -> list[int]:
        """In "lora" mode, the versions of the adapters loaded now (else empty)."""
        return [] if self.adapters is None else self.adapters.versions

    def update_specs(self, lora: LoraSettings | None) -> dict[str, TensorSpec]:
        """The tensors an update must carry: the served model's, or (with `lora`, in "lora"
        mode) its adapter's; refusals as `adapter.update_specs`'s."""
        return update_specs(self.weight_specs, lora, self.config.max_lora_rank)

    def validate(self, prompts: Sequence[tuple[str, Sequence[int]]], sampling: Sampling) -> None:
        """Raises GenerateError(INVALID_ARGUMENT) naming the first problem found, or
        FAILED_PRECONDITION for what this engine cannot do."""
        self._calls.validate(prompts, sampling, self.vocab_size, self.max_model_len)

    def generate(
        self,
        prompts: Sequence[tuple[str, Sequence[int]]],
        sampling: Sampling,
        on_admitted: Callable[[int], Awaitable[None]] | None = None,
    ) -> AsyncIterator[Sample]:
        """Samples in finishing order (`Calls.generate`); call `validate` first."""
        return self._calls.generate(prompts, sampling, on_admitted)

    async def swap_weights(
        self,
        update_path: str,
        tensors: list[PreloadTensor],
        policy_version: int,
        allow_rollback: bool = False,
        preload_id: int = 0,
        update_id: str = "",
        lora: LoraSettings | None = None,
    ) -> SwapTimes:
        """Loads a validated, complete update preloaded in `update_path` as `policy_version`
        (`Swaps.swap_weights`; an adapter with settings `lora`: `AdapterSwaps.swap`);
        `update_id` is recorded with the version."""
        if lora is not None:
            return await self.adapters.swap(
                update_path, tensors, lora, policy_version, allow_rollback, update_id
            )
        return await self._swaps.swap_weights(
            update_path, tensors, policy_version, allow_rollback, preload_id, update_id
        )

    async def begin_preload(self, expected: Sequence[str]) -> int:
        """Begins preloading an update of the tensors named `expected`; its number, or 0 when this
        engine does not preload (`PreloadControl.begin`)."""
        return await self._preloads.begin(expected)

    async def feed_preload(self, preload_id: int, path: str, tensors: list[PreloadTensor]) -> None:
        """Hands preload `preload_id` these complete tensors of `path` (`PreloadControl.feed`)."""
        await self._preloads.feed(preload_id, path, tensors)

    async def drop_preload(self) -> None:
        """Stops and frees a preloaded or preloading update, if any."""
        await self._preloads.drop()

    def shutdown(self, timeout: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Stops the engine processes: SIGTERM, and SIGKILL for those still there after
        `timeout` s. Drops every reference to the AsyncLLM at once (this one and its jobs')
        so that AsyncLLM.__del__ (which shuts down again) runs now, not during interpreter
        teardown where it fails."""
        llm, self._llm = self._llm, None
        if llm is not None:
            del self._calls, self._swaps, self._preloads  # they hold it too
            llm.shutdown(timeout=timeout)
            del llm
            gc.collect()
        if self.adapters is not None:
            self.adapters.close()
