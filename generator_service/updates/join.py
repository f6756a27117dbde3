"""One weight update arriving as one or more UpdateWeights streams (senders), assembled into one
version.

A multi-process learner publishes with no gather: each of its N processes opens its own stream
with `num_senders = N` and its `sender` index, and sends the slices of the tensors that its
devices hold (`WeightChunk.slice_start/slice_shape`). The server joins the N streams into one
`Update`: every chunk of every stream goes through the update's one `WeightAssembler` into the
one update file, and the version is swapped in once when the last stream has ended and every
byte of every tensor has arrived exactly once. Every stream is then answered alike: the same
response, or the same refusal.

- The first stream of an update creates it; the others join it while it waits for them. A
  stream of several that disagrees with it (version, tensor count, rollback, number of
  senders, update_id) or repeats a sender index is refused, and so is the whole update. A
  stream alone (`num_senders` 0 or 1) is an update of its own, in turn after the open one.
- Senders that have not all joined within `join_timeout` seconds of the first: the update is
  refused, ABORTED (naming the missing ones). A stall is transient (a learner process slow to
  start its stream, on busy cores): the learner fails the replica and brings it back, where a
  precondition would end its run.
- One stream's failure (a malformed chunk, an overlap, its call cancelled) refuses the update;
  the streams still sending are answered with it at their next chunk, those waiting at once.
- An update is received only while it holds the servicer's update lock (one update at a time:
  they share the update file, and versions apply in order), and it releases it only once every
  write it queued has settled.

A single stream (`num_senders` 0 or 1) is an Update of one sender, through the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import grpc

from generator_service.updates.adapter import LoraSettings
from generator_service.updates.tensors import WeightUpdateError

logger = logging.getLogger(__name__)

# Senders of one update that the server accepts (a guard against a corrupt count).
MAX_SENDERS = 4096


@dataclasses.dataclass(frozen=True)
class UpdateKey:
    """What every stream of one update must agree on."""

    policy_version: int
    num_tensors: int
    allow_rollback: bool
    num_senders: int
    update_id: str  # the learner's name for the update (GeneratorStatus.update_id)
    lora: LoraSettings | None = None  # set: the update is an adapter (WeightChunk.lora)

    @classmethod
    def of(cls, header) -> UpdateKey:
        lora = LoraSettings.of(header.lora) if header.HasField("lora") else None
        return cls(header.policy_version, header.num_tensors, header.allow_rollback,
                   max(1, header.num_senders), header.update_id, lora)  # fmt: skip

    def describe(self) -> str:
        return (
            f"policy_version {self.policy_version}, num_tensors {self.num_tensors}, "
            f"allow_rollback {self.allow_rollback}, num_senders {self.num_senders}, "
            f"update_id {self.update_id!r}, "
            + (f"adapter ({self.lora.describe()})" if self.lora else "full weights")
        )


class Update:
    """The state of one update's streams (module docstring). `result` holds what every stream
    answers: the response, or a WeightUpdateError."""

    def __init__(self, key: UpdateKey) -> None:
        self.key = key
        self.started = time.monotonic()
        self.joined: set[int] = set()
        self.finished: set[int] = set()
        self.ready = asyncio.Event()  # the lock is held and `assembler`/`file` are set
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()
        self.assembler = None
        self.file = None
        self.preload_id = 0  # the engine's preload begun for it (generator_service/updates/feed.py)
        self.feeder = None  # feeding that preload, until the swap takes it over

    @property
    def all_joined(self) -> bool:
        return len(self.joined) == self.key.num_senders

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == self.key.num_senders

    def fail(self, error: WeightUpdateError) -> None:
        """Refuses the update (the first failure wins)."""
        if not self.result.done():
            self.result.set_exception(error)
            self.result.exception()  # retrieved here: each stream reads it again

    def succeed(self, response) -> None:
        if not self.result.done():
            self.result.set_result(response)

    def error(self) -> WeightUpdateError | None:
        """The refusal, once the update was refused."""
        if self.result.done() and not self.result.cancelled():
            return self.result.exception()
        return None

    async def wait_ready(self) -> None:
        """Until the update may be received (or it was refused meanwhile: then its error)."""
        waiter = asyncio.ensure_future(self.ready.wait())
        try:
            await asyncio.wait((waiter, self.result), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if (error := self.error()) is not None:
            raise error


class UpdateJoiner:
    """Hands each new stream the update it belongs to, creating it for the first one and
    holding the update lock for it (module docstring)."""

    def __init__(self, lock: asyncio.Lock, join_timeout: float,
                 prepare: Callable[[Update], Awaitable[None]],
                 release: Callable[[Update], Awaitable[None]]) -> None:  # fmt: skip
        self._lock = lock
        self.join_timeout = join_timeout
        self._prepare = prepare  # makes the assembler and the update file, under the lock
        self._release = release  # settles the update's writes, before the lock is released
        self._open: Update | None = None  # the update that senders are still joining
        self._running: set[asyncio.Task] = set()  # each update's `_run` (held: never collected)

    def join(self, header) -> tuple[Update, int]:
        """The update of a stream whose first chunk has `header`, and its sender index; raises
        WeightUpdateError for a stream that cannot join (failing the open update too, when the
        stream is one of its senders that disagrees with it)."""
        key = UpdateKey.of(header)
        sender = header.sender
        if key.num_senders > MAX_SENDERS:
            raise _invalid(f"num_senders {key.num_senders} is over {MAX_SENDERS}")
        if sender >= key.num_senders:
            raise _invalid(f"sender {sender} is not below num_senders {key.num_senders}")
        update = self._open
        if key.num_senders > 1 and update is not None and not update.result.done():
            problem = None
            if key != update.key:
                problem = (
                    f"sender {sender} sends {key.describe()}, but the update being "
                    f"assembled has {update.key.describe()}: its senders disagree"
                )
            elif sender in update.joined:
                problem = f"sender {sender} of policy_version {key.policy_version} came twice"
            if problem is not None:
                error = _invalid(problem)
                update.fail(error)
                raise error
            update.joined.add(sender)
            if update.all_joined:
                self._open = None
            return update, sender
        update = Update(key)  # a stream alone never joins, nor closes, an open update
        update.joined.add(sender)
        if not update.all_joined:
            self._open = update
        task = asyncio.ensure_future(self._run(update))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return update, sender

    async def _run(self, update: Update) -> None:
        """Holds the lock for `update` from when it is free until the update is answered."""
        timer = asyncio.ensure_future(self._time_out(update))
        try:
            acquire = asyncio.ensure_future(self._lock.acquire())
            await asyncio.wait((acquire, update.result), return_when=asyncio.FIRST_COMPLETED)
            if not acquire.done():
                acquire.cancel()
            try:
                await acquire
            except asyncio.CancelledError:
                return  # refused before its turn came: nothing of it was written
            try:
                if not update.result.done():
                    try:
                        await self._prepare(update)
                        update.ready.set()
                    except WeightUpdateError as error:
                        update.fail(error)
                    except Exception:  # noqa: BLE001 - every sender is answered
                        # What failed is the server's business (its log's): the senders are
                        # told that the server, not their update, was at fault.
                        logger.exception("preparing a weight update failed")
                        update.fail(WeightUpdateError(
                            grpc.StatusCode.INTERNAL,
                            f"preparing policy_version {update.key.policy_version} failed on "
                            "an internal error of the server (see the server's log); the served "
                            "weights are unchanged",
                        ))  # fmt: skip
                await asyncio.wait((update.result,))
            finally:
                try:
                    await self._release(update)
                finally:
                    self._lock.release()
        finally:
            timer.cancel()
            if self._open is update:
                self._open = None

    async def _time_out(self, update: Update) -> None:
        await asyncio.sleep(self.join_timeout)
        if not update.all_joined and not update.result.done():
            missing = sorted(set(range(update.key.num_senders)) - update.joined)
            if self._open is update:
                self._open = None
            update.fail(WeightUpdateError(
                grpc.StatusCode.ABORTED,
                f"sender(s) {missing} of {update.key.num_senders} of policy_version "
                f"{update.key.policy_version} never came within {self.join_timeout:g} s of "
                "the first; the update is refused, the served weights are unchanged, and it "
                "may be sent again",
            ))  # fmt: skip


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)
