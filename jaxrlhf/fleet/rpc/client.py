"""A thin synchronous client for the generator service.

Weights go out as chunks encoded by `jaxrlhf_wire.chunks.encode_weight_chunks` (each tensor's
bytes copied once, straight into its messages). Only grpc and the wire contract here: this
module runs in the learner process, which must not import vLLM or torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from jaxrlhf_wire import AUTH_HEADER

# These live in jaxrlhf_wire (the contract both sides import); re-exported for the learner.
from jaxrlhf_wire.chunks import (  # noqa: F401
    CHANNEL_OPTIONS,
    DEFAULT_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    UPDATE_WEIGHTS_METHOD,
    encode_weight_chunks,
)
from jaxrlhf_wire.dtypes import WEIGHT_DTYPES  # noqa: F401
from jaxrlhf_wire.stubs import generator_pb2, generator_pb2_grpc

# A server's answers to a missing or wrong token: no retry can change them.
REFUSED_CREDENTIALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries the shared secret (empty without one)."""
    return ((AUTH_HEADER, f"Bearer {auth_token}"),) if auth_token else ()


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
        seed_per_request: bool = False,
        max_running: int = 0,
    ) -> Iterator[generator_pb2.Completion]:
        """Streams completions as they finish; plain token lists get ids "0", "1", ...
        (`seed`, `seed_per_request`, `max_running`: GenerateRequest's.)"""
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
            seed_per_request=seed_per_request,
            max_running=max_running,
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
        (see `jaxrlhf.fleet.rpc.weights_file`); the server must run on this host."""
        return self.stub.UpdateWeightsShared(request, timeout=timeout, metadata=self.metadata)

    def status(self, timeout: float | None = None) -> generator_pb2.GeneratorStatus:
        return self.stub.GetStatus(
            generator_pb2.GetStatusRequest(), timeout=timeout, metadata=self.metadata
        )

    def wait_until_serving(self, timeout: float = 300.0) -> generator_pb2.GeneratorStatus:
        """Polls GetStatus until the server answers and serves, or raises TimeoutError; raises
        PermissionError at once if it refuses this client's credentials (waiting cannot help)."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                status = self.status(timeout=5.0)
                if status.serving:
                    return status
            except grpc.RpcError as error:
                if error.code() in REFUSED_CREDENTIALS:
                    raise PermissionError(
                        f"generator at {self.target} refused this learner's credentials "
                        f"({error.code().name}: {error.details()}); give the learner the token "
                        "the generator was started with, in the environment variable that "
                        "config.generator.auth_token_env names"
                    ) from error
                last_error = error
            time.sleep(0.5)
        raise TimeoutError(f"generator at {self.target} not serving after {timeout}s: {last_error}")

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GeneratorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
