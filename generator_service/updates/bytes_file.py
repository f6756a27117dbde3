"""The file a streamed update is written into, chunk by chunk, where the assembler places
each chunk's bytes (assemble.py), then loaded by the engine.

The file is raw bytes, not safetensors: the engine gets each tensor's name, dtype, shape and
position with the reload (or preload) call, maps the file and loads views of it
(`worker_extension.py`). Pure Python (no torch).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import grpc

from generator_service.updates.tensors import TensorSpec, WeightUpdateError
from jaxrlhf_wire.dtypes import WIRE_DTYPES
from jaxrlhf_wire.files import create_owned_file, release_owned_file, remove_stale_files

logger = logging.getLogger(__name__)


def minimum_update_bytes(specs: dict[str, TensorSpec]) -> int:
    """The least space in the update file a complete update can take (every tensor in a 2-byte
    dtype)."""
    smallest = min(dtype.itemsize for dtype in WIRE_DTYPES.values())
    return sum(math.prod(spec.shape) * smallest for spec in specs.values())


class UpdateFile:
    """The file updates are written into chunk by chunk, at the positions given by
    `WeightAssembler.add`, then loaded by the engine; one update at a time.

    One file serves every update of a server: its pages stay allocated, and writing over them
    costs about half as much as writing into fresh ones (measured on tmpfs), at the price of
    keeping one copy of the model in the update folder between updates. Files left by servers
    that died are removed when a server creates its own (those whose lock no process holds:
    `jaxrlhf_wire.files`, whatever PID namespace the servers run in).

    Writes run in a thread of their own (`os.pwrite` releases the GIL), so that the next chunk
    is received while the last one is written; at most `max_pending` chunks wait to be written.
    A full disk (`ENOSPC` from pwrite, never a SIGBUS as with a mapped file) is answered with
    RESOURCE_EXHAUSTED.
    """

    PREFIX = "jaxrlhf-weights-"

    def __init__(self, directory: str, max_pending: int = 4) -> None:
        self.directory = directory
        try:
            remove_stale_files(directory, self.PREFIX)
            # Owned by a lock while this server lives (jaxrlhf_wire.files), not by its PID.
            fd, self.path, self._lock_fd = create_owned_file(directory, self.PREFIX)
        except OSError as error:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot create an update file in {directory}: {error.strerror}",
            ) from error
        self._fd: int | None = fd
        self._max_pending = max_pending
        self._pending: deque[asyncio.Future] = deque()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-file")

    def check_space(self, min_bytes: int) -> None:
        """Refuses an update that cannot fit, before any of it is received."""
        free = shutil.disk_usage(self.directory).free + os.fstat(self._fd).st_size
        if free < min_bytes:
            raise WeightUpdateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"writing the update needs at least {min_bytes} bytes free in "
                f"{self.directory}, which has {free}",
            )

    async def write(self, pieces: list[tuple[int, memoryview]]) -> asyncio.Future:
        """Queues each (position, bytes) of one chunk to be written; waits while too many
        chunks' writes are queued. Returns the write's future (the writes run one at a time,
        in order: when one is done, so are all queued before it)."""
        loop = asyncio.get_running_loop()
        written = loop.run_in_executor(self._writer, self._write, pieces)
        self._pending.append(written)
        while len(self._pending) > self._max_pending:
            await self._next_done()
        return written

    async def flush(self, size: int) -> None:
        """Waits until every queued write is in the file, and sets its size to `size` (the end
        of the update's last region: what a larger earlier update left beyond it goes)."""
        while self._pending:
            await self._next_done()
        os.ftruncate(self._fd, size)

    async def settle(self) -> None:
        """Waits for the writes still queued, whatever their outcome (after a refused stream)."""
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()

    async def _next_done(self) -> None:
        try:
            await self._pending.popleft()
        except OSError as error:
            # The file is the server's own: its path goes to the log, the folder (the status's
            # shared_weights_dir) and the reason to the client.
            logger.error("writing the update file %s failed: %s", self.path, error)
            raise WeightUpdateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"could not write the update in {self.directory}: {error.strerror}",
            ) from error

    def _write(self, pieces: list[tuple[int, memoryview]]) -> None:
        for position, data in pieces:
            view = memoryview(data).cast("B")
            while view:
                written = os.pwrite(self._fd, view, position)
                view, position = view[written:], position + written

    def close(self) -> None:
        """Deletes the file (call `settle` first if a stream may still be writing)."""
        self._writer.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        release_owned_file(self.path, self._lock_fd)  # the file, then its lock
        self._lock_fd = None
