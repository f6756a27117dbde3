"""Weight swaps: a validated, complete update put live as a new version, and the pause that it
takes. Two swap modes (`SWAP_MODES`, `EngineConfig.swap_mode`):

- "drain": the swap takes the `VersionGate` as its writer: new Generate calls wait at the gate,
  and the swap waits until the engine has finished every request of the calls inside (a call
  never spans a swap). The pause is that wait, the load and the relabelling.
- "in-flight": calls hold the gate only while their requests are handed to the engine. The
  swap pauses the scheduler with running requests frozen in place
  (`pause_generation(mode="keep")`), loads, relabels and resumes: they continue on the new
  weights. Their KV cache (`IN_FLIGHT_KV`) is kept ("keep": entries computed with the older
  weights stay, as PipelineRL does) or recomputed ("recompute": every running request is
  preempted and re-prefilled, prompt and tokens so far, with the new weights).

In both, the load is a commit of the preloaded update (engine_preload.py, worker_preload.py:
converted while generation went on) or, when the update is not preloaded, vLLM's in-place reload
from the update's file (the update file, or the learner's shared file). The engine's weights are
then labelled with the version (`update_weight_version`: vLLM's weight-version spans tag every token
after it), and the prefix cache is reset where nothing holds it (with requests running and their KV
kept it cannot be; the salts of calls.py keep its old entries from matching new requests).

Rules:

- An update that is not newer than the served version (and no rollback) is refused before
  anything else, and again at the start of the pause: it never touches the engine, and running
  requests never notice it. A preload that fails is refused with the served weights untouched.
- A swap that fails while loading leaves the weights in an unknown state: the engine then
  aborts every running request (in-flight mode) rather than continue it, and `Served.serving`
  stays False (NOT_SERVING, new calls refused) until a complete update succeeds.
- A swap cancelled (its client's cancel or deadline) before its pause leaves everything as it
  was; once the pause has begun the swap runs to its end (`finish_despite_cancellation`), and
  the cancellation is raised after. It never stops with the scheduler paused, nor with new or
  partial weights serving under the old version.
- The preload a swap preloaded with is dropped when the swap ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from generator_service import failpoints
from generator_service.gate import VersionGate
from generator_service.status import Occupancy, Served, SwapTimes
from generator_service.updates.engine_preload import PreloadControl, manifest
from generator_service.updates.tensors import PreloadTensor, WeightUpdateError

logger = logging.getLogger(__name__)


class Swaps:
    """The swaps of one engine (module docstring)."""

    def __init__(self, llm, gate: VersionGate, served: Served, occupancy: Occupancy,
                 preloads: PreloadControl, in_flight: bool, in_flight_kv: str) -> None:  # fmt: skip
        self._llm = llm
        self._gate = gate
        self._served = served
        self._occupancy = occupancy
        self._preloads = preloads
        self._in_flight = in_flight
        self._recompute = in_flight and in_flight_kv == "recompute"

    async def swap_weights(
        self,
        update_path: str,
        tensors: list[PreloadTensor],
        policy_version: int,
        allow_rollback: bool = False,
        preload_id: int = 0,
        update_id: str = "",
    ) -> SwapTimes:
        """Loads a validated, complete update preloaded in `update_path` as `policy_version`,
        recorded with its sender's `update_id` once live.

        Preloaded (`EngineConfig.preload`, see worker_preload.py): the update is first converted
        into the engine's layout while generation goes on, then committed in the pause; with
        `preload_id`, the preload `PreloadControl.begin` began, fed every one of `tensors`.
        `pause_seconds`: in "drain" mode from when new calls were held at the gate, through the
        drain and the commit (or load); in "in-flight" mode the commit (or load). Cancellation
        and failures: the module docstring."""
        preloading = self._preloads.enabled or preload_id != 0
        preloaded, preload_seconds, preload_tokens = 0, 0.0, 0
        try:
            self._check_newer(policy_version, allow_rollback)
            if preloading:
                started = time.monotonic()
                preloaded, preload_tokens = await self._preloads.wait_preloaded(
                    update_path, tensors, policy_version, preload_id
                )
                preload_seconds = time.monotonic() - started
            started = time.monotonic()
            async with self._gate.write():
                load = self._load_in_pause(
                    update_path, manifest(tensors), policy_version, allow_rollback, preloaded,
                    update_id,
                )  # fmt: skip
                await finish_despite_cancellation(asyncio.ensure_future(load))
            pause_seconds = time.monotonic() - started
        finally:
            if preloading:  # (also when cancelled or refused while preloading)
                await finish_despite_cancellation(asyncio.ensure_future(self._preloads.drop()))
        return SwapTimes(preload_seconds, pause_seconds, preload_tokens)

    def _check_newer(self, policy_version: int, allow_rollback: bool) -> None:
        check_newer(self._served, policy_version, allow_rollback)

    async def _load_in_pause(
        self, path: str, tensors: list, policy_version: int, allow_rollback: bool, preloaded: int,
        update_id: str,
    ) -> None:  # fmt: skip
        """Loads the update in the pause: commits preload `preloaded` (0: reloads `tensors`, the
        worker's manifest, from `path`)."""
        self._check_newer(policy_version, allow_rollback)
        await self._hold(failpoints.hit("pause_for_swap"))  # (chaos tests only)
        # "drain": the gate already drained our calls; "wait" also covers anything else in the
        # engine. "in-flight": running requests stay where they are, frozen.
        await self._llm.pause_generation(
            mode="keep" if self._in_flight else "wait", clear_cache=False
        )
        self._occupancy.paused(True)
        try:
            if preloaded:
                await self._llm.collective_rpc(
                    "jaxrlhf_commit_preloaded", kwargs={"preload_id": preloaded}
                )
            else:
                await self._llm.collective_rpc(
                    "jaxrlhf_reload_weights", kwargs={"path": path, "tensors": tensors}
                )
            await self._hold(failpoints.hit("reload_weights"))  # (chaos tests only)
            if self._recompute or self._llm.get_num_unfinished_requests() == 0:
                # (With requests running and their KV kept, blocks are in use and the cache
                # cannot be reset; the salts keep its old entries from matching new requests.)
                await self._llm.reset_prefix_cache(reset_running_requests=self._recompute)
            await self._llm.update_weight_version(str(policy_version))
        except Exception as error:
            raise await self._failed(policy_version) from error
        finally:
            self._occupancy.paused(False)
            await self._llm.resume_generation()
        self._served.swapped_in(policy_version, update_id)

    async def _failed(self, policy_version: int) -> WeightUpdateError:
        """After a load that failed: NOT_SERVING, and (in-flight) no request goes on."""
        self._served.serving = False
        logger.exception("weight reload failed")
        if self._in_flight:
            # Running requests must not go on with weights in an unknown state.
            await self._llm.pause_generation(mode="abort", clear_cache=False)
        return WeightUpdateError(
            grpc.StatusCode.INTERNAL,
            f"the engine failed while loading policy_version {policy_version} (see the "
            "server's log); its weights are now in an unknown state and it reports "
            "NOT_SERVING until a complete update succeeds",
        )

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


def check_newer(served: Served, policy_version: int, allow_rollback: bool) -> None:
    """FAILED_PRECONDITION for an update not newer than the served version (and no rollback)."""
    if policy_version <= served.policy_version and not allow_rollback:
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"policy_version {policy_version} is not newer than the served version "
            f"{served.policy_version}",
        )


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
