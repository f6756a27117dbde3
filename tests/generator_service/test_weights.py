"""Fast checks of update validation, preloading and decoding (no engine): every malformed-stream
rule, and the preloaded bytes as the engine's worker maps them."""

from __future__ import annotations

import asyncio
import errno
import os

import grpc
import numpy as np
import pytest

from generator_service.updates.assemble import WeightAssembler
from generator_service.updates.bytes_file import UpdateFile, minimum_update_bytes
from generator_service.updates.tensors import (
    UPDATE_FILE_ALIGNMENT,
    TensorSpec,
    WeightUpdateError,
    expected_tensors,
)

SPECS = {
    "model.embed_tokens.weight": TensorSpec("model.embed_tokens.weight", (6, 4), "F32"),
    "model.norm.weight": TensorSpec("model.norm.weight", (4,), "F32"),
}


def chunk(name, data, offset=0, version=1, num_tensors=2, dtype="float32", shape=None):
    shape = SPECS[name].shape if shape is None and name in SPECS else (shape or ())
    return dict(
        policy_version=version,
        num_tensors=num_tensors,
        name=name,
        dtype=dtype,
        shape=shape,
        offset=offset,
        data=data,
    )


def arrays():
    rng = np.random.default_rng(0)
    return {name: rng.normal(size=spec.shape).astype(np.float32) for name, spec in SPECS.items()}


def assemble(chunks, current_version=0):
    assembler = WeightAssembler(SPECS, current_version)
    for item in chunks:
        assembler.add(**item)
    return assembler.finish()


def refused(chunks, current_version=0) -> WeightUpdateError:
    with pytest.raises(WeightUpdateError) as caught:
        assemble(chunks, current_version)
    return caught.value


def preload(chunks, preloading: UpdateFile, current_version=0):
    """Validates and writes `chunks` as the server does; returns the preloaded tensors."""

    async def run():
        assembler = WeightAssembler(SPECS, current_version)
        preloading.check_space(minimum_update_bytes(SPECS))
        try:
            for item in chunks:
                await preloading.write(assembler.add(**item))
            tensors = assembler.finish()
            await preloading.flush(assembler.file_bytes)
            return tensors
        finally:
            await preloading.settle()

    return asyncio.run(run())


def test_chunks_in_any_order_are_preloaded_exactly_where_the_worker_maps_them(tmp_path):
    import torch

    from generator_service.worker_extension import map_preloaded_tensors

    values = arrays()
    embed = values["model.embed_tokens.weight"].tobytes()
    norm = values["model.norm.weight"].astype(np.float16).tobytes()
    chunks = [
        chunk("model.embed_tokens.weight", embed[40:], offset=40),
        chunk("model.norm.weight", norm, dtype="float16"),
        chunk("model.embed_tokens.weight", embed[:40]),
    ]
    preloading = UpdateFile(str(tmp_path), max_pending=1)
    tensors = preload(chunks, preloading)
    assert [t.name for t in tensors] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert [t.position % UPDATE_FILE_ALIGNMENT for t in tensors] == [0, 0]
    assert os.path.getsize(preloading.path) == tensors[-1].position + tensors[-1].nbytes
    manifest = [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]
    (mapped,), views = map_preloaded_tensors(
        preloading.path, manifest
    )  # one after the other: one map
    loaded = dict(views)
    assert loaded["model.norm.weight"].dtype == torch.float16
    np.testing.assert_array_equal(
        loaded["model.embed_tokens.weight"].numpy(), values["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(
        loaded["model.norm.weight"].numpy(), values["model.norm.weight"].astype(np.float16)
    )
    with pytest.raises(BufferError):
        mapped.close()  # the views hold the map: it cannot be closed under them
    del views, loaded
    mapped.close()
    # The next update reuses the file: a smaller one (float16 only) shrinks it to its size.
    smaller = [
        chunk(name, value.astype(np.float16).tobytes(), dtype="float16")
        for name, value in values.items()
    ]
    tensors = preload(smaller, preloading)
    assert os.path.getsize(preloading.path) == tensors[-1].position + tensors[-1].nbytes
    preloading.close()
    assert not os.path.exists(preloading.path)


def test_bfloat16_is_mapped_bit_for_bit(tmp_path):
    import ml_dtypes
    import torch

    from generator_service.worker_extension import map_preloaded_tensors

    values = {name: value.astype(ml_dtypes.bfloat16) for name, value in arrays().items()}
    chunks = [
        chunk(name, value.tobytes(), dtype="bfloat16", num_tensors=2)
        for name, value in values.items()
    ]
    preloading = UpdateFile(str(tmp_path))
    tensors = preload(chunks, preloading)
    manifest = [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]
    _, views = map_preloaded_tensors(preloading.path, manifest)
    for name, view in views:
        assert view.dtype == torch.bfloat16
        expected = torch.from_numpy(values[name].view(np.int16)).view(torch.bfloat16)
        assert torch.equal(view, expected)
    del views
    preloading.close()


def test_preloading_refuses_a_full_disk_up_front_and_on_write(tmp_path, monkeypatch):
    preloading = UpdateFile(str(tmp_path), max_pending=1)
    with pytest.raises(WeightUpdateError) as caught:
        preloading.check_space(1 << 62)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "needs at least" in caught.value.message

    def full(fd, data, position):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    values = arrays()
    chunks = [chunk(name, value.tobytes()) for name, value in values.items()]
    with pytest.raises(WeightUpdateError) as caught:
        preload(chunks, preloading)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "No space left on device" in caught.value.message
    assert preloading.path not in caught.value.message  # the server's file, not the client's
    preloading.close()


def test_preloading_files_of_dead_servers_are_removed(tmp_path):
    stale = tmp_path / f"{UpdateFile.PREFIX}999999999-x.bin"  # above any pid_max: not running
    live = tmp_path / f"{UpdateFile.PREFIX}{os.getpid()}-y.bin"
    stale.write_bytes(b"old")
    live.write_bytes(b"mine")
    preloading = UpdateFile(str(tmp_path))
    assert not stale.exists() and live.exists()
    preloading.close()


def test_expected_tensors_reads_sharded_index(tmp_path):
    from safetensors.numpy import save_file

    values = arrays()
    save_file({"model.norm.weight": values["model.norm.weight"]}, tmp_path / "a.safetensors")
    save_file(
        {"model.embed_tokens.weight": values["model.embed_tokens.weight"]},
        tmp_path / "b.safetensors",
    )
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"model.norm.weight": "a.safetensors", '
        '"model.embed_tokens.weight": "b.safetensors"}}'
    )
    assert expected_tensors(tmp_path) == SPECS


def whole(name, version=1, num_tensors=2, dtype="float32"):
    nbytes = int(np.prod(SPECS[name].shape)) * (4 if dtype == "float32" else 2)
    return chunk(name, bytes(nbytes), version=version, num_tensors=num_tensors, dtype=dtype)


EMBED, NORM = "model.embed_tokens.weight", "model.norm.weight"
CASES = {
    "stale version": (
        [whole(EMBED, version=3), whole(NORM, version=3)],
        grpc.StatusCode.FAILED_PRECONDITION,
        "not newer than the served version 3",
    ),
    "unknown name": (
        [chunk("model.bogus.weight", b"\0" * 4, shape=(1,))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown tensor 'model.bogus.weight'",
    ),
    "tied lm_head": (
        [chunk("lm_head.weight", b"\0" * 96, shape=(6, 4))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "ties it to model.embed_tokens.weight",
    ),
    "wrong shape": (
        [chunk(EMBED, b"\0" * 96, shape=(4, 6))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "tensor model.embed_tokens.weight has shape [4, 6], expected [6, 4]",
    ),
    "wrong dtype": (
        [chunk(EMBED, b"\0" * 24, dtype="int8")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "dtype 'int8' is not one of",
    ),
    "num_tensors not the model's": (
        [whole(EMBED, num_tensors=1)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "num_tensors is 1 but the served model has 2",
    ),
    "version changes mid-stream": (
        [whole(EMBED), whole(NORM, version=2)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "every chunk of one update must carry the same values",
    ),
    "dtype changes within a tensor": (
        [chunk(EMBED, b"\0" * 8), chunk(EMBED, b"\0" * 8, offset=8, dtype="float16")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "earlier chunks of this tensor had float32",
    ),
    "duplicated tensor": (
        [whole(EMBED), whole(NORM), whole(EMBED)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "model.embed_tokens.weight: bytes [0, 96) were already received: duplicated",
    ),
    "overlapping chunk": (
        [chunk(EMBED, b"\0" * 48), chunk(EMBED, b"\0" * 48, offset=40)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "bytes [40, 88) were already received",
    ),
    "over-long data": (
        [chunk(EMBED, b"\0" * 100)],
        grpc.StatusCode.INVALID_ARGUMENT,
        "past the 96 bytes (float32 [6, 4]): over-long data",
    ),
    "empty chunk": (
        [chunk(EMBED, b"")],
        grpc.StatusCode.INVALID_ARGUMENT,
        "carries no data",
    ),
    "truncated tensor": (
        [chunk(EMBED, b"\0" * 90), whole(NORM)],
        grpc.StatusCode.DATA_LOSS,
        "model.embed_tokens.weight (received 90 of 96 bytes)",
    ),
    "missing tensor": (
        [whole(EMBED)],
        grpc.StatusCode.DATA_LOSS,
        "1 never started: model.norm.weight",
    ),
    "empty stream": ([], grpc.StatusCode.INVALID_ARGUMENT, "the weight stream was empty"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_stream_is_refused_with_a_named_problem(case):
    chunks, code, message = CASES[case]
    error = refused(chunks, current_version=3 if case == "stale version" else 0)
    assert error.code == code
    assert message in error.message


def sliced(values, boxes, version=1, num_senders=2, sender=0, chunk_bytes=16):
    """The add() arguments of the chunks of `boxes` [(name, start, extent)] of `values`."""
    from jaxrlhf_wire.chunks import TensorSlice
    from tests.generator_service.wire import chunk_messages

    def box(start, extent):
        return tuple(slice(s, s + n) for s, n in zip(start, extent, strict=True))

    items = [
        (name, TensorSlice(SPECS[name].shape, start, values[name][box(start, extent)]))
        for name, start, extent in boxes
    ]
    return [
        dict(policy_version=c.policy_version, num_tensors=c.num_tensors, name=c.name,
             dtype=c.dtype, shape=tuple(c.shape), offset=c.offset, data=c.data,
             slice_start=tuple(c.slice_start), slice_shape=tuple(c.slice_shape),
             num_senders=c.num_senders)
        for c in chunk_messages(items, version, chunk_bytes, num_tensors=2,
                                    num_senders=num_senders, sender=sender)
    ]  # fmt: skip


# Each process's boxes: columns of the embedding split two ways, then rows of one half split
# again, and the norm in two halves: three senders, three shapes of slice.
THREE_SENDERS = [
    [(EMBED, (0, 0), (6, 2))],
    [(EMBED, (0, 2), (3, 2)), (NORM, (0,), (2,))],
    [(EMBED, (3, 2), (3, 2)), (NORM, (2,), (2,))],
]


def test_slices_from_several_senders_are_preloaded_as_the_whole_tensors(tmp_path):
    from generator_service.worker_extension import map_preloaded_tensors

    values = arrays()
    chunks = [c for i, boxes in enumerate(THREE_SENDERS)
              for c in sliced(values, boxes, num_senders=3, sender=i)]  # fmt: skip
    rng = np.random.default_rng(1)
    chunks = [chunks[i] for i in rng.permutation(len(chunks))]  # interleaved in any order
    preloading = UpdateFile(str(tmp_path))
    tensors = preload(chunks, preloading)
    manifest = [[t.name, t.wire_dtype, list(t.shape), t.position] for t in tensors]
    maps, views = map_preloaded_tensors(preloading.path, manifest)
    for name, view in views:
        np.testing.assert_array_equal(view.numpy(), values[name])
    del views, view
    for mapped in maps:
        mapped.close()
    preloading.close()


@pytest.mark.parametrize(
    "boxes, code, message",
    [
        (
            [(EMBED, (0, 0), (6, 2)), (EMBED, (0, 1), (6, 3)), (NORM, (0,), (4,))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "slice at [0, 1] of shape [6, 3] overlaps the slice at [0, 0] of shape [6, 2]: "
            "duplicated data",
        ),
        (
            [(EMBED, (0, 0), (6, 2)), (EMBED, (0, 0), (6, 2)), (NORM, (0,), (4,))],
            grpc.StatusCode.INVALID_ARGUMENT,
            "were already received: duplicated data",
        ),
        (
            [(EMBED, (0, 0), (6, 2)), (EMBED, (0, 2), (5, 2)), (NORM, (0,), (4,))],
            grpc.StatusCode.DATA_LOSS,
            "model.embed_tokens.weight (received 88 of 96 bytes)",
        ),
        (
            [(EMBED, (0, 0), (6, 4)), (NORM, (0,), (2,))],
            grpc.StatusCode.DATA_LOSS,
            "model.norm.weight (received 8 of 16 bytes)",
        ),
    ],
    ids=["overlap", "duplicate", "gap", "missing half"],
)
def test_slices_that_overlap_or_leave_a_gap_are_refused(boxes, code, message):
    error = refused(sliced(arrays(), boxes))
    assert error.code == code
    assert message in error.message


def test_a_slice_outside_its_tensor_or_senders_that_disagree_are_refused():
    values = arrays()
    outside = sliced(values, [(EMBED, (0, 0), (6, 4))])[0] | {"slice_start": (1, 0)}
    assert "lies outside the tensor's [6, 4]" in refused([outside]).message
    flat = sliced(values, [(EMBED, (0, 0), (6, 4))])[0] | {"slice_start": (0,)}
    assert "one entry per dimension" in refused([flat]).message
    two = sliced(values, [(EMBED, (0, 0), (6, 2))])
    three = sliced(values, [(EMBED, (0, 2), (6, 2)), (NORM, (0,), (4,))], num_senders=3)
    assert "from every sender" in refused(two + three).message


def test_a_zero_size_tensor_is_taken_whole_and_only_once():
    specs = {"a": TensorSpec("a", (0, 4), "F32"), NORM: SPECS[NORM]}
    assembler = WeightAssembler(specs, 0)
    assembler.add(1, 2, "a", "float32", (0, 4), 0, b"")
    assembler.add(1, 2, NORM, "float32", (4,), 0, bytes(16))
    assert [t.nbytes for t in assembler.finish()] == [0, 16]
    again = WeightAssembler(specs, 0)
    again.add(1, 2, "a", "float32", (0, 4), 0, b"")
    with pytest.raises(WeightUpdateError, match="duplicated data"):
        again.add(1, 2, "a", "float32", (0, 4), 0, b"")
