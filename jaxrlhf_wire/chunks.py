"""WeightChunk streams (UpdateWeights), both ways, and the message sizes both ends agree on.

The learner streams its parameters (numpy or JAX arrays, already in the Hugging Face layout) with
`encode_weight_chunks`: WeightChunk messages serialised by hand, so that each tensor's bytes are
copied once, straight into the message (protobuf would copy them three times: into a `bytes`,
into the message, into its serialisation). The server decodes them with `decode_weight_chunk`,
which leaves each chunk's data a view of the received bytes.
Only numpy, grpc and protobuf here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from jaxrlhf_wire.dtypes import WEIGHT_DTYPES, wire_dtype_name
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2

# Measured on loopback (bench/weight_sync.py): 16 MiB chunks stream no faster than 4 MiB and
# vary more; smaller ones add per-message overhead.
DEFAULT_CHUNK_BYTES = 4 << 20
# The gRPC default receive limit (4 MiB) is too tight for a 4 MiB chunk plus its header; both
# sides (channel and server) use this limit, and chunk_bytes must stay below it.
MAX_MESSAGE_BYTES = 64 << 20
MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES - (1 << 20)  # room for the chunk's other fields
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Socket reads of up to 16 MiB instead of gRPC's small adaptive ones: fewer reads and
    # buffers per weight chunk (~15% less CPU receiving an update on loopback, measured).
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
)
UPDATE_WEIGHTS_METHOD = f"/{SERVICE_NAME}/UpdateWeights"
# WeightChunk.data's key on the wire: its field number, wire type 2 (length-delimited).
DATA_KEY = generator_pb2.WeightChunk.DESCRIPTOR.fields_by_name["data"].number << 3 | 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


DATA_TAG = _varint(DATA_KEY)


# --- encoding (the learner) -------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSlice:
    """A box of a tensor of `shape`: `data` is tensor[start[0] : start[0] + data.shape[0], ...]
    (any array, a strided view too). A process of a multi-process learner sends these, the
    parts of each tensor that its devices hold, so that no process gathers a whole tensor."""

    shape: tuple[int, ...]
    start: tuple[int, ...]
    data: Any


def _wire_array(name: str, array: Any) -> tuple[str, np.ndarray]:
    array = np.asarray(array)
    dtype_name = wire_dtype_name(array.dtype)
    if dtype_name is None:
        raise ValueError(f"tensor {name} has dtype {array.dtype}; send one of {WEIGHT_DTYPES}")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return dtype_name, array


def _row_blocks(array: np.ndarray, chunk_bytes: int) -> Iterator[tuple[int, memoryview]]:
    """(byte offset, bytes) of `array`'s row-major bytes, at most `chunk_bytes` each: whole
    rows (of its first axis) at a time where a row fits, so that a strided array (a transposed
    kernel, a shard's view) is copied a block at a time, never whole."""
    if array.ndim == 0 or array.size == 0:
        yield 0, memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        return
    row_bytes = array.nbytes // array.shape[0]
    rows = max(1, chunk_bytes // max(1, row_bytes))
    for first in range(0, array.shape[0], rows):
        block = np.ascontiguousarray(array[first : first + rows])
        data = memoryview(block.reshape(-1).view(np.uint8))
        for within in range(0, len(data), chunk_bytes):
            yield first * row_bytes + within, data[within : within + chunk_bytes]


def _iter_pieces(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    chunk_bytes: int,
    num_tensors: int | None,
) -> Iterator[tuple[tuple, memoryview]]:
    """(header fields, bytes) of every chunk, tensor (or slice) by tensor; the fields are
    (num_tensors, name, dtype, shape, byte offset, slice_start, slice_shape)."""
    if chunk_bytes <= 0 or chunk_bytes > MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    items: Iterable[tuple[str, Any]] = tensors.items() if isinstance(tensors, Mapping) else tensors
    if num_tensors is None:
        items = list(items)
        num_tensors = len({name for name, _ in items})
    for name, value in items:
        if isinstance(value, TensorSlice):
            dtype_name, array = _wire_array(name, value.data)
            shape, start, extent = tuple(value.shape), tuple(value.start), tuple(array.shape)
            if len(start) != len(shape) or len(extent) != len(shape):
                raise ValueError(
                    f"slice of tensor {name} {list(shape)}: start {list(start)} "
                    f"and data shape {list(extent)} need one entry per dimension"
                )
        else:
            dtype_name, array = _wire_array(name, value)
            shape, start, extent = tuple(array.shape), (), ()
        for offset, piece in _row_blocks(array, chunk_bytes):
            yield (num_tensors, name, dtype_name, shape, offset, start, extent), piece


def _header(
    policy_version: int,
    allow_rollback: bool,
    num_senders: int,
    sender: int,
    update_id: str,
    num_tensors: int,
    name: str,
    dtype_name: str,
    shape: tuple[int, ...],
    offset: int,
    slice_start: tuple[int, ...],
    slice_shape: tuple[int, ...],
    lora: generator_pb2.LoraAdapter | None = None,
) -> generator_pb2.WeightChunk:
    """A chunk's every field but its data."""
    return generator_pb2.WeightChunk(
        lora=lora,
        policy_version=policy_version,
        num_tensors=num_tensors,
        allow_rollback=allow_rollback,
        name=name,
        dtype=dtype_name,
        shape=shape,
        offset=offset,
        slice_start=slice_start,
        slice_shape=slice_shape,
        num_senders=num_senders,
        sender=sender,
        update_id=update_id,
    )


def encode_weight_chunks(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    policy_version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_tensors: int | None = None,
    allow_rollback: bool = False,
    num_senders: int = 0,
    sender: int = 0,
    update_id: str = "",
    lora: generator_pb2.LoraAdapter | None = None,
) -> Iterator[bytes]:
    """Named arrays as serialised `WeightChunk`s of at most `chunk_bytes` data each, for an
    UpdateWeights call whose request serializer is None
    (`jaxrlhf.fleet.rpc.GeneratorClient.update_weights_encoded`).

    Lazy: one tensor's bytes at a time are copied into messages, a block of rows at a time.
    A value may be a `TensorSlice` (a box of the named tensor); `num_tensors` counts distinct
    names. With `num_tensors` given, `tensors` may be a one-pass iterator (e.g. parameters
    converted on the fly) and is never held in full; without it, it is listed first to count
    it. A count that does not match what is sent is refused by the server. A zero-size tensor
    is sent as one empty chunk. `num_senders`/`sender`: this stream is one of several that
    carry the update (WeightChunk in the .proto). `update_id`: the update's identity, the same
    over its streams and retries (WeightChunk.update_id). `lora`: the tensors are a LoRA
    adapter with these settings, for a "lora" server (WeightChunk.lora).

    Each message is the protobuf encoding of the chunk without its data, followed by the data
    field (protobuf accepts fields in any order), so the tensor's bytes are copied only once.
    """
    for fields, piece in _iter_pieces(tensors, chunk_bytes, num_tensors):
        header = _header(policy_version, allow_rollback, num_senders, sender, update_id, *fields,
                         lora=lora)  # fmt: skip
        yield b"".join((header.SerializeToString(), DATA_TAG, _varint(len(piece)), piece))


# --- decoding (the server) --------------------------------------------------------------------


class MalformedChunkError(ValueError):
    """Bytes that are not a WeightChunk (the server answers INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class ReceivedChunk:
    """A WeightChunk as received: every field but `data` in `header`, and `data` as a view of
    the message's bytes."""

    header: generator_pb2.WeightChunk
    data: memoryview


def _read_varint(raw: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(raw) or shift > 63:
            raise MalformedChunkError("malformed WeightChunk: bad varint")
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def decode_weight_chunk(raw: bytes) -> ReceivedChunk:
    """Parses a serialised WeightChunk without copying its data (protobuf would copy it twice).

    The top-level fields are walked; `data` (the last one, if repeated, as protobuf decides) is
    sliced out and every other field is parsed by protobuf itself.
    """
    view = memoryview(raw)
    data = view[:0]
    header_parts = []
    position = 0
    while position < len(raw):
        field_start = position
        key, position = _read_varint(raw, position)
        wire_type = key & 7
        if wire_type == 0:
            _, position = _read_varint(raw, position)
        elif wire_type == 1:
            position += 8
        elif wire_type == 2:
            length, position = _read_varint(raw, position)
            position += length
        elif wire_type == 5:
            position += 4
        else:
            raise MalformedChunkError(f"malformed WeightChunk: wire type {wire_type}")
        if position > len(raw):
            raise MalformedChunkError("malformed WeightChunk: a field runs past the message")
        if key == DATA_KEY:
            data = view[position - length : position]
        else:
            header_parts.append(view[field_start:position])
    try:
        header = generator_pb2.WeightChunk.FromString(b"".join(header_parts))
    except DecodeError as error:
        raise MalformedChunkError(f"malformed WeightChunk: {error}") from error
    return ReceivedChunk(header, data)
