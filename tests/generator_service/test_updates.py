"""The joining of several senders' streams into one update (no engine, no gRPC): who joins
which update, what refuses it, and that the update lock is held from its turn until its answer
(and every write it queued) has settled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from generator_service.updates.join import UpdateJoiner
from generator_service.updates.tensors import WeightUpdateError


def header(version=1, sender=0, num_senders=2, num_tensors=3, allow_rollback=False,
           update_id="u"):  # fmt: skip
    return SimpleNamespace(policy_version=version, sender=sender, num_senders=num_senders,
                           num_tensors=num_tensors, allow_rollback=allow_rollback,
                           update_id=update_id, HasField=lambda field: False)  # fmt: skip


def joiner(timeout=5.0, events=None, prepare_fails=None):
    events = [] if events is None else events

    async def prepare(update):
        events.append(("prepare", update.key.policy_version))
        if prepare_fails is not None:
            raise prepare_fails

    async def release(update):
        await asyncio.sleep(0.01)  # the writes settling
        events.append(("release", update.key.policy_version))

    return UpdateJoiner(asyncio.Lock(), timeout, prepare, release), events


def test_senders_of_one_version_join_one_update_and_the_lock_waits_for_its_answer():
    async def run():
        updates, events = joiner()
        first, _ = updates.join(header(sender=1))
        second, sender = updates.join(header(sender=0))
        assert second is first and sender == 0 and first.all_joined
        await first.wait_ready()
        assert events == [("prepare", 1)]
        later, _ = updates.join(header(version=2, num_senders=1))  # the next update waits
        assert later is not first
        await asyncio.sleep(0.05)
        assert not later.ready.is_set()
        first.succeed("done")
        await later.wait_ready()
        assert events == [("prepare", 1), ("release", 1), ("prepare", 2)]
        later.succeed("done")
        await asyncio.sleep(0.05)

    asyncio.run(run())


@pytest.mark.parametrize(
    "second, message",
    [
        (header(version=2, sender=1), "its senders disagree"),
        (header(sender=1, num_senders=3), "its senders disagree"),
        (header(sender=1, num_tensors=4), "its senders disagree"),
        (header(sender=1, update_id="v"), "its senders disagree"),
        (header(sender=0), "sender 0 of policy_version 1 came twice"),
    ],
    ids=["version", "count", "tensors", "update_id", "twice"],
)
def test_a_sender_that_disagrees_refuses_the_whole_update(second, message):
    async def run():
        updates, events = joiner()
        first, _ = updates.join(header(sender=0))
        with pytest.raises(WeightUpdateError) as caught:
            updates.join(second)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.message
        assert first.error() is caught.value  # the first sender gets the same answer
        await asyncio.sleep(0.05)
        # Refused before its turn came: it never held the lock, and the next one takes it.
        nxt, _ = updates.join(header(version=3, num_senders=1))
        await nxt.wait_ready()
        nxt.succeed("done")

    asyncio.run(run())


def test_a_sender_index_out_of_range_is_refused():
    async def run():
        updates, _ = joiner()
        with pytest.raises(WeightUpdateError, match="sender 2 is not below num_senders 2"):
            updates.join(header(sender=2))

    asyncio.run(run())


def test_a_sender_that_never_comes_times_the_update_out():
    async def run():
        updates, events = joiner(timeout=0.2)
        update, _ = updates.join(header(sender=1, num_senders=3))
        updates.join(header(sender=0, num_senders=3))
        with pytest.raises(WeightUpdateError) as caught:
            await asyncio.wait_for(asyncio.shield(update.result), 5)
        assert caught.value.code == grpc.StatusCode.ABORTED  # transient: it may come again
        assert "sender(s) [2] of 3 of policy_version 1 never came within 0.2 s" in (
            caught.value.message)  # fmt: skip
        await asyncio.sleep(0.05)
        assert events == [("prepare", 1), ("release", 1)]
        # A late sender starts a new update of its own (which would wait for the others).
        late, _ = updates.join(header(sender=2, num_senders=3))
        assert late is not update

    asyncio.run(run())


def test_a_stream_alone_is_its_own_update_beside_an_open_one():
    async def run():
        updates, _ = joiner()
        open_one, _ = updates.join(header(sender=0))
        alone, _ = updates.join(header(version=2, num_senders=1))
        assert alone is not open_one and alone.all_joined and open_one.error() is None
        joined, _ = updates.join(header(sender=1))
        assert joined is open_one
        await open_one.wait_ready()
        open_one.succeed("done")
        await alone.wait_ready()
        alone.succeed("done")

    asyncio.run(run())


def test_a_failure_to_prepare_is_answered_without_the_servers_internals():
    """The update folder gone (say): every sender is told the update was refused on an
    internal error, not the exception's class nor its message (a path of the server's)."""

    async def run():
        missing = FileNotFoundError(2, "No such file or directory", "/dev/shm/jaxrlhf-weights-1")
        updates, _ = joiner(prepare_fails=missing)
        update, _ = updates.join(header(num_senders=1))
        with pytest.raises(WeightUpdateError) as caught:
            await update.wait_ready()
        assert caught.value.code == grpc.StatusCode.INTERNAL
        message = caught.value.message
        assert "preparing policy_version 1 failed on an internal error" in message
        assert "FileNotFoundError" not in message and "/dev/shm" not in message, message
        assert "the served weights are unchanged" in message

    asyncio.run(run())
