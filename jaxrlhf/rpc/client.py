"""A thin synchronous client for the generator service, and the weight-chunking helpers.

The learner streams its parameters (numpy or JAX arrays, already in the Hugging Face layout) with
`encode_weight_chunks`: WeightChunk messages serialised by hand, so that each tensor's bytes are
copied once, straight into the message (protobuf would copy them three times: into a `bytes`,
into the message, into its serialisation). `iter_weight_chunks` yields the same chunks as
message objects, for callers that build or alter streams themselves. Only numpy and grpc here:
this module runs in the learner process, which must not import vLLM or torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from jaxrlhf.rpc import generator_pb2, generator_pb2_grpc

AUTH_HEADER = "authorization"
# Measured on loopback (bench/weight_sync.py): 16 MiB chunks stream no faster than 4 MiB and
# vary more; smaller ones add per-message overhead.
DEFAULT_CHUNK_BYTES = 4 << 20
# The gRPC default receive limit (4 MiB) is too tight for a 4 MiB chunk plus its header; both
# sides (channel and server) use this limit, and chunk_bytes must stay below it.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Socket reads of up to 16 MiB instead of gRPC's small adaptive ones: fewer reads and
    # buffers per weight chunk (~15% less CPU receiving an update on loopback, measured).
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 16 << 20),
)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")
UPDATE_WEIGHTS_METHOD = (
    f"/{generator_pb2.DESCRIPTOR.services_by_name['Generator'].full_name}/UpdateWeights"
)
# Tag of WeightChunk.data on the wire: its field number, wire type 2 (length-delimited).
_DATA_FIELD = generator_pb2.WeightChunk.DESCRIPTOR.fields_by_name["data"].number
_DATA_TAG = bytes([_DATA_FIELD << 3 | 2])


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the shared secret (empty without one)."""
    return ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()


def _tensor_bytes(name: str, array: Any) -> tuple[str, tuple[int, ...], memoryview]:
    array = np.asarray(array)
    dtype_name = str(array.dtype)
    if dtype_name not in WEIGHT_DTYPES:
        raise ValueError(f"tensor {name} has dtype {dtype_name}; send one of {WEIGHT_DTYPES}")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    array = np.ascontiguousarray(array)
    return dtype_name, tuple(array.shape), memoryview(array.reshape(-1).view(np.uint8))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _iter_pieces(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    chunk_bytes: int,
    num_tensors: int | None,
) -> Iterator[tuple[int, str, str, tuple[int, ...], int, memoryview]]:
    """(num_tensors, name, dtype, shape, byte offset, bytes) of every chunk, tensor by tensor."""
    if chunk_bytes <= 0 or chunk_bytes > MAX_MESSAGE_BYTES - (1 << 20):
        raise ValueError(
            f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - (1 << 20)}], got {chunk_bytes}"
        )
    items: Iterable[tuple[str, Any]] = tensors.items() if isinstance(tensors, Mapping) else tensors
    if num_tensors is None:
        items = list(items)
        num_tensors = len(items)
    for name, array in items:
        dtype_name, shape, data = _tensor_bytes(name, array)
        offset = 0
        while True:
            piece = data[offset : offset + chunk_bytes]
            yield num_tensors, name, dtype_name, shape, offset, piece
            offset += len(piece)
            if offset >= len(data):
                break


def _header(
    policy_version: int,
    allow_rollback: bool,
    num_tensors: int,
    name: str,
    dtype_name: str,
    shape: tuple[int, ...],
    offset: int,
) -> generator_pb2.WeightChunk:
    """A chunk's every field but its data."""
    return generator_pb2.WeightChunk(
        policy_version=policy_version,
        num_tensors=num_tensors,
        allow_rollback=allow_rollback,
        name=name,
        dtype=dtype_name,
        shape=shape,
        offset=offset,
    )


def iter_weight_chunks(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    policy_version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_tensors: int | None = None,
    allow_rollback: bool = False,
) -> Iterator[generator_pb2.WeightChunk]:
    """Splits named arrays into `WeightChunk`s of at most `chunk_bytes` data each.

    Lazy: one tensor's bytes at a time are copied into messages. With `num_tensors` given,
    `tensors` may be a one-pass iterator (e.g. parameters converted on the fly) and is never
    held in full; without it, it is listed first to count it. A count that does not match what
    is sent is refused by the server. A zero-size tensor is sent as one empty chunk.
    """
    for *fields, piece in _iter_pieces(tensors, chunk_bytes, num_tensors):
        chunk = _header(policy_version, allow_rollback, *fields)
        chunk.data = piece.tobytes()
        yield chunk


def encode_weight_chunks(
    tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
    policy_version: int,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_tensors: int | None = None,
    allow_rollback: bool = False,
) -> Iterator[bytes]:
    """The chunks of `iter_weight_chunks`, serialised: send them with `update_weights_encoded`.

    Each message is the protobuf encoding of the chunk without its data, followed by the data
    field (protobuf accepts fields in any order), so the tensor's bytes are copied only once.
    """
    for *fields, piece in _iter_pieces(tensors, chunk_bytes, num_tensors):
        header = _header(policy_version, allow_rollback, *fields).SerializeToString()
        yield b"".join((header, _DATA_TAG, _varint(len(piece)), piece))


def make_channel(
    target: str,
    root_certificates: bytes | None = None,
    options: Iterable[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to `target`: TLS when `root_certificates` (PEM) are given, plaintext otherwise."""
    all_options = list(CHANNEL_OPTIONS) + list(options)
    if root_certificates is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        return grpc.secure_channel(target, credentials, options=all_options)
    return grpc.insecure_channel(target, options=all_options)


class GeneratorClient:
    """Blocking client: one channel, the shared secret sent with every call.

    `stub` is exposed for callers that need the raw RPCs (e.g. a hand-built chunk stream).
    """

    def __init__(
        self,
        target: str,
        auth_token: str | None = None,
        root_certificates: bytes | None = None,
        options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        self.target = target
        self.channel = make_channel(target, root_certificates, options)
        self.stub = generator_pb2_grpc.GeneratorStub(self.channel)
        self.metadata = auth_metadata(auth_token)
        # UpdateWeights taking chunks already serialised by `encode_weight_chunks`.
        self._update_weights_encoded = self.channel.stream_unary(
            UPDATE_WEIGHTS_METHOD,
            request_serializer=None,
            response_deserializer=generator_pb2.UpdateWeightsResponse.FromString,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[generator_pb2.Prompt],
        max_tokens: int,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        min_tokens: int = 0,
        timeout: float | None = None,
        seed: int | None = None,
    ) -> Iterator[generator_pb2.Completion]:
        """Streams completions as they finish; plain token lists get ids "0", "1", ..."""
        prompt_messages = [
            prompt
            if isinstance(prompt, generator_pb2.Prompt)
            else generator_pb2.Prompt(id=str(index), token_ids=list(prompt))
            for index, prompt in enumerate(prompts)
        ]
        request = generator_pb2.GenerateRequest(
            prompts=prompt_messages,
            sampling=generator_pb2.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_tokens=max_tokens,
                stop_token_ids=list(stop_token_ids),
                ignore_eos=ignore_eos,
                min_tokens=min_tokens,
            ),
            seed=seed,
        )
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def update_weights(
        self,
        tensors: Mapping[str, Any] | Sequence[tuple[str, Any]],
        policy_version: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout: float | None = None,
    ) -> generator_pb2.UpdateWeightsResponse:
        """Sends a full set of Hugging Face tensors as `policy_version`; returns once swapped."""
        chunks = encode_weight_chunks(tensors, policy_version, chunk_bytes)
        return self.update_weights_encoded(chunks, timeout=timeout)

    def update_weights_encoded(
        self, chunks: Iterable[bytes], timeout: float | None = None
    ) -> generator_pb2.UpdateWeightsResponse:
        """UpdateWeights with chunks from `encode_weight_chunks` (consumed in gRPC's thread)."""
        return self._update_weights_encoded(iter(chunks), timeout=timeout, metadata=self.metadata)

    def update_weights_shared(
        self, request: generator_pb2.SharedWeights, timeout: float | None = None
    ) -> generator_pb2.UpdateWeightsResponse:
        """UpdateWeightsShared: swaps in the tensors the request points at in a shared file
        (see `jaxrlhf.rpc.shared`); the server must run on this host."""
        return self.stub.UpdateWeightsShared(request, timeout=timeout, metadata=self.metadata)

    def status(self, timeout: float | None = None) -> generator_pb2.GeneratorStatus:
        return self.stub.GetStatus(
            generator_pb2.GetStatusRequest(), timeout=timeout, metadata=self.metadata
        )

    def wait_until_serving(self, timeout: float = 300.0) -> generator_pb2.GeneratorStatus:
        """Polls GetStatus until the server answers and serves, or raises TimeoutError."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                status = self.status(timeout=5.0)
                if status.serving:
                    return status
            except grpc.RpcError as error:
                last_error = error
            time.sleep(0.5)
        raise TimeoutError(f"generator at {self.target} not serving after {timeout}s: {last_error}")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GeneratorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
