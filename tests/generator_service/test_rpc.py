"""The wire contract (jaxrlhf_wire) and the learner's client package (jaxrlhf.fleet.rpc): generated
stubs, light imports, weight chunking, the CLI guard."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxrlhf_wire.chunks import encode_weight_chunks
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]


def chunk_messages(tensors, policy_version: int, **options) -> list:
    """The WeightChunk messages `encode_weight_chunks` sends, parsed back by protobuf."""
    return [generator_pb2.WeightChunk.FromString(raw)
            for raw in encode_weight_chunks(tensors, policy_version, **options)]  # fmt: skip


def test_contract_names():
    assert SERVICE_NAME == "jaxrlhf.generator.v1.Generator"
    methods = generator_pb2.DESCRIPTOR.services_by_name["Generator"].methods_by_name
    assert {"Generate", "UpdateWeights", "GetStatus"} <= set(methods)
    assert methods["Generate"].server_streaming and methods["UpdateWeights"].client_streaming


def test_rpc_package_imports_neither_vllm_nor_jax_nor_torch():
    code = (
        "import sys, jaxrlhf.fleet.rpc;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'jax', 'torch')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_weight_chunks_split_by_byte_offset_and_keep_bfloat16():
    embed = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    norm = np.ones(4, np.float32)
    chunks = list(chunk_messages({"embed": embed, "norm": norm}, 7, chunk_bytes=10))
    assert {c.policy_version for c in chunks} == {7} and {c.num_tensors for c in chunks} == {2}
    embed_chunks = [c for c in chunks if c.name == "embed"]
    assert [c.offset for c in embed_chunks] == [0, 8, 16]  # whole rows (8 bytes) where one fits
    assert {c.dtype for c in embed_chunks} == {"bfloat16"}
    assert list(embed_chunks[0].shape) == [3, 4]
    data = b"".join(c.data for c in embed_chunks)
    np.testing.assert_array_equal(np.frombuffer(data, ml_dtypes.bfloat16).reshape(3, 4), embed)
    norm_chunks = [c for c in chunks if c.name == "norm"]  # 1-D: its rows are its elements
    assert [(c.offset, len(c.data)) for c in norm_chunks] == [(0, 8), (8, 8)]
    narrow = list(chunk_messages({"embed": embed}, 7, chunk_bytes=6))  # a row is over 6 bytes
    assert [(c.offset, len(c.data)) for c in narrow] == [(0, 6), (6, 2), (8, 6), (14, 2),
                                                         (16, 6), (22, 2)]  # fmt: skip
    assert not any(c.slice_start or c.slice_shape or c.num_senders for c in chunks)


def test_a_slice_is_sent_as_its_own_row_major_bytes_with_its_box():
    from jaxrlhf_wire.chunks import TensorSlice

    kernel = np.arange(24, dtype=np.float32).reshape(4, 6)
    part = kernel.T[2:5, 1:3]  # a strided view: rows 2-4, columns 1-2 of the (6, 4) tensor
    chunks = list(
        chunk_messages(
            [("w", TensorSlice((6, 4), (2, 1), part))],
            3,
            chunk_bytes=12,
            num_tensors=5,
            num_senders=2,
            sender=1,
        )
    )
    assert [(c.offset, len(c.data)) for c in chunks] == [(0, 8), (8, 8), (16, 8)]
    assert {(tuple(c.slice_start), tuple(c.slice_shape), tuple(c.shape)) for c in chunks} == {
        ((2, 1), (3, 2), (6, 4))
    }
    assert {(c.num_senders, c.sender, c.num_tensors) for c in chunks} == {(2, 1, 5)}
    data = np.frombuffer(b"".join(c.data for c in chunks), np.float32).reshape(3, 2)
    np.testing.assert_array_equal(data, part)


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--host", "0.0.0.0"], {}, "requires a shared secret"),
        (["--cpu-reserved-cores", "-1"], {}, "--cpu-reserved-cores=-1: must be >= 0"),
        (["--kv-cache-gib", "0"], {}, "a KV cache of 0.0 GiB: it must be > 0"),
        (
            ["--tensor-parallel-size", "2"],
            {"JAXRLHF_ENGINE_EXECUTOR": "uni"},
            "--engine-executor uni runs one worker, but --tensor-parallel-size=2",
        ),
        (
            [],
            {"JAXRLHF_KV_CACHE_GIB": "lots"},
            "JAXRLHF_KV_CACHE_GIB='lots' is not a number of GiB",
        ),
    ],
)
def test_cli_refuses_bad_options_before_starting(args, env, message):
    result = subprocess.run(
        [sys.executable, "-m", "generator_service", "--model", "unused", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        timeout=120,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_weight_chunks_from_a_one_pass_iterator_with_a_given_count():
    arrays = ((f"t{i}", np.full(3, i, np.float16)) for i in range(4))
    chunks = list(chunk_messages(arrays, 2, num_tensors=4))
    assert [c.name for c in chunks] == ["t0", "t1", "t2", "t3"]
    assert {c.num_tensors for c in chunks} == {4}


def test_encoded_chunks_are_the_same_messages_and_decode_without_copying_their_data():
    from jaxrlhf_wire.chunks import decode_weight_chunk

    arrays = {
        "embed": np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16),
        "norm": np.linspace(0, 1, 300, dtype=np.float32),
        "empty": np.zeros((0, 4), np.float16),
    }
    # The messages protobuf itself builds, by hand: embed's 24 bytes in one chunk; norm's 1,200
    # in chunks of 256 (64 elements; its rows are its elements), the last 176; empty, one.
    pieces = [("embed", 0, 24), *(("norm", o, min(256, 1200 - o)) for o in range(0, 1200, 256)),
              ("empty", 0, 0)]  # fmt: skip
    messages = [
        generator_pb2.WeightChunk(
            policy_version=7, num_tensors=3, name=name, dtype=str(arrays[name].dtype),
            shape=arrays[name].shape, offset=offset, allow_rollback=True,
            data=arrays[name].tobytes()[offset : offset + size],
        )
        for name, offset, size in pieces
    ]  # fmt: skip
    encoded = list(encode_weight_chunks(arrays, 7, chunk_bytes=256, allow_rollback=True))
    assert len(encoded) == len(messages) == 1 + 5 + 1
    for raw, message in zip(encoded, messages, strict=True):
        assert generator_pb2.WeightChunk.FromString(raw) == message
        for wire in (raw, message.SerializeToString()):
            decoded = decode_weight_chunk(wire)
            assert decoded.data.obj is wire  # a view of the received bytes
            assert bytes(decoded.data) == message.data
            header = generator_pb2.WeightChunk()
            header.CopyFrom(message)
            header.ClearField("data")
            assert decoded.header == header


def test_malformed_bytes_are_refused_as_invalid_argument(tiny_llama):
    import grpc
    import pytest

    from generator_service.updates.tensors import expected_tensors
    from jaxrlhf_wire.chunks import (
        CHANNEL_OPTIONS,
        UPDATE_WEIGHTS_METHOD,
        MalformedChunkError,
        decode_weight_chunk,
    )
    from tests.generator_service.replicas import RecordingReplica

    good = generator_pb2.WeightChunk(name="x", data=b"abcd").SerializeToString()
    bad_name = b"\x1a\x02\xff\xfe"  # field 3 (name, a string) that is not UTF-8
    overlong_varint = b"\x3a" + b"\xff" * 10 + b"\x01"
    for bad in (good[:-1], b"\xff", overlong_varint, b"\x0f", bad_name):
        with pytest.raises(MalformedChunkError, match="malformed WeightChunk"):
            decode_weight_chunk(bad)
    replica = RecordingReplica(expected_tensors(tiny_llama))
    try:
        with grpc.insecure_channel(replica.address, options=list(CHANNEL_OPTIONS)) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.stream_unary(UPDATE_WEIGHTS_METHOD)(iter([b"\xff"]))
    finally:
        replica.stop()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed WeightChunk" in caught.value.details()
