"""Preloading a streamed update while it is still arriving.

Without this, the engine's preload (worker_preload.py) starts when the last byte of an update has
come, and the update's time is the receive *plus* the preload. With it, the server begins the
preload before the first byte (`GeneratorEngine.begin_preload`, told every tensor the update will
carry), and a `PreloadFeeder` hands the engine each tensor as soon as all of its bytes are written
in the update file; the worker loads every layer whose tensors have all come while later layers are
still on the wire. The update is still all-or-nothing: the preload writes nothing live, the commit
waits for the update to be checked complete (`WeightAssembler.finish`), and an update refused
half-way drops its preload.

A tensor is complete when the assembler has counted all of its bytes (from every sender); its
bytes are in the file once the write of its last chunk has finished, and the update file
writes chunks one at a time in order, so that write finishing means every earlier one did.
The feeder sends what is ready in one RPC, and whatever completed meanwhile in the next.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable

from generator_service.updates.assemble import WeightAssembler
from generator_service.updates.bytes_file import UpdateFile
from generator_service.updates.tensors import PreloadTensor

logger = logging.getLogger(__name__)


class PreloadFeeder:
    """Feeds the tensors of one update to its preload (module docstring): `add` each tensor as it
    completes with the future of its last write, then `close` once the stream has ended."""

    def __init__(self, feed: Callable[[list[PreloadTensor]], Awaitable[None]]) -> None:
        self._feed = feed
        self._ready: deque[tuple[asyncio.Future, list[PreloadTensor]]] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self.error: BaseException | None = None  # why feeding stopped (the preload is then unfed)
        self.num_fed = 0
        self._task = asyncio.ensure_future(self._run())

    def add(self, tensors: list[PreloadTensor], written: asyncio.Future) -> None:
        """`tensors` are complete once `written` (the write of their last chunk) is done."""
        if tensors:
            self._ready.append((written, tensors))
            self._wake.set()

    async def close(self) -> bool:
        """Waits until everything added is fed (or feeding failed); True if all was fed."""
        self._closing = True
        self._wake.set()
        await asyncio.shield(self._task)
        return self.error is None

    async def abandon(self) -> None:
        """The update was refused: feeds nothing more than a feed already under way (its preload
        is dropped next, so the rest would be loaded for nothing)."""
        self._ready.clear()
        await self.close()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._ready:
                await asyncio.wait((self._ready[0][0],))
                batch: list[PreloadTensor] = []
                while self._ready and self._ready[0][0].done():
                    written, tensors = self._ready.popleft()
                    if written.cancelled() or written.exception() is not None:
                        # The update fails on that write too; nothing after it is fed.
                        self.error = RuntimeError("a write into the update file failed")
                        return
                    batch += tensors
                if not batch:  # (abandoned meanwhile)
                    continue
                try:
                    await self._feed(batch)
                except Exception as error:  # noqa: BLE001 - the swap then preloads from scratch
                    logger.warning("feeding the preload failed: %s", error)
                    self.error = error
                    return
                self.num_fed += len(batch)
            if self._closing:
                return


async def write_and_feed(
    assembler: WeightAssembler,
    update_file: UpdateFile,
    pieces: list,
    feeder: PreloadFeeder | None,
) -> None:
    """Writes the pieces of the chunk just added to `assembler` and hands `feeder` the tensors
    that chunk completed, to be fed once its own write is done. They are taken before the write
    can yield to another sender's stream: taken after, they could include a tensor that
    stream's next chunk completed, whose write is queued behind this one."""
    completed = assembler.take_completed()
    written = await update_file.write(pieces)
    if feeder is not None:
        feeder.add(completed, written)
