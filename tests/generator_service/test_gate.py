"""The readers/writer gate behind exact version tags (asyncio, no engine)."""

from __future__ import annotations

import asyncio

from generator_service.gate import VersionGate


def test_writer_waits_for_readers_and_blocks_new_ones():
    async def scenario() -> list[str]:
        gate = VersionGate()
        events: list[str] = []
        first_inside = asyncio.Event()
        release_first = asyncio.Event()

        async def reader(name: str, hold: asyncio.Event | None = None) -> None:
            async with gate.read():
                events.append(f"{name} in")
                if hold is not None:
                    first_inside.set()
                    await hold.wait()
                events.append(f"{name} out")

        async def writer() -> None:
            async with gate.write():
                events.append("swap")

        first = asyncio.create_task(reader("r1", release_first))
        await first_inside.wait()
        swap = asyncio.create_task(writer())
        await asyncio.sleep(0.01)
        late = asyncio.create_task(reader("r2"))  # arrives while the swap is pending
        await asyncio.sleep(0.01)
        assert events == ["r1 in"], "neither the swap nor a new reader may start yet"
        assert gate.readers_waiting == 1
        release_first.set()
        await asyncio.gather(first, swap, late)
        return events

    assert asyncio.run(scenario()) == ["r1 in", "r1 out", "swap", "r2 in", "r2 out"]


def test_cancelled_writer_lets_readers_through():
    async def scenario() -> None:
        gate = VersionGate()
        inside = asyncio.Event()
        release = asyncio.Event()

        async def holder() -> None:
            async with gate.read():
                inside.set()
                await release.wait()

        async def writer() -> None:
            async with gate.write():
                pass

        hold = asyncio.create_task(holder())
        await inside.wait()
        pending_swap = asyncio.create_task(writer())
        await asyncio.sleep(0.01)
        blocked = asyncio.create_task(holder())
        await asyncio.sleep(0.01)
        pending_swap.cancel()
        await asyncio.sleep(0.01)
        assert gate.readers_inside == 2
        release.set()
        await asyncio.gather(hold, blocked)

    asyncio.run(asyncio.wait_for(scenario(), timeout=5))


def test_a_swap_outlives_its_cancelled_caller():
    """A client's deadline landing mid-swap: the swap runs to its end (never left paused),
    then the caller's cancellation goes on."""
    from generator_service.updates.swap import finish_despite_cancellation

    async def scenario() -> list[str]:
        events: list[str] = []

        async def swap() -> int:
            events.append("paused")
            await asyncio.sleep(0.2)
            events.append("resumed")
            return 7

        async def caller() -> int:
            return await finish_despite_cancellation(asyncio.ensure_future(swap()))

        call = asyncio.ensure_future(caller())
        await asyncio.sleep(0.05)
        call.cancel()
        await asyncio.sleep(0.05)
        call.cancel()  # twice: still waits
        try:
            await call
        except asyncio.CancelledError:
            events.append("caller cancelled")
        # Not cancelled: the result; the swap's own failure: raised.
        events.append(str(await finish_despite_cancellation(asyncio.ensure_future(swap()))))

        async def failing() -> None:
            raise RuntimeError("reload failed")

        try:
            await finish_despite_cancellation(asyncio.ensure_future(failing()))
        except RuntimeError as error:
            events.append(str(error))
        return events

    assert asyncio.run(scenario()) == [
        "paused", "resumed", "caller cancelled", "paused", "resumed", "7", "reload failed",
    ]  # fmt: skip
