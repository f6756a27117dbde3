"""Preloading control, from the engine's side: begin, feed, wait for and drop the preload that the
engine's workers build of an update (worker_preload.py runs inside them, reached by collective_rpc).

- A preload is begun before any of its tensors has come, naming them all (`begin`); each tensor is
  handed in once its bytes are all in the update file (`feed`, feed.py); the swap then waits
  until every worker has preloaded the whole update (`wait_preloaded`) and commits it in its pause
  (swap.py). A preload is numbered: a worker that holds another one, or none, fails the feed.
- One preload at a time: beginning one drops the last in the workers, and a swap drops its preload
  when it ends, whatever its outcome (`drop`, which never raises: a dead engine is reported by
  the server's watchdog).
- A preload that fails changes nothing live: the update is refused (INTERNAL) and the served
  weights keep serving. The worker's error (an exception of torch or vLLM) goes to the log only.
- A model that cannot be preloaded (a worker says "unsupported") turns preloading off for the
  engine's lifetime (`unsupported` says why; GetStatus reports it): its updates are then
  reloaded in the pause.
- While the swap waits, the tokens generated meanwhile are counted from when the preload began
  (`preload_tokens`), and the workers are asked every `PRELOAD_POLL_SECONDS[0]` s at first, less
  and less often down to every `PRELOAD_POLL_SECONDS[1]` s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import grpc

from generator_service.status import Served, TokenCounter
from generator_service.updates.tensors import PreloadTensor, WeightUpdateError

logger = logging.getLogger(__name__)

# Each ask is an RPC through the engine's loop, which costs CPU that the preloading thread would
# otherwise have.
PRELOAD_POLL_SECONDS = (0.005, 0.05)


def manifest(tensors: list[PreloadTensor]) -> list:
    """The tensors as the worker's RPCs take them: [name, wire dtype, shape, byte position]."""
    return [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]


class PreloadControl:
    """The preloads of one engine's updates (module docstring)."""

    def __init__(self, llm, served: Served, preload: bool, threads: int) -> None:
        self._llm = llm
        self._served = served
        self._preload = preload  # EngineConfig.preload
        self._threads = threads  # EngineConfig.preload_threads
        self.unsupported = ""  # why this engine's updates cannot be preloaded ("" : they can)
        self._last_id = 0  # the number of the last preload begun
        self._tokens: TokenCounter | None = None  # since the current preload began

    @property
    def enabled(self) -> bool:
        """Whether updates are preloaded (`EngineConfig.preload`, and the model can be)."""
        return self._preload and not self.unsupported

    async def begin(self, expected: Sequence[str]) -> int:
        """Begins preloading an update of the tensors named `expected` before any of them has
        come: `feed` then hands in each tensor once its bytes are in the update file, and
        `wait_preloaded` waits for the rest. Returns the preload's number, or 0 when this engine
        does not preload (nothing begun)."""
        if not self.enabled:
            return 0
        self._last_id += 1
        reasons = await self._llm.collective_rpc(
            "jaxrlhf_begin_preload",
            kwargs={"expected": list(expected), "threads": self._threads,
                    "preload_id": self._last_id},
        )  # fmt: skip
        if any(reasons):
            await self._turn_off([*filter(None, reasons)][0])
            return 0
        self._tokens = TokenCounter(self._llm.output_processor.request_states)
        return self._last_id

    async def feed(self, preload_id: int, path: str, tensors: list[PreloadTensor]) -> None:
        """Hands preload `preload_id` these complete tensors of `path` (`begin`); raises
        RuntimeError when a worker no longer has that preload (dropped, or another begun)."""
        fed = await self._llm.collective_rpc(
            "jaxrlhf_feed_preload",
            kwargs={"path": path, "tensors": manifest(tensors), "preload_id": preload_id},
        )
        if not all(fed):
            raise RuntimeError(f"preload {preload_id} is gone from a worker; nothing was fed")

    async def wait_preloaded(
        self, path: str, tensors: list[PreloadTensor], policy_version: int, preload_id: int
    ) -> tuple[int, int]:
        """Goes on with the preload `begin` began as `preload_id` and fed (or, without one, begins
        a preload of the whole update in `path` and feeds it at once) and waits until every
        worker has it; returns (the preload's number, tokens generated meanwhile). (0, 0): this
        model cannot be preloaded (logged once; it is then reloaded in the pause). Raises
        WeightUpdateError if the preload fails, or a worker has another preload or none."""
        if not preload_id:
            preload_id = await self.begin([t.name for t in tensors])
            if not preload_id:
                return 0, 0
            await self.feed(preload_id, path, tensors)
        tokens = self._tokens or TokenCounter(self._llm.output_processor.request_states)
        poll = PRELOAD_POLL_SECONDS[0]
        while True:
            statuses = await self._llm.collective_rpc(
                "jaxrlhf_preload_status", kwargs={"preload_id": preload_id}
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
                _log_preloaded(policy_version, statuses, generated)
                return preload_id, generated
            await asyncio.sleep(poll)
            poll = min(2 * poll, PRELOAD_POLL_SECONDS[1])

    def _failed(self, policy_version: int, error: str) -> WeightUpdateError:
        # The worker's error (an exception of torch or vLLM) is for the log only.
        logger.error("preloading policy_version %d failed: %s", policy_version,
                     error or "the preload was gone")  # fmt: skip
        return WeightUpdateError(
            grpc.StatusCode.INTERNAL,
            f"preloading policy_version {policy_version} failed in the engine's worker "
            "(see the server's log); the served weights (policy_version "
            f"{self._served.policy_version}) are unchanged",
        )

    async def _turn_off(self, reason: str) -> None:
        """This model cannot be preloaded: its updates are reloaded in the pause from now on."""
        await self.drop()
        self.unsupported = reason
        logger.warning("preloaded swaps are off: %s", reason)

    async def drop(self) -> None:
        """Stops and frees a preloaded or preloading update, if any."""
        self._tokens = None
        try:
            await self._llm.collective_rpc("jaxrlhf_drop_preloaded")
        except Exception:  # noqa: BLE001 - the engine's watchdog reports a dead engine
            logger.exception("dropping a preloaded update failed")


def _log_preloaded(policy_version: int, statuses: list[dict], generated: int) -> None:
    logger.info(
        "policy_version %d preloaded in %.3fs (load %.3fs, process %.3fs, waiting for "
        "tensors %.3fs) while %d tokens were generated",
        policy_version,
        max(s["seconds"] for s in statuses),
        max(s.get("load", 0.0) for s in statuses),
        max(s.get("process", 0.0) for s in statuses),
        max(s.get("wait", 0.0) for s in statuses),
        generated,
    )
