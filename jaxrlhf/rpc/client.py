"""A thin synchronous client for the generator service, and the weight-chunking helper.

The learner uses `iter_weight_chunks` to stream its parameters (numpy or JAX arrays, already in
the Hugging Face layout) and `GeneratorClient` for everything else. Only numpy and grpc here:
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
DEFAULT_CHUNK_BYTES = 4 << 20
# Weight chunks are a few MiB; the gRPC default receive limit (4 MiB) is too tight for them.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
WEIGHT_DTYPES = ("float32", "bfloat16", "float16")


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
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    items: Iterable[tuple[str, Any]] = tensors.items() if isinstance(tensors, Mapping) else tensors
    if num_tensors is None:
        items = list(items)
        num_tensors = len(items)
    for name, array in items:
        dtype_name, shape, data = _tensor_bytes(name, array)
        offset = 0
        while True:
            piece = data[offset : offset + chunk_bytes]
            yield generator_pb2.WeightChunk(
                policy_version=policy_version,
                num_tensors=num_tensors,
                allow_rollback=allow_rollback,
                name=name,
                dtype=dtype_name,
                shape=shape,
                offset=offset,
                data=piece.tobytes(),
            )
            offset += len(piece)
            if offset >= len(data):
                break


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
        chunks = iter_weight_chunks(tensors, policy_version, chunk_bytes)
        return self.stub.UpdateWeights(chunks, timeout=timeout, metadata=self.metadata)

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
