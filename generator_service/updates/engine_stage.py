"""Staging control, from the engine's side: begin, feed, wait for and drop the stage that the
engine's workers build of an update (worker_stage.py runs inside them, reached by collective_rpc).

- A stage is begun before any of its tensors has come, naming them all (`begin`); each tensor is
  handed in once its bytes are all in the staging file (`feed`, feed.py); the swap then waits
  until every worker has staged the whole update (`wait_staged`) and commits it in its pause
  (swap.py). A stage is numbered: a worker that holds another one, or none, fails the feed.
- One stage at a time: beginning one drops the last in the workers, and a swap drops its stage
  when it ends, whatever its outcome (`drop`, which never raises: a dead engine is reported by
  the server's watchdog).
- A stage that fails changes nothing live: the update is refused (INTERNAL) and the served
  weights keep serving. The worker's error (an exception of torch or vLLM) goes to the log only.
- A model that cannot be staged (a worker says "unsupported") turns staging off for the
  engine's lifetime (`unsupported` says why; GetStatus reports it): its updates are then
  reloaded in the pause.
- While the swap waits, the tokens generated meanwhile are counted from when the stage began
  (`stage_tokens`), and the workers are asked every `STAGE_POLL_SECONDS[0]` s at first, less
  and less often down to every `STAGE_POLL_SECONDS[1]` s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from generator_service.status import Served, TokenCounter
from generator_service.updates.tensors import StagedTensor, WeightUpdateError

logger = logging.getLogger(__name__)

# Each ask is an RPC through the engine's loop, which costs CPU that the staging thread would
# otherwise have.
STAGE_POLL_SECONDS = (0.005, 0.05)


def manifest(tensors: list[StagedTensor]) -> list:
    """The tensors as the worker's RPCs take them: [name, wire dtype, shape, byte position]."""
    return [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]


class StageControl:
    """The stages of one engine's updates (module docstring)."""

    def __init__(self, llm, served: Served, stage: bool, threads: int) -> None:
        self._llm = llm
        self._served = served
        self._stage = stage  # EngineConfig.stage
        self._threads = threads  # EngineConfig.stage_threads
        self.unsupported = ""  # why this engine's updates cannot be staged ("" : they can)
        self._last_id = 0  # the number of the last stage begun
        self._tokens: TokenCounter | None = None  # since the current stage began

    @property
    def enabled(self) -> bool:
        """Whether updates are staged (`EngineConfig.stage`, and the model can be)."""
        return self._stage and not self.unsupported

    async def begin(self, expected: Sequence[str]) -> int:
        """Begins staging an update of the tensors named `expected` before any of them has
        come: `feed` then hands in each tensor once its bytes are in the staging file, and
        `wait_staged` waits for the rest. Returns the stage's number, or 0 when this engine
        does not stage (nothing begun)."""
        if not self.enabled:
            return 0
        self._last_id += 1
        reasons = await self._llm.collective_rpc(
            "jaxrlhf_begin_stage",
            kwargs={"expected": list(expected), "threads": self._threads,
                    "stage_id": self._last_id},
        )  # fmt: skip
        if any(reasons):
            await self._turn_off([*filter(None, reasons)][0])
            return 0
        self._tokens = TokenCounter(self._llm.output_processor.request_states)
        return self._last_id

    async def feed(self, stage_id: int, path: str, tensors: list[StagedTensor]) -> None:
        """Hands stage `stage_id` these complete tensors of `path` (`begin`); raises
        RuntimeError when a worker no longer has that stage (dropped, or another begun)."""
        fed = await self._llm.collective_rpc(
            "jaxrlhf_feed_stage",
            kwargs={"path": path, "tensors": manifest(tensors), "stage_id": stage_id},
        )
        if not all(fed):
            raise RuntimeError(f"stage {stage_id} is gone from a worker; nothing was fed")

    async def wait_staged(
        self, path: str, tensors: list[StagedTensor], policy_version: int, stage_id: int
    ) -> tuple[int, int]:
        """Goes on with the stage `begin` began as `stage_id` and fed (or, without one, begins
        a stage of the whole update in `path` and feeds it at once) and waits until every
        worker has it; returns (the stage's number, tokens generated meanwhile). (0, 0): this
        model cannot be staged (logged once; it is then reloaded in the pause). Raises
        WeightUpdateError if the stage fails, or a worker has another stage or none."""
        if not stage_id:
            stage_id = await self.begin([t.name for t in tensors])
            if not stage_id:
                return 0, 0
            await self.feed(stage_id, path, tensors)
        tokens = self._tokens or TokenCounter(self._llm.output_processor.request_states)
        poll = STAGE_POLL_SECONDS[0]
        while True:
            statuses = await self._llm.collective_rpc(
                "jaxrlhf_stage_status", kwargs={"stage_id": stage_id}
            )
            generated = tokens.update()
            unsupported = [s["error"] for s in statuses if s["state"] == "unsupported"]
            if unsupported:
                await self._turn_off(unsupported[0])
                return 0, 0
            failed = [s["error"] for s in statuses if s["state"] in ("failed", "none")]
            if failed:
                await self.drop()
                raise self._failed(policy_version, failed[0])
            if all(s["state"] == "done" for s in statuses):
                _log_staged(policy_version, statuses, generated)
                return stage_id, generated
            await asyncio.sleep(poll)
            poll = min(2 * poll, STAGE_POLL_SECONDS[1])

    def _failed(self, policy_version: int, error: str) -> WeightUpdateError:
        # The worker's error (an exception of torch or vLLM) is for the log only.
        logger.error("staging policy_version %d failed: %s", policy_version,
                     error or "the stage was gone")  # fmt: skip
        return WeightUpdateError(
            grpc.StatusCode.INTERNAL,
            f"staging policy_version {policy_version} failed in the engine's worker "
            "(see the server's log); the served weights (policy_version "
            f"{self._served.policy_version}) are unchanged",
        )

    async def _turn_off(self, reason: str) -> None:
        """This model cannot be staged: its updates are reloaded in the pause from now on."""
        await self.drop()
        self.unsupported = reason
        logger.warning("staged swaps are off: %s", reason)

    async def drop(self) -> None:
        """Stops and frees a staged or staging update, if any."""
        self._tokens = None
        try:
            await self._llm.collective_rpc("jaxrlhf_drop_staged")
        except Exception:  # noqa: BLE001 - the engine's watchdog reports a dead engine
            logger.exception("dropping a staged update failed")


def _log_staged(policy_version: int, statuses: list[dict], generated: int) -> None:
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
