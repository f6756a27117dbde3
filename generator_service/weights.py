"""Assembling and validating a streamed weight update, and staging it as a safetensors file.

Nothing here touches the engine: a stream is fully received and checked first, so that any
malformed stream is refused while the old weights keep serving. The expected tensors (names,
shapes, dtypes) are read from the served model folder's safetensors headers, which hold the
Hugging Face names the learner exports; a tied `lm_head` is absent there and so refused.
Pure Python (no torch): the staged file is written from the received bytes directly.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# Wire dtype name -> (safetensors dtype code, item size in bytes).
WIRE_DTYPES: dict[str, tuple[str, int]] = {
    "float32": ("F32", 4),
    "bfloat16": ("BF16", 2),
    "float16": ("F16", 2),
}
_SAFETENSORS_TO_WIRE = {code: name for name, (code, _) in WIRE_DTYPES.items()}
# Buffers some checkpoints carry that are recomputed by the engine, never trained.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightUpdateError(Exception):
    """A refused update: `code` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class TensorSpec:
    """What the served model expects for one checkpoint tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors code of the served checkpoint, e.g. "F32"


def read_safetensors_header(path: str | os.PathLike) -> dict:
    with open(path, "rb") as file:
        (header_len,) = struct.unpack("<Q", file.read(8))
        return json.loads(file.read(header_len))


def expected_tensors(model_dir: str | os.PathLike) -> dict[str, TensorSpec]:
    """The tensors of a Hugging Face folder, from its safetensors headers (single or sharded).

    Raises FileNotFoundError when the folder holds no safetensors weights.
    """
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / name for name in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    specs: dict[str, TensorSpec] = {}
    for path in paths:
        for name, info in read_safetensors_header(path).items():
            if name == "__metadata__" or name.endswith(_IGNORED_SUFFIXES):
                continue
            specs[name] = TensorSpec(name, tuple(info["shape"]), info["dtype"])
    return specs


@dataclass
class _PartialTensor:
    """One tensor being received: its buffer and the byte ranges filled so far (sorted)."""

    spec: TensorSpec
    wire_dtype: str
    buffer: bytearray
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    received: int = 0

    @property
    def complete(self) -> bool:
        return self.received == len(self.buffer)

    def add(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        name = self.spec.name
        if end > len(self.buffer):
            raise WeightUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {name}: chunk at byte offset {offset} with {len(data)} bytes ends at "
                f"{end}, past the tensor's {len(self.buffer)} bytes ({self.wire_dtype} "
                f"{list(self.spec.shape)}): over-long data",
            )
        position = bisect.bisect_right(self.starts, offset)
        overlaps_before = position > 0 and self.ends[position - 1] > offset
        overlaps_after = position < len(self.starts) and self.starts[position] < end
        if overlaps_before or overlaps_after or (not data and offset in self.starts):
            raise WeightUpdateError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tensor {name}: bytes [{offset}, {end}) were already received: duplicated data",
            )
        self.buffer[offset:end] = data
        self.starts.insert(position, offset)
        self.ends.insert(position, end)
        self.received += len(data)

    def missing_description(self) -> str:
        return f"{self.spec.name} (received {self.received} of {len(self.buffer)} bytes)"


@dataclass(frozen=True)
class AssembledTensor:
    name: str
    wire_dtype: str
    shape: tuple[int, ...]
    data: bytearray


class WeightAssembler:
    """Consumes the chunks of one UpdateWeights stream and checks them as they come.

    Every update must carry the complete set of the served model's tensors: vLLM's in-place reload
    materialises each layer afresh, so a layer given only some of its tensors would keep garbage
    in the rest. Memory is bounded by one copy of the model in the dtypes sent.
    """

    def __init__(self, specs: dict[str, TensorSpec], current_version: int) -> None:
        self.specs = specs
        self.current_version = current_version
        self.policy_version: int | None = None
        self.num_tensors: int | None = None
        self.allow_rollback = False
        self.num_chunks = 0
        self.num_bytes = 0
        self._tensors: dict[str, _PartialTensor] = {}

    def add(
        self,
        policy_version: int,
        num_tensors: int,
        name: str,
        dtype: str,
        shape: Iterable[int],
        offset: int,
        data: bytes,
        allow_rollback: bool = False,
    ) -> None:
        """Checks one chunk and copies its bytes; raises WeightUpdateError on the first problem."""
        self.num_chunks += 1
        where = f"chunk {self.num_chunks} (tensor {name or '<unnamed>'})"
        if self.policy_version is None:
            self._check_header(policy_version, num_tensors, allow_rollback)
        elif (policy_version, num_tensors, allow_rollback) != (
            self.policy_version,
            self.num_tensors,
            self.allow_rollback,
        ):
            raise _invalid(
                f"{where} has policy_version {policy_version}, num_tensors {num_tensors}, "
                f"allow_rollback {allow_rollback}; the stream started with "
                f"{self.policy_version}, {self.num_tensors}, {self.allow_rollback}: "
                "every chunk of one update must carry the same values"
            )
        partial = self._tensors.get(name)
        if partial is None:
            partial = self._start_tensor(where, name, dtype, tuple(shape))
        elif dtype != partial.wire_dtype or tuple(shape) != partial.spec.shape:
            raise _invalid(
                f"{where} has dtype {dtype} and shape {list(shape)}; earlier chunks of this "
                f"tensor had {partial.wire_dtype} and {list(partial.spec.shape)}"
            )
        if not data and len(partial.buffer) > 0:
            raise _invalid(f"{where} at offset {offset} carries no data")
        partial.add(offset, data)
        self.num_bytes += len(data)

    def _check_header(self, policy_version: int, num_tensors: int, allow_rollback: bool) -> None:
        if policy_version <= self.current_version and not allow_rollback:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"policy_version {policy_version} is not newer than the served version "
                f"{self.current_version}",
            )
        if num_tensors != len(self.specs):
            raise _invalid(
                f"num_tensors is {num_tensors} but the served model has {len(self.specs)} "
                "tensors; a weight update must carry all of them"
            )
        self.policy_version = policy_version
        self.num_tensors = num_tensors
        self.allow_rollback = allow_rollback

    def _start_tensor(
        self, where: str, name: str, dtype: str, shape: tuple[int, ...]
    ) -> _PartialTensor:
        spec = self.specs.get(name)
        if spec is None:
            hint = ""
            if name == "lm_head.weight":
                hint = " (the served model ties it to model.embed_tokens.weight; send only that)"
            raise _invalid(f"{where}: unknown tensor {name!r}, not in the served model{hint}")
        if dtype not in WIRE_DTYPES:
            raise _invalid(f"{where}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        if spec.dtype not in _SAFETENSORS_TO_WIRE:
            raise _invalid(f"{where}: the served tensor has dtype {spec.dtype}, not a float")
        if shape != spec.shape:
            raise _invalid(f"tensor {name} has shape {list(shape)}, expected {list(spec.shape)}")
        if len(self._tensors) >= len(self.specs):
            raise _invalid(f"{where}: more than num_tensors={self.num_tensors} tensors")
        nbytes = math.prod(shape) * WIRE_DTYPES[dtype][1]
        partial = _PartialTensor(spec, dtype, bytearray(nbytes))
        self._tensors[name] = partial
        return partial

    def finish(self) -> list[AssembledTensor]:
        """Called at the end of the stream: every tensor present and complete, or DATA_LOSS."""
        if self.policy_version is None:
            raise _invalid("the weight stream was empty")
        incomplete = [p.missing_description() for p in self._tensors.values() if not p.complete]
        missing = sorted(set(self.specs) - set(self._tensors))
        if incomplete or missing:
            parts = []
            if incomplete:
                parts.append(f"{len(incomplete)} incomplete: {', '.join(incomplete[:5])}")
            if missing:
                parts.append(f"{len(missing)} never started: {', '.join(missing[:5])}")
            raise WeightUpdateError(
                grpc.StatusCode.DATA_LOSS,
                f"the stream for policy_version {self.policy_version} ended before all "
                f"{self.num_tensors} tensors were complete; " + "; ".join(parts),
            )
        return [
            AssembledTensor(p.spec.name, p.wire_dtype, p.spec.shape, p.buffer)
            for p in self._tensors.values()
        ]


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)


def write_safetensors(path: str | os.PathLike, tensors: list[AssembledTensor]) -> int:
    """Writes `tensors` as one safetensors file straight from their bytes; returns its size.

    Tensors are laid out by item size, largest first, so every one starts aligned to its dtype.
    """
    ordered = sorted(tensors, key=lambda t: (-WIRE_DTYPES[t.wire_dtype][1], t.name))
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in ordered:
        end = offset + len(tensor.data)
        header[tensor.name] = {
            "dtype": WIRE_DTYPES[tensor.wire_dtype][0],
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(header_bytes)))
        file.write(header_bytes)
        for tensor in ordered:
            file.write(tensor.data)
    return 8 + len(header_bytes) + offset
