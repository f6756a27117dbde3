"""A writer-preferring readers/writer gate that orders Generate calls and weight swaps.

Readers are Generate calls: a call enters, reads the live policy version, submits its requests
to the engine and leaves when the engine has finished all of them ("drain" swap mode) or as soon
as they are in the engine ("in-flight"). The writer is a weight swap: once it asks, no new call
enters; it proceeds when the calls inside have left, swaps, bumps the version and lets the
waiting calls in. In "drain" mode every request thus runs entirely on the weights of the version
it was tagged with; in both, a request is submitted under the version it is salted with, and a
steady stream of calls cannot starve an update.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class VersionGate:
    def __init__(self) -> None:
        self._condition = asyncio.Condition()
        self._readers = 0
        self._writers_waiting = 0
        self._writer_active = False
        self.readers_waiting = 0

    @property
    def readers_inside(self) -> int:
        return self._readers

    @property
    def writer_pending(self) -> bool:
        return self._writers_waiting > 0 or self._writer_active

    @asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._condition:
            self.readers_waiting += 1
            try:
                await self._condition.wait_for(
                    lambda: not self._writer_active and self._writers_waiting == 0
                )
            finally:
                self.readers_waiting -= 1
            self._readers += 1
        try:
            yield
        finally:
            async with self._condition:
                self._readers -= 1
                self._condition.notify_all()

    @asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._condition:
            self._writers_waiting += 1
            try:
                await self._condition.wait_for(
                    lambda: not self._writer_active and self._readers == 0
                )
            finally:
                self._writers_waiting -= 1
                # A writer that gave up waiting (cancelled) must let the readers it held back in.
                self._condition.notify_all()
            self._writer_active = True
        try:
            yield
        finally:
            async with self._condition:
                self._writer_active = False
                self._condition.notify_all()
