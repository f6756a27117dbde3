"""An update that arrives as UpdateWeights streams: each stream's chunks checked and written
into the update file, the update swapped in when its last sender's stream ends, and one
answer for every sender.

- The streams of one update join it (join.py: who joins, the join timeout, the update
  lock). Under the lock, before any byte is received, the update gets its assembler, the
  update file (made by the first update; refused when the update cannot fit) and, when the
  engine preloads, a preload begun at once and fed as tensors complete (feed.py). A preload that
  cannot begin is not an error: the swap preloads from scratch after the stream.
- Every chunk must say the sender of its stream. A malformed chunk, an overlap or a refusal of
  any stream refuses the update; each sender is answered with that refusal, at its next chunk
  or at once when it waits.
- The last stream to end swaps the update in (apply.py); every sender gets its answer.
- An adapter (WeightChunk.lora, "lora" mode) is checked against the tensors its settings call
  for (updates/adapter.py) and swapped in as an adapter (updates/adapters.py); an update of the
  other kind than the server takes is refused before any byte is received.
- A sender's call cancelled after the swap's pause began: the swap ran to its end, the update
  is live and the other senders are told so (this call's timings are lost with it). Cancelled
  earlier (while sending, or waiting for the others or for the swap): the update is refused,
  ABORTED, and may be sent again.
- Before the lock is released, every write the update queued has settled, and a preload begun
  for it and not handed to a swap is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from generator_service import failpoints
from generator_service.updates.apply import Applied, UpdateApplier
from generator_service.updates.assemble import WeightAssembler
from generator_service.updates.bytes_file import UpdateFile, minimum_update_bytes
from generator_service.updates.feed import PreloadFeeder, write_and_feed
from generator_service.updates.join import Update, UpdateJoiner
from generator_service.updates.swap import finish_despite_cancellation
from generator_service.updates.tensors import WeightUpdateError
from jaxrlhf_wire.chunks import MalformedChunkError

logger = logging.getLogger(__name__)


class StreamedUpdates:
    """Receives UpdateWeights streams into updates and swaps them in (module docstring);
    `senders_timeout`: how long an update of several senders waits for all of them."""

    def __init__(self, applier: UpdateApplier, senders_timeout: float) -> None:
        self._applier = applier
        self._engine = applier.engine
        self._joiner = UpdateJoiner(applier.lock, senders_timeout, self._prepare, self._release)
        self._update_file: UpdateFile | None = None  # created by the first update

    async def receive(self, chunks) -> Applied:
        """One stream of `ReceivedChunk`s (`jaxrlhf_wire.chunks.decode_weight_chunk`): the
        whole update, or one sender's part of it; the update's answer. Raises
        WeightUpdateError or MalformedChunkError when the update is refused."""
        chunks = chunks.__aiter__()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise WeightUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT, "the weight stream was empty"
            ) from None
        update, sender = self._joiner.join(first.header)
        return await self._receive(update, sender, first, chunks)

    async def _receive(self, update: Update, sender: int, chunk, chunks) -> Applied:
        """One sender's stream into `update`; the update's answer (module docstring)."""
        swapping, updates_before = False, self._engine.num_updates
        try:
            await update.wait_ready()
            while chunk is not None:
                if (error := update.error()) is not None:
                    raise error
                await self._add(update, sender, chunk)
                chunk = await anext(chunks, None)
            if (error := update.error()) is not None:  # refused while this stream was ending
                raise error  # (its lock is released: it must never be swapped in)
            update.finished.add(sender)
            if not update.all_finished:
                return await asyncio.shield(update.result)
            swapping, updates_before = True, self._engine.num_updates
            applied = await self._swap(update)
            update.succeed(applied)
            return applied
        except MalformedChunkError as error:
            update.fail(WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, str(error)))
            raise update.error() from None
        except WeightUpdateError as error:
            update.fail(error)
            raise update.error() from None
        except asyncio.CancelledError:
            swapped = swapping and self._engine.num_updates > updates_before
            self._cancelled(update, sender, swapping, swapped)
            raise
        except Exception:
            # Every sender gets the same answer, which names no internals (the log has them).
            logger.exception("weight update of policy_version %d failed",
                             update.key.policy_version)  # fmt: skip
            update.fail(self._applier.internal_error(update.key.policy_version))
            raise update.error() from None

    async def _add(self, update: Update, sender: int, chunk) -> None:
        """One chunk of sender `sender`'s stream, checked and queued to be written (and fed)."""
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
        await write_and_feed(update.assembler, update.file, pieces, update.feeder)

    def _cancelled(self, update: Update, sender: int, swapping: bool, swapped: bool) -> None:
        """Sender `sender`'s call was cancelled; `swapped`: in the pause, which the swap
        finished (module docstring)."""
        if swapped:
            update.succeed(Applied(
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

    async def _prepare(self, update: Update) -> None:
        """Under the update lock, before any byte is received: the assembler and the update
        file of `update`, and its preload."""
        update.started = time.monotonic()
        specs = self._engine.update_specs(update.key.lora)  # an adapter's, in "lora" mode
        update.assembler = WeightAssembler(specs, self._engine.policy_version)
        if self._update_file is None:
            self._update_file = UpdateFile(self._engine.update_dir)
        self._update_file.check_space(minimum_update_bytes(specs))
        update.file = self._update_file
        if self._engine.preloads:
            # Preloaded as it arrives (generator_service/updates/feed.py).
            try:
                preload_id = await self._engine.begin_preload(list(specs))
            except Exception:  # noqa: BLE001 - preloaded after the stream instead
                logger.exception("beginning a preload failed")
                preload_id = 0
            if preload_id:
                path = self._update_file.path

                async def feed(tensors) -> None:
                    await self._engine.feed_preload(preload_id, path, tensors)

                update.preload_id, update.feeder = preload_id, PreloadFeeder(feed)

    async def _release(self, update: Update) -> None:
        """Before the update lock is released: every write `update` queued has settled, and
        a preload begun for it and not handed to a swap is dropped."""
        if update.file is not None:
            await update.file.settle()
        if update.feeder is not None:  # refused before its swap
            await update.feeder.abandon()
            update.feeder = None
            await self._engine.drop_preload()
        await self._applier.publish_health()

    async def _swap(self, update: Update) -> Applied:
        """The received update checked complete and swapped in."""
        assembler, update_file = update.assembler, update.file
        tensors = assembler.finish()
        await update_file.flush(assembler.file_bytes)
        received_seconds = time.monotonic() - update.started
        failpoints.hit("update_weights")  # (chaos tests only)
        preload_id = 0
        if update.feeder is not None:  # the preload goes to the swap, which drops it after
            fed = await update.feeder.close()
            if fed:
                preload_id = update.preload_id
            else:  # preloaded from scratch by the swap
                await finish_despite_cancellation(
                    asyncio.ensure_future(self._engine.drop_preload())
                )
            update.feeder = None  # (after the drop: if it is cancelled, `_release` drops it)
        swap = await self._applier.apply(
            update_file.path, tensors, assembler.policy_version, assembler.allow_rollback,
            preload_id, update.key.update_id, received_seconds, lora=update.key.lora,
        )  # fmt: skip
        seconds = time.monotonic() - update.started
        logger.info(
            "policy_version %d live: %d tensors, %d bytes in %d chunks from %d sender(s), "
            "%.2fs (received in %.2fs, preloaded by %.2fs, paused %.2fs)",
            assembler.policy_version,
            len(tensors),
            assembler.num_bytes,
            assembler.num_chunks,
            update.key.num_senders,
            seconds,
            received_seconds,
            swap.preload_seconds,
            swap.pause_seconds,
        )
        return Applied(assembler.policy_version, len(tensors), assembler.num_bytes, seconds, swap)

    def close(self) -> None:
        """Deletes the update file; call once the server has stopped."""
        if self._update_file is not None:
            self._update_file.close()
            self._update_file = None
