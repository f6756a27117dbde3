"""Preloading a streamed update as it arrives, on the server's side
(generator_service/updates/feed.py; no engine): each tensor is handed to the preload once, only when
every one of its bytes, from every sender, is in the update file, and nothing is fed after a write
failed."""

from __future__ import annotations

import asyncio

import numpy as np

from generator_service.updates.assemble import WeightAssembler
from generator_service.updates.bytes_file import UpdateFile
from generator_service.updates.feed import PreloadFeeder, write_and_feed
from generator_service.updates.tensors import PreloadTensor, TensorSpec

SHAPES = {
    "model.layers.0.mlp.up_proj.weight": (8, 4),
    "model.layers.1.mlp.up_proj.weight": (8, 4),
    "model.norm.weight": (4,),
}
SPECS = {name: TensorSpec(name, shape, "F32") for name, shape in SHAPES.items()}
NAMES = list(SPECS)


def values():
    rng = np.random.default_rng(0)
    return {n: rng.normal(size=s.shape).astype(np.float32) for n, s in SPECS.items()}


def receive(chunks, update_file, feed, write=None):
    """Adds `chunks` (name, offset, bytes, slice start, slice shape, sender count) as the server
    does, feeding a `PreloadFeeder`; returns whether everything was fed."""

    async def run():
        assembler = WeightAssembler(SPECS, 0)
        feeder = PreloadFeeder(feed)
        for name, offset, data, start, shape, senders in chunks:
            pieces = assembler.add(1, len(SPECS), name, "float32", SPECS[name].shape, offset,
                                   data, False, start, shape, senders)  # fmt: skip
            await write_and_feed(assembler, update_file, pieces, feeder)
            await asyncio.sleep(0)
        fed = await feeder.close()
        await update_file.settle()
        return fed

    return asyncio.run(run())


def test_each_tensor_is_fed_once_when_all_its_bytes_are_in_the_file(tmp_path):
    arrays = values()
    update_file = UpdateFile(str(tmp_path), max_pending=1)
    fed: list[list[str]] = []

    async def feed(tensors):
        for tensor in tensors:  # what the worker would map now is the whole tensor
            with open(update_file.path, "rb") as file:
                file.seek(tensor.position)
                read = np.frombuffer(file.read(tensor.nbytes), np.float32).reshape(tensor.shape)
            np.testing.assert_array_equal(read, arrays[tensor.name])
        fed.append([t.name for t in tensors])
        await asyncio.sleep(0.01)  # an RPC: what completes meanwhile goes in the next batch

    up0, up1, norm = (arrays[n].tobytes() for n in NAMES)
    chunks = [
        (NAMES[0], 0, up0[:64], (), (), 1),
        (NAMES[1], 0, up1[:64], (), (), 1),
        (NAMES[0], 64, up0[64:], (), (), 1),  # layer 0 complete
        (NAMES[2], 0, norm, (), (), 1),  # the norm: one chunk
        (NAMES[1], 64, up1[64:], (), (), 1),
    ]
    assert receive(chunks, update_file, feed)
    order = [name for batch in fed for name in batch]
    assert order == [NAMES[0], NAMES[2], NAMES[1]]  # as each completed, each once
    update_file.close()


def test_a_tensor_sliced_between_senders_is_fed_once_after_its_last_slice(tmp_path):
    arrays = values()
    update_file = UpdateFile(str(tmp_path))
    fed: list[str] = []

    async def feed(tensors):
        fed.extend(t.name for t in tensors)

    name = NAMES[0]
    top, bottom = arrays[name][:5].tobytes(), arrays[name][5:].tobytes()
    chunks = [
        (name, 0, top, (0, 0), (5, 4), 2),
        (NAMES[1], 0, arrays[NAMES[1]].tobytes(), (), (), 2),
        (NAMES[2], 0, arrays[NAMES[2]].tobytes(), (), (), 2),
    ]
    assert receive(chunks, update_file, feed)
    assert fed == [NAMES[1], NAMES[2]]  # the first is still missing rows 5-7
    fed.clear()
    assert receive([*chunks, (name, 0, bottom, (5, 0), (3, 4), 2)], update_file, feed)
    assert fed == [NAMES[1], NAMES[2], name]
    update_file.close()


def test_nothing_is_fed_after_a_write_failed_or_a_feed_failed(tmp_path):
    arrays = values()
    update_file = UpdateFile(str(tmp_path), max_pending=8)
    chunks = [(n, 0, arrays[n].tobytes(), (), (), 1) for n in NAMES]
    fed: list[str] = []

    async def feed(tensors):
        fed.extend(t.name for t in tensors)

    writes = 0
    real_write = update_file._write

    def failing_write(pieces):
        nonlocal writes
        writes += 1
        if writes == 2:
            raise OSError(28, "No space left on device")
        real_write(pieces)

    update_file._write = failing_write
    assert not receive(chunks, update_file, feed)
    assert fed in ([], [NAMES[0]])  # never what was written after the failed write

    update_file._write = real_write
    fed.clear()

    calls = 0

    async def broken(tensors):
        nonlocal calls
        calls += 1
        raise RuntimeError("the engine died")

    assert not receive(chunks, update_file, broken)
    assert calls == 1  # no batch after the failed one
    update_file.close()


def test_a_tensor_completed_by_another_senders_chunk_waits_for_that_chunks_write(tmp_path):
    """Two senders' streams at once, writes slow and queued one deep: sender 0's chunk waits to
    be written while sender 1's completes the tensor; the tensor is fed only once sender 1's
    bytes are in the file too."""
    import time

    arrays = values()
    update_file = UpdateFile(str(tmp_path), max_pending=1)
    real_write = update_file._write

    def slow_write(pieces):
        time.sleep(0.05)
        real_write(pieces)

    update_file._write = slow_write
    fed: list[str] = []

    async def feed(tensors):
        for tensor in tensors:
            with open(update_file.path, "rb") as file:
                file.seek(tensor.position)
                read = np.frombuffer(file.read(tensor.nbytes), np.float32).reshape(tensor.shape)
            np.testing.assert_array_equal(read, arrays[tensor.name])
            fed.append(tensor.name)

    async def run():
        assembler = WeightAssembler(SPECS, 0)
        feeder = PreloadFeeder(feed)
        name = NAMES[0]
        halves = [arrays[name][:4].tobytes(), arrays[name][4:].tobytes()]

        async def sender(index):
            data = halves[index]
            await asyncio.sleep(0.01 * index)  # sender 0 first
            pieces = assembler.add(1, len(SPECS), name, "float32", SPECS[name].shape, 0, data,
                                   False, (4 * index, 0), (4, 4), 2)  # fmt: skip
            await write_and_feed(assembler, update_file, pieces, feeder)

        first = update_file.write([])  # one write already queued: the senders' writes wait
        await asyncio.gather(first, sender(0), sender(1))
        assert await feeder.close()
        await update_file.settle()

    asyncio.run(run())
    assert fed == [NAMES[0]]
    update_file.close()


def test_an_abandoned_feeder_feeds_nothing_more_than_the_feed_under_way():
    """A refused update's feeder (`abandon`) waits for the feed in progress, then stops: what
    was still waiting for its write, or ready behind it, is never fed (its preload is dropped)."""

    def tensor(name):
        return PreloadTensor(name, "F32", (4,), 0, 16)

    async def run():
        fed, feeding, release = [], asyncio.Event(), asyncio.Event()

        async def feed(tensors):
            fed.append([t.name for t in tensors])
            feeding.set()
            await release.wait()

        loop = asyncio.get_running_loop()
        first, second, third = (loop.create_future() for _ in range(3))
        feeder = PreloadFeeder(feed)
        feeder.add([tensor("a")], first)
        feeder.add([tensor("b")], second)
        first.set_result(None)
        await feeding.wait()  # "a" is being fed; "b" waits for its write
        feeder.add([tensor("c")], third)
        second.set_result(None)
        third.set_result(None)
        abandoned = asyncio.ensure_future(feeder.abandon())
        await asyncio.sleep(0.05)
        waited = not abandoned.done()  # for the feed under way
        release.set()
        await abandoned
        return fed, waited

    assert asyncio.run(run()) == ([["a"]], True)
