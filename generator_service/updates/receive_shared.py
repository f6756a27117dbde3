"""An update that the learner wrote into a file of the server's shared folder
(UpdateWeightsShared): no bytes are received, the engine maps the learner's file directly.

- Only a peer on this host may send one (server.py checks), naming a file directly inside the
  shared folder (the update folder), whose layout is checked against the served model before
  the engine sees it (tensors.py: `shared_file_path`, `check_shared_layout`).
- One update at a time, under the same lock as streamed ones (apply.py).
- An adapter (SharedWeights.lora, "lora" mode) is laid out and checked as a streamed one: the
  tensors its settings call for (updates/adapter.py), then swapped in as an adapter
  (updates/adapters.py: its folder written from the file, `add_lora`, no pause); an update of
  the other kind than the server takes is refused (FAILED_PRECONDITION) before the file is
  read. A progressive adapter is followed as any progressive update, and loaded once every
  tensor is written (adapters are never preloaded).
- A `progressive` update is sent before the file is written: the learner counts the tensors
  written in the file's first bytes (`jaxrlhf_wire.files`; a count is read under the file's
  lock, never torn nor before the tensors it counts). The server reads the count every
  `PROGRESS_POLL_SECONDS[0]` s, doubling to `PROGRESS_POLL_SECONDS[1]` s while it stands
  still, and hands each written tensor to a preload begun at once (engine_preload.py), so the
  update is preloaded as it is written.
- Following a progressive update, the update is refused: ABORTED when the learner gave up
  writing, or when the count stood still for `senders_timeout` seconds (a stall is transient:
  the learner fails the replica and brings it back, where a precondition would end its run);
  INVALID_ARGUMENT when the count shrinks or passes the tensors listed. A preload that cannot
  begin, or whose feed fails, is dropped: the swap then preloads from scratch.
- A preload begun for the update and not handed to its swap is dropped when the update ends.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass

import grpc

from generator_service import failpoints
from generator_service.status import SwapTimes
from generator_service.updates.adapter import LoraSettings
from generator_service.updates.apply import Applied, UpdateApplier
from generator_service.updates.swap import finish_despite_cancellation
from generator_service.updates.tensors import (
    PreloadTensor,
    WeightUpdateError,
    check_progress_page,
    check_shared_layout,
    shared_file_path,
    shared_file_size,
)
from jaxrlhf_wire.files import PROGRESS_ABANDONED, read_progress_count

logger = logging.getLogger(__name__)

PROGRESS_POLL_SECONDS = (0.001, 0.02)


@dataclass(frozen=True)
class SharedFile:
    """An UpdateWeightsShared request (server.py translates the message)."""

    path: str
    tensors: list[tuple[str, str, tuple[int, ...], int]]  # (name, dtype, shape, byte position)
    policy_version: int
    allow_rollback: bool
    progressive: bool
    update_id: str
    lora: LoraSettings | None = None  # set: the update is an adapter ("lora" mode)


class SharedUpdates:
    """Swaps in updates written into shared files (module docstring)."""

    def __init__(self, applier: UpdateApplier, senders_timeout: float) -> None:
        self._applier = applier
        self._engine = applier.engine
        self._senders_timeout = senders_timeout

    async def apply(self, request: SharedFile) -> Applied:
        """The update of `request` checked and swapped in; raises WeightUpdateError when it is
        refused (or fails: INTERNAL, naming no internals of the server's)."""
        async with self._applier.lock:
            started = time.monotonic()
            try:
                path, tensors, swap = await self._swap(request, started)
            except WeightUpdateError as error:
                logger.warning("shared weight update refused: %s", error.message)
                raise
            except Exception:
                logger.exception("shared weight update of policy_version %d failed",
                                 request.policy_version)  # fmt: skip
                raise self._applier.internal_error(request.policy_version) from None
            finally:
                await self._applier.publish_health()
        seconds = time.monotonic() - started
        num_bytes = sum(tensor.nbytes for tensor in tensors)
        logger.info(
            "policy_version %d live: %s%d tensors, %d bytes from shared file %s%s, %.2fs "
            "(preloaded by %.2fs, paused %.2fs)",
            request.policy_version,
            "adapter, " if request.lora else "",
            len(tensors),
            num_bytes,
            path,
            " (preloaded as written)" if request.progressive else "",
            seconds,
            swap.preload_seconds,
            swap.pause_seconds,
        )
        return Applied(request.policy_version, len(tensors), num_bytes, seconds, swap)

    async def _swap(
        self, request: SharedFile, started: float
    ) -> tuple[str, list[PreloadTensor], SwapTimes]:
        """Under the update lock: the file checked (and followed, when progressive) and
        swapped in; (its path, its tensors, the swap's times)."""
        engine = self._engine
        specs = engine.update_specs(request.lora)  # an adapter's, in "lora" mode
        path = shared_file_path(request.path, engine.update_dir)
        tensors = check_shared_layout(
            specs,
            engine.policy_version,
            request.policy_version,
            request.tensors,
            shared_file_size(path),
            request.allow_rollback,
        )
        preload_id = 0
        try:
            if request.progressive:
                check_progress_page(tensors)
                if engine.preloads:
                    try:
                        preload_id = await engine.begin_preload([t.name for t in tensors])
                    except Exception:  # noqa: BLE001 - preloaded after the writes instead
                        logger.exception("beginning a preload failed")
                preload_id = await self._follow(path, tensors, preload_id, request.policy_version)
            checked_seconds = time.monotonic() - started
            failpoints.hit("update_weights")  # (chaos tests only)
            handed, preload_id = preload_id, 0  # the swap drops it from here on
            swap = await self._applier.apply(
                path, tensors, request.policy_version, request.allow_rollback, handed,
                request.update_id, checked_seconds, lora=request.lora,
            )  # fmt: skip
        finally:
            if preload_id:  # begun, and the update ended before its swap
                await finish_despite_cancellation(asyncio.ensure_future(engine.drop_preload()))
        return path, tensors, swap

    async def _follow(self, path: str, tensors: list, preload_id: int, version: int) -> int:
        """Until the learner has written every tensor of a progressive shared update, handing
        each written tensor to preload `preload_id` (0: none); returns the preload, or 0 when
        feeding it failed (it is then dropped, and the swap preloads from scratch). Raises
        WeightUpdateError as the module docstring says, or when the file cannot be read."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as error:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION, f"the shared file cannot be read: {error}"
            ) from error
        try:
            fed, moved, poll = 0, time.monotonic(), PROGRESS_POLL_SECONDS[0]
            while fed < len(tensors):
                count = _written(fd, fed, len(tensors), version)
                if count > fed:
                    if preload_id:
                        preload_id = await self._feed(preload_id, path, tensors[fed:count])
                    fed, moved, poll = count, time.monotonic(), PROGRESS_POLL_SECONDS[0]
                elif time.monotonic() - moved > self._senders_timeout:
                    raise WeightUpdateError(
                        grpc.StatusCode.ABORTED,
                        f"the shared file of policy_version {version} gained no tensor for "
                        f"{self._senders_timeout:g} s ({fed} of {len(tensors)} written): "
                        "the learner's writes stalled; the update is refused, the served "
                        "weights are unchanged, and it may be sent again",
                    )
                else:
                    await asyncio.sleep(poll)
                    poll = min(2 * poll, PROGRESS_POLL_SECONDS[1])
        finally:
            os.close(fd)
        return preload_id

    async def _feed(self, preload_id: int, path: str, tensors: list) -> int:
        """`tensors` handed to preload `preload_id`; the preload, or 0 when that failed
        (dropped)."""
        try:
            await self._engine.feed_preload(preload_id, path, tensors)
        except Exception:  # noqa: BLE001 - the swap preloads from scratch
            logger.exception("feeding the preload failed")
            await finish_despite_cancellation(asyncio.ensure_future(self._engine.drop_preload()))
            return 0
        return preload_id


def _written(fd: int, fed: int, total: int, version: int) -> int:
    """The count of tensors written that the shared file open as `fd` holds now (`fed`, the
    last count read, while a store holds the lock: no news yet); `total` tensors are listed."""
    try:
        count = read_progress_count(fd)
    except OSError as error:
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the shared file's count cannot be read: {error}",
        ) from error
    if count is None:
        return fed
    if count == PROGRESS_ABANDONED:
        raise WeightUpdateError(
            grpc.StatusCode.ABORTED,
            f"the learner gave up writing policy_version {version} into the shared "
            f"file after {fed} of {total} tensors; the served weights are unchanged",
        )
    if not fed <= count <= total:
        raise WeightUpdateError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the shared file's count of written tensors is {count}, after "
            f"{fed}, of {total}: a count only grows, up to the tensors listed",
        )
    return count
