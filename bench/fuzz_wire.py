"""Fuzzes the generator service's wire with Hypothesis: every input gets a clear status, and the
server stays up, serving its old weights.

    python bench/fuzz_wire.py --seconds 600      # its own server (the suite's tiny Llama)
    python bench/fuzz_wire.py --address 127.0.0.1:50051 --model DIR --seconds 60
                                                 # a running server that serves DIR's weights

What is sent, one input at a time, to a real server (a vLLM engine behind gRPC on loopback):

- UpdateWeights streams: the served weights, encoded as the learner encodes them, then mutated:
  chunks dropped, duplicated, swapped, cut short, the stream stopped early or cancelled half-way,
  header fields set in one chunk or in all (version, tensor count, name, dtype, shape, offset,
  rollback, senders, slices, update_id), bytes overwritten or inserted anywhere in a chunk's
  serialised bytes, extra raw protobuf fields and random chunks added. Every chunk sent is also
  decoded by the server's own decoder (`decode_weight_chunk`) and by protobuf: both must agree.
- UpdateWeightsShared requests: a real shared file of the served weights, with its tensor list
  mutated and its path replaced (missing, outside the shared folder, a symbolic link out, the
  folder itself, a truncated copy, an embedded NUL, arbitrary text).
- Generate requests with any field at any value (n, temperature, top-p/k, token ids, lengths,
  seeds, ids), and raw bytes, random or a valid message mutated, to Generate, UpdateWeightsShared
  and GetStatus.

The checks after each input: an error is one of the statuses the .proto documents for the call,
with a message (never UNKNOWN: an unexpected exception in the server); the server answers
GetStatus and the health check SERVING; a refused update leaves the version and the update count
as they were; an accepted one is served (a Generate on it succeeds, tagged with its version) and
is then replaced by the original weights. Every 10 inputs, and at the end, greedy completions
must equal those taken before the run. Hypothesis shrinks a failing input to a minimal one.

Prints one JSON line: inputs tried, per kind and per status, seconds, and the failure (the
shrunk input and what went wrong) if any; exits 1 on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf.unknown_fields import UnknownFieldSet
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from jaxrlhf.fleet.rpc import GeneratorClient
from jaxrlhf.fleet.rpc.weights_file import SharedWeightsFile
from jaxrlhf_wire.chunks import (
    UPDATE_WEIGHTS_METHOD,
    MalformedChunkError,
    decode_weight_chunk,
    encode_weight_chunks,
)
from jaxrlhf_wire.stubs import SERVICE_NAME, generator_pb2

CALL_TIMEOUT = 60.0
# A Generate call asking for more tokens than this is cancelled after its first completion.
WORK_LIMIT = 4096
GREEDY_PROMPTS = [[5, 6, 7, 8], [9, 10], [1, 200, 31, 77, 150, 3]]
GREEDY_TOKENS = 8
GREEDY_EVERY = 10
UINT64_MAX = 2**64 - 1
# What each call may answer besides OK (protos/generator.proto); CANCELLED only when we cancel.
ALLOWED = {
    "UpdateWeights": {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DATA_LOSS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        # A stream that says it is one of several, whose other senders never come.
        grpc.StatusCode.ABORTED,
    },
    "UpdateWeightsShared": {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.DATA_LOSS,
    },
    # FAILED_PRECONDITION: seed_per_request on the CPU backend.
    "Generate": {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION},
    "GetStatus": set(),
}
# Bytes that are not the method's message get INVALID_ARGUMENT from every method.
for _codes in ALLOWED.values():
    _codes.add(grpc.StatusCode.INVALID_ARGUMENT)


class FuzzFailure(AssertionError):
    """An input that broke a property of the service."""


# --- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamCase:
    """The served weights as an UpdateWeights stream, mutated by `ops`; `cancel_after`: the
    client sends that many chunks (modulo the stream's length) and cancels the call."""

    chunk_bytes: int
    ops: tuple
    cancel_after: int | None


@dataclass(frozen=True)
class SharedCase:
    """UpdateWeightsShared on a real file of the served weights, mutated."""

    path: str | tuple  # a kind of path (see WireFuzzer._shared_path) or arbitrary text
    ops: tuple
    version: Any
    allow_rollback: bool


@dataclass(frozen=True)
class GenerateCase:
    request: generator_pb2.GenerateRequest


@dataclass(frozen=True)
class RawCase:
    """Bytes sent as the request of a unary method, below protobuf."""

    method: str
    data: bytes


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


INDEX = st.integers(0, 2**16)  # taken modulo the length of what it indexes
BYTE_POSITION = st.one_of(st.integers(0, 48), st.integers(0, 2**22))
# Versions relative to the served one (("next", d): served + 1 + d) or absolute.
VERSION = st.one_of(
    st.tuples(st.just("next"), st.integers(-2, 2)),
    st.sampled_from([0, 2**63 - 1, 2**63, UINT64_MAX]),
    st.integers(0, UINT64_MAX),
)
# A protobuf field as raw bytes: any field number and wire type, then a payload.
RAW_FIELD = st.builds(
    lambda number, wire_type, payload: (
        _varint(number << 3 | wire_type)
        + (_varint(len(payload)) if wire_type == 2 else b"")
        + payload
    ),
    st.one_of(st.integers(1, 9), st.integers(0, 2**32)),
    st.integers(0, 7),
    st.binary(max_size=16),
)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)
DTYPE = st.one_of(
    st.sampled_from(["float32", "bfloat16", "float16", "float64", "int8", "F32", ""]), TEXT
)


def _shape(shapes: list[tuple[int, ...]]):
    return st.one_of(
        st.sampled_from(shapes),
        st.lists(st.integers(0, 300), max_size=3),
        st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4),
    )


def stream_cases(names: list[str], shapes: list[tuple[int, ...]]):
    """Mutated UpdateWeights streams of a model with these tensors."""
    name = st.one_of(st.sampled_from(names), st.just("lm_head.weight"), TEXT)
    values = {
        "policy_version": VERSION,
        "num_tensors": st.one_of(
            st.tuples(st.just("count"), st.integers(-2, 2)), st.integers(0, 2**32 - 1)
        ),
        "name": name,
        "dtype": DTYPE,
        "shape": _shape(shapes),
        "offset": st.one_of(
            st.tuples(st.just("shift"), st.integers(-8, 8)), st.integers(0, UINT64_MAX)
        ),
        "allow_rollback": st.booleans(),
        # One of several senders (a stream alone that says so waits for the others, then is
        # refused: the server under fuzz waits only a few seconds, --senders-timeout).
        "num_senders": st.integers(0, 3),
        "sender": st.integers(0, 3),
        "update_id": TEXT,  # set in one chunk: the chunks of the stream disagree
        "slice_start": st.lists(st.integers(-2, 300), max_size=3),
        "slice_shape": st.lists(st.integers(-2, 300), max_size=3),
    }
    field = st.sampled_from(sorted(values)).flatmap(
        lambda key: st.tuples(
            st.sampled_from(["field", "field_all"]), INDEX, st.just(key), values[key]
        )  # fmt: skip
    )
    op = st.one_of(
        st.tuples(st.just("drop"), INDEX),
        st.tuples(st.just("duplicate"), INDEX),
        st.tuples(st.just("swap"), INDEX, INDEX),
        st.tuples(st.just("stop_after"), INDEX),
        st.tuples(st.just("cut"), INDEX, BYTE_POSITION),
        st.tuples(st.just("set_byte"), INDEX, BYTE_POSITION, st.integers(0, 255)),
        st.tuples(st.just("insert"), INDEX, BYTE_POSITION, st.binary(min_size=1, max_size=16)),
        st.tuples(st.just("extra_field"), INDEX, RAW_FIELD),
        st.tuples(st.just("random_chunk"), INDEX, st.binary(max_size=64)),
        field,
    )
    return st.builds(
        StreamCase,
        chunk_bytes=st.sampled_from([1 << 12, 1 << 16, 1 << 20]),
        ops=st.lists(op, max_size=4).map(tuple),
        cancel_after=st.one_of(st.none(), INDEX),
    )


def shared_cases(names: list[str], shapes: list[tuple[int, ...]]):
    """Mutated UpdateWeightsShared requests."""
    position = st.one_of(
        st.tuples(st.just("shift"), st.sampled_from([-4096, -1, 1, 4096, 8192])),
        st.integers(0, UINT64_MAX),
    )
    values = {
        "name": st.one_of(st.sampled_from(names), TEXT),
        "dtype": DTYPE,
        "shape": _shape(shapes),
        "position": position,
    }
    field = st.sampled_from(sorted(values)).flatmap(
        lambda key: st.tuples(st.just("field"), INDEX, st.just(key), values[key])
    )
    op = st.one_of(
        st.tuples(st.just("drop"), INDEX),
        st.tuples(st.just("duplicate"), INDEX),
        st.tuples(st.just("swap"), INDEX, INDEX),
        field,
    )
    path_kinds = ["file", "missing", "outside", "symlink", "folder", "relative", "nul", "long",
                  "dotdot", "empty", "truncated"]  # fmt: skip
    return st.builds(
        SharedCase,
        path=st.one_of(st.sampled_from(path_kinds), st.tuples(st.just("text"), TEXT)),
        ops=st.lists(op, max_size=3).map(tuple),
        version=VERSION,
        allow_rollback=st.booleans(),
    )


def generate_requests(vocab_size: int, max_model_len: int):
    """GenerateRequests with any field at any value, small ones most often."""
    token = st.one_of(st.integers(0, vocab_size + 1), st.integers(-(2**31), 2**31 - 1))
    prompt = st.builds(
        generator_pb2.Prompt,
        id=TEXT,
        token_ids=st.one_of(
            st.lists(token, max_size=8),
            st.lists(token, min_size=max_model_len - 2, max_size=max_model_len + 1),
        ),  # fmt: skip
    )
    float32 = st.floats(width=32)
    sampling = st.builds(
        generator_pb2.SamplingParams,
        n=st.one_of(st.integers(0, 4), st.integers(0, 2**32 - 1)),
        temperature=st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5]), float32),
        top_p=st.one_of(st.just(0.0), float32),
        top_k=st.one_of(st.integers(-2, 4), st.integers(-(2**31), 2**31 - 1)),
        max_tokens=st.one_of(st.integers(0, 16), st.integers(0, 2**32 - 1)),
        stop_token_ids=st.lists(token, max_size=3),
        ignore_eos=st.booleans(),
        min_tokens=st.one_of(st.integers(0, 16), st.integers(0, 2**32 - 1)),
    )
    return st.builds(
        lambda prompts, sampling, seed, per_request: generator_pb2.GenerateRequest(
            prompts=prompts, sampling=sampling, seed=seed, seed_per_request=per_request
        ),
        st.lists(prompt, max_size=3),
        sampling,
        st.one_of(st.none(), st.integers(0, UINT64_MAX)),
        st.booleans(),
    )


def _mutated(data: bytes):
    """`data` with a byte overwritten, bytes inserted, or cut short."""
    return st.one_of(
        st.tuples(BYTE_POSITION, st.integers(0, 255)).map(
            lambda op: _set_byte(data, *op) if data else data
        ),
        st.tuples(BYTE_POSITION, st.binary(min_size=1, max_size=8)).map(
            lambda op: _insert(data, *op)
        ),
        BYTE_POSITION.map(lambda position: data[: position % (len(data) + 1)]),
    )


def raw_cases(valid: dict[str, bytes]):
    """Random bytes, or a valid message's bytes mutated, to each unary method."""
    return st.sampled_from(sorted(valid)).flatmap(
        lambda method: st.builds(
            RawCase, st.just(method), st.one_of(st.binary(max_size=128), _mutated(valid[method]))
        )
    )


def _set_byte(data: bytes, position: int, value: int) -> bytes:
    position %= len(data)
    return data[:position] + bytes([value]) + data[position + 1 :]


def _insert(data: bytes, position: int, extra: bytes) -> bytes:
    position %= len(data) + 1
    return data[:position] + extra + data[position:]


# --- mutations --------------------------------------------------------------------------------


def _resolve(value: Any, version: int, count: int, offset: int = 0) -> Any:
    """A drawn value made concrete: relative versions, counts and offsets, clamped to uint64."""
    if isinstance(value, tuple) and value and value[0] in ("next", "count", "shift"):
        base = {"next": version + 1, "count": count, "shift": offset}[value[0]]
        return min(max(base + value[1], 0), UINT64_MAX)
    return value


def _set_field(message, key: str, value: Any) -> None:
    if key in ("shape", "slice_start", "slice_shape"):  # repeated fields
        message.ClearField(key)
        getattr(message, key).extend(value)
    else:
        setattr(message, key, value)


def mutate_stream(chunks: list[bytes], ops: tuple, version: int, count: int) -> list[bytes]:
    """Applies stream `ops` to serialised chunks (header fields through protobuf itself)."""
    chunks = list(chunks)
    for kind, index, *args in ops:
        if not chunks and kind != "random_chunk":
            continue
        at = index % max(len(chunks), 1)
        if kind == "drop":
            del chunks[at]
        elif kind == "duplicate":
            chunks.insert(at, chunks[at])
        elif kind == "swap":
            other = args[0] % len(chunks)
            chunks[at], chunks[other] = chunks[other], chunks[at]
        elif kind == "stop_after":
            del chunks[at:]
        elif kind == "cut":
            chunks[at] = chunks[at][: args[0] % (len(chunks[at]) + 1)]
        elif kind == "set_byte":
            chunks[at] = _set_byte(chunks[at], *args) if chunks[at] else chunks[at]
        elif kind == "insert":
            chunks[at] = _insert(chunks[at], *args)
        elif kind == "extra_field":
            chunks[at] += args[0]
        elif kind == "random_chunk":
            chunks.insert(index % (len(chunks) + 1), args[0])
        else:  # "field", "field_all": through protobuf, if the chunk still parses
            targets = range(len(chunks)) if kind == "field_all" else [at]
            for target in targets:
                chunks[target] = _with_field(chunks[target], *args, version, count)
    return chunks


def _with_field(raw: bytes, key: str, value: Any, version: int, count: int) -> bytes:
    try:
        chunk = generator_pb2.WeightChunk.FromString(raw)
    except Exception:  # noqa: BLE001 - an earlier mutation broke it: leave it broken
        return raw
    _set_field(chunk, key, _resolve(value, version, count, chunk.offset))
    return chunk.SerializeToString()


def mutate_shared(request, ops: tuple, version: int) -> None:
    """Applies `ops` to the tensor list of a SharedWeights request, in place."""
    tensors = list(request.tensors)
    for kind, index, *args in ops:
        if not tensors:
            break
        at = index % len(tensors)
        if kind == "drop":
            del tensors[at]
        elif kind == "duplicate":
            tensors.insert(at, tensors[at])
        elif kind == "swap":
            other = args[0] % len(tensors)
            tensors[at], tensors[other] = tensors[other], tensors[at]
        else:
            tensor = generator_pb2.SharedTensor()
            tensor.CopyFrom(tensors[at])
            key, value = args
            _set_field(tensor, key, _resolve(value, version, len(tensors), tensor.position))
            tensors[at] = tensor
    del request.tensors[:]
    request.tensors.extend(tensors)


def check_decoder(raw: bytes) -> None:
    """The server's copy-free decoder agrees with protobuf on `raw`: both refuse it, or both
    read the same fields and data."""
    try:
        expected = generator_pb2.WeightChunk.FromString(raw)
    except Exception:  # noqa: BLE001 - protobuf refuses: so must the decoder
        expected = None
    try:
        received = decode_weight_chunk(raw)
    except MalformedChunkError:
        if expected is not None and not _has_group(expected):
            raise FuzzFailure(f"decode_weight_chunk refused a valid WeightChunk: {raw!r}") from None
        return
    if expected is None:
        raise FuzzFailure(f"decode_weight_chunk accepted bytes protobuf refuses: {raw!r}")
    header = generator_pb2.WeightChunk()
    header.CopyFrom(expected)
    header.data = b""
    received.header.DiscardUnknownFields()
    header.DiscardUnknownFields()
    if received.header != header or bytes(received.data) != expected.data:
        raise FuzzFailure(f"decode_weight_chunk and protobuf disagree on {raw!r}")


def _has_group(chunk) -> bool:
    """Whether a parsed chunk holds a group (absent from proto3): the decoder refuses groups,
    protobuf keeps them as unknown fields."""
    return any(field.wire_type == 3 for field in UnknownFieldSet(chunk))


# --- the fuzzer -------------------------------------------------------------------------------


class WireFuzzer:
    """Sends inputs to one server and checks the properties after each (see the module doc).

    `tensors`: the weights the server serves now (restored after every accepted update).
    """

    def __init__(self, client: GeneratorClient, tensors: dict[str, np.ndarray]) -> None:
        self.client = client
        self.tensors = tensors
        status = client.status(timeout=CALL_TIMEOUT)
        if not status.serving:
            raise RuntimeError(f"the server at {client.target} does not serve")
        self.version = status.policy_version
        self.num_updates = status.num_updates
        self.vocab_size = status.vocab_size
        self.max_model_len = status.max_model_len
        self.inputs = 0
        self.kinds: Counter[str] = Counter()
        self.outcomes: Counter[str] = Counter()
        self.slowest = ("", 0.0)  # the kind of the slowest input, and its seconds
        channel = client.channel
        self._update = channel.stream_unary(
            UPDATE_WEIGHTS_METHOD,
            request_serializer=None,
            response_deserializer=generator_pb2.UpdateWeightsResponse.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(channel)
        self._raw = {
            "Generate": channel.unary_stream(
                f"/{SERVICE_NAME}/Generate",
                request_serializer=None,
                response_deserializer=generator_pb2.Completion.FromString,
            ),
            "UpdateWeightsShared": channel.unary_unary(
                f"/{SERVICE_NAME}/UpdateWeightsShared",
                request_serializer=None,
                response_deserializer=generator_pb2.UpdateWeightsResponse.FromString,
            ),
            "GetStatus": channel.unary_unary(f"/{SERVICE_NAME}/GetStatus", request_serializer=None),
        }
        self._folder = tempfile.TemporaryDirectory(prefix="fuzz-wire-")
        self._shared = self._make_shared_files(status.shared_weights_dir)
        self.baseline = self.greedy()

    # The strategy of every input, for this server's model.
    def cases(self):
        names = sorted(self.tensors)
        shapes = sorted({tuple(array.shape) for array in self.tensors.values()})
        valid = {
            "Generate": generator_pb2.GenerateRequest(
                prompts=[generator_pb2.Prompt(id="p", token_ids=[5, 6])],
                sampling=generator_pb2.SamplingParams(n=1, max_tokens=2),
            ).SerializeToString(),
            "UpdateWeightsShared": self._shared["file"].request(1).SerializeToString(),
            "GetStatus": b"",
        }
        return st.one_of(
            stream_cases(names, shapes),
            shared_cases(names, shapes),
            generate_requests(self.vocab_size, self.max_model_len).map(GenerateCase),
            raw_cases(valid),
        )

    def check(self, case: Any) -> None:
        """Sends one input and checks every property; raises FuzzFailure naming the broken one."""
        self.inputs += 1
        kind = type(case).__name__
        self.kinds[kind] += 1
        started = time.monotonic()
        if isinstance(case, StreamCase):
            self._stream(case)
        elif isinstance(case, SharedCase):
            self._shared_update(case)
        elif isinstance(case, GenerateCase):
            self._generate(case.request, lambda: self.client.stub.Generate(
                case.request, timeout=CALL_TIMEOUT, metadata=self.client.metadata))  # fmt: skip
        else:
            self._raw_call(case)
        self._check_up()
        if self.inputs % GREEDY_EVERY == 0:
            self._check_weights()
        seconds = time.monotonic() - started
        if seconds > self.slowest[1]:
            self.slowest = (kind, seconds)

    # -- per kind of input

    def _stream(self, case: StreamCase) -> None:
        encoded = encode_weight_chunks(self.tensors, self.version + 1, case.chunk_bytes)
        chunks = mutate_stream(list(encoded), case.ops, self.version, len(self.tensors))
        for raw in chunks:
            check_decoder(raw)
        if case.cancel_after is not None:
            self._cancelled_stream(chunks, case.cancel_after % (len(chunks) + 1))
            return
        self._update_outcome(
            "UpdateWeights",
            lambda: self._update(iter(chunks), timeout=CALL_TIMEOUT, metadata=self.client.metadata),
        )

    def _cancelled_stream(self, chunks: list[bytes], count: int) -> None:
        """Sends `count` chunks, then cancels the call before the stream ends."""
        sent, release = threading.Event(), threading.Event()

        def requests() -> Iterator[bytes]:
            yield from chunks[:count]
            sent.set()
            release.wait(CALL_TIMEOUT)

        metadata = self.client.metadata
        future = self._update.future(requests(), timeout=CALL_TIMEOUT, metadata=metadata)
        # A server that answers early (a bad chunk) ends the call before the chunks are sent.
        future.add_done_callback(lambda _: sent.set())
        sent.wait(CALL_TIMEOUT)
        future.cancel()
        release.set()
        if future.cancelled():
            self.outcomes["UpdateWeights:CANCELLED"] += 1
            self._check_unchanged("a cancelled UpdateWeights")
            return
        self._update_outcome("UpdateWeights", future.result)

    def _shared_update(self, case: SharedCase) -> None:
        request = self._shared["file"].request(
            _resolve(case.version, self.version, 0), case.allow_rollback
        )
        request.path = self._shared_path(case.path)
        mutate_shared(request, case.ops, self.version)
        self._update_outcome(
            "UpdateWeightsShared",
            lambda: self.client.stub.UpdateWeightsShared(
                request, timeout=CALL_TIMEOUT, metadata=self.client.metadata
            ),
        )

    def _raw_call(self, case: RawCase) -> None:
        call = self._raw[case.method]

        def send():
            return call(case.data, timeout=CALL_TIMEOUT, metadata=self.client.metadata)

        message_type = {
            "Generate": generator_pb2.GenerateRequest,
            "UpdateWeightsShared": generator_pb2.SharedWeights,
            "GetStatus": generator_pb2.GetStatusRequest,
        }[case.method]
        try:
            parsed = message_type.FromString(case.data)
        except Exception:  # noqa: BLE001 - undecodable: a clear refusal is the only answer
            self._expect_refusal(case.method, send, grpc.StatusCode.INVALID_ARGUMENT)
            return
        if case.method == "Generate":
            self._generate(parsed, send)
        elif case.method == "UpdateWeightsShared":
            self._update_outcome(case.method, send)
        else:
            send()
            self.outcomes["GetStatus:OK"] += 1

    # -- oracles

    def _update_outcome(self, method: str, call: Callable[[], Any]) -> None:
        try:
            response = call()
        except grpc.RpcError as error:
            self._expect_clear(method, error)
            self._check_unchanged(f"a refused {method}")
            return
        self.outcomes[f"{method}:OK"] += 1
        self._accepted(response)

    def _expect_refusal(self, method: str, call: Callable[[], Any], code) -> None:
        try:
            result = call()
            if method == "Generate":
                list(result)
        except grpc.RpcError as error:
            self._expect_clear(method, error)
            if error.code() != code:
                message = f"{method}: {error.code()} ({error.details()}), not {code}"
                raise FuzzFailure(message) from None
            return
        raise FuzzFailure(f"{method} accepted bytes protobuf cannot parse")

    def _expect_clear(self, method: str, error: grpc.RpcError) -> None:
        code, details = error.code(), error.details() or ""
        self.outcomes[f"{method}:{code.name}"] += 1
        if code not in ALLOWED[method] or not details or details.startswith("Unexpected"):
            raise FuzzFailure(f"{method} answered {code.name}: {details!r}")

    def _accepted(self, response) -> None:
        """An accepted update is served: a Generate runs on it; then the weights go back."""
        status = self.client.status(timeout=CALL_TIMEOUT)
        if (status.policy_version, status.num_updates) != (
            response.policy_version,
            self.num_updates + 1,
        ):
            raise FuzzFailure(f"update accepted as {response.policy_version}, status {status}")
        self.version, self.num_updates = response.policy_version, status.num_updates
        completions = list(
            self.client.generate([[5, 6, 7]], max_tokens=2, temperature=0.0, timeout=CALL_TIMEOUT)
        )
        if [c.policy_version for c in completions] != [response.policy_version]:
            raise FuzzFailure(f"after accepting {response.policy_version}: {completions}")
        self._restore()

    def _restore(self) -> None:
        """Puts the original weights back, at the next version (or at 1, rolled back, where the
        accepted update took the last one)."""
        version = self.version + 1 if self.version < 2**63 - 1 else 1
        self.client.update_weights_encoded(
            encode_weight_chunks(self.tensors, version, allow_rollback=True),
            timeout=CALL_TIMEOUT,
        )
        self.version, self.num_updates = version, self.num_updates + 1
        self._check_weights()

    def _generate(self, request, call: Callable[[], Any]) -> None:
        method = "Generate"
        prompts, sampling = request.prompts, request.sampling
        work = sampling.n * sum(p.max_tokens or sampling.max_tokens for p in prompts)
        try:
            responses = call()
            completions = []
            for completion in responses:
                completions.append(completion)
                if work > WORK_LIMIT:
                    responses.cancel()
                    self.outcomes[f"{method}:CANCELLED"] += 1
                    return
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and work > WORK_LIMIT:
                return
            self._expect_clear(method, error)
            return
        self.outcomes[f"{method}:OK"] += 1
        self._check_completions(request, completions)

    def _check_completions(self, request, completions) -> None:
        sampling = request.sampling
        expected = {(p, s) for p in range(len(request.prompts)) for s in range(sampling.n)}
        got = [(c.prompt_index, c.sample_index) for c in completions]
        if sorted(got) != sorted(expected):
            raise FuzzFailure(f"Generate returned samples {got}, expected {sorted(expected)}")
        for completion in completions:
            tokens = list(completion.token_ids)
            prompt = request.prompts[completion.prompt_index]
            problems = [
                completion.prompt_id != prompt.id,
                not 0 < len(tokens) <= (prompt.max_tokens or sampling.max_tokens),
                any(not 0 <= t < self.vocab_size for t in tokens),
                len(completion.logprobs) != len(tokens),
                set(completion.token_policy_versions) != {self.version},
                completion.finish_reason not in ("stop", "length"),
            ]
            if any(problems):
                raise FuzzFailure(f"bad completion {completion} for {request}")

    def _check_up(self) -> None:
        """The server answers, serves, and says so to health checks."""
        status = self.client.status(timeout=CALL_TIMEOUT)
        health = self._health.Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=CALL_TIMEOUT
        )
        if not status.serving or health.status != health_pb2.HealthCheckResponse.SERVING:
            raise FuzzFailure(f"the server stopped serving: {status}, health {health.status}")

    def _check_unchanged(self, what: str) -> None:
        status = self.client.status(timeout=CALL_TIMEOUT)
        if (status.policy_version, status.num_updates) != (self.version, self.num_updates):
            raise FuzzFailure(
                f"{what} changed the server: version {status.policy_version}, "
                f"{status.num_updates} updates; expected {self.version}, {self.num_updates}"
            )

    def _check_weights(self) -> None:
        tokens = self.greedy()
        if tokens != self.baseline:
            raise FuzzFailure(f"greedy tokens {tokens}, before the run {self.baseline}")

    def greedy(self) -> list[list[int]]:
        """Greedy completions of GREEDY_PROMPTS (the served weights' fingerprint)."""
        completions = self.client.generate(
            GREEDY_PROMPTS, max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True,
            timeout=CALL_TIMEOUT,
        )  # fmt: skip
        return [list(c.token_ids) for c in sorted(completions, key=lambda c: c.prompt_index)]

    # -- shared files

    def _make_shared_files(self, directory: str) -> dict[str, Any]:
        """A shared file of the served weights, and the odd paths the cases point at."""
        specs = [(name, array.shape, array.dtype) for name, array in self.tensors.items()]
        shared = SharedWeightsFile(directory, specs)
        shared.write(self.tensors.items())
        outside = Path(self._folder.name) / "outside.bin"
        outside.write_bytes(Path(shared.path).read_bytes())
        symlink = Path(directory) / f"fuzz-wire-{os.getpid()}-link.bin"
        symlink.unlink(missing_ok=True)
        symlink.symlink_to(outside)
        truncated = Path(directory) / f"fuzz-wire-{os.getpid()}-truncated.bin"
        truncated.write_bytes(Path(shared.path).read_bytes()[: shared.size // 2])
        return {"file": shared, "outside": outside, "symlink": symlink, "truncated": truncated}

    def _shared_path(self, kind: str | tuple) -> str:
        if isinstance(kind, tuple):
            return kind[1]
        path = self._shared["file"].path
        folder, name = os.path.split(path)
        return {
            "file": path,
            "missing": os.path.join(folder, f"fuzz-wire-{os.getpid()}-missing.bin"),
            "outside": str(self._shared["outside"]),
            "symlink": str(self._shared["symlink"]),
            "folder": folder,
            "relative": name,
            "nul": path + "\x00.bin",
            "long": os.path.join(folder, "x" * 5000),
            "dotdot": os.path.join(folder, "..", os.path.basename(folder), name),
            "empty": "",
            "truncated": str(self._shared["truncated"]),
        }[kind]

    def close(self) -> None:
        """Checks the weights one last time and removes the files the cases used."""
        try:
            self._check_weights()
        finally:
            self._shared["file"].close()
            self._shared["symlink"].unlink(missing_ok=True)
            self._shared["truncated"].unlink(missing_ok=True)
            self._folder.cleanup()

    def summary(self) -> dict[str, Any]:
        return {
            "inputs": self.inputs,
            "by_kind": dict(self.kinds),
            "by_status": dict(sorted(self.outcomes.items())),
            "slowest_input": {"kind": self.slowest[0], "seconds": round(self.slowest[1], 2)},
        }


def fuzz_for(fuzzer: WireFuzzer, seconds: float, seed: int = 0, batch: int = 25) -> None:
    """Runs Hypothesis batches of `batch` inputs until `seconds` have passed; raises the first
    failure, shrunk, with the input in its notes. Each batch draws from its own seed, so the
    run is reproducible from `seed` (and not the same batch over again where Hypothesis
    derandomises, as on CI)."""
    strategy = fuzzer.cases()
    deadline = time.monotonic() + seconds
    index = 0
    while time.monotonic() < deadline:

        @settings(
            max_examples=batch,
            deadline=None,
            database=None,
            phases=(Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @hypothesis_seed(seed * 1_000_003 + index)
        @given(strategy)
        def fuzz(case) -> None:
            if time.monotonic() < deadline:  # past it, the batch's last inputs pass unsent
                fuzzer.check(case)

        fuzz()
        index += 1


def _start_own_server() -> tuple[Any, Path]:
    """A server on the suite's tiny Llama (built into .cache/ on first use), as the tests run it."""
    from jaxrlhf.fleet.service import start_server
    from jaxrlhf.models.tiny import make_tiny_model

    repo = Path(__file__).resolve().parent.parent
    model = make_tiny_model(repo / ".cache" / "test-models" / "llama")
    log = Path(tempfile.mkdtemp(prefix="fuzz-wire-server-")) / "server.log"
    args = ["--dtype", "float32", "--max-model-len", "256", "--seed", "0", "--senders-timeout", "3"]
    server = start_server(model, log, args, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    return server, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--address", help="a running server (default: start one)")
    parser.add_argument("--model", help="the folder whose weights the server at --address serves")
    args = parser.parse_args(argv)
    if bool(args.address) != bool(args.model):
        parser.error("--address and --model go together")
    from safetensors.numpy import load_file

    server = None
    if args.address:
        address, model = args.address, Path(args.model)
    else:
        server, model = _start_own_server()
        address = server.address
    tensors = load_file(model / "model.safetensors")
    started = time.monotonic()
    failure = None
    try:
        with GeneratorClient(address) as client:
            client.wait_until_serving(timeout=120)
            fuzzer = WireFuzzer(client, tensors)
            try:
                fuzz_for(fuzzer, args.seconds, args.seed)
            except Exception as error:  # noqa: BLE001 - reported below, with the shrunk input
                failure = {
                    "error": f"{type(error).__name__}: {error}",
                    "input": list(getattr(error, "__notes__", [])),
                }
            finally:
                fuzzer.close()
    finally:
        if server is not None:
            server.terminate()
    row = {**fuzzer.summary(), "seconds": round(time.monotonic() - started, 1), "seed": args.seed,
           "failure": failure}  # fmt: skip
    print(json.dumps(row), flush=True)
    return 1 if failure else 0


if __name__ == "__main__":
    sys.exit(main())
