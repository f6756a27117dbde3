"""What a weight update must be, and the checks of one against the served model.

Nothing here touches the engine: an update is fully received and checked first, so that any
malformed one is refused while the old weights keep serving. The expected tensors (names,
shapes, dtypes) are read from the served model folder's safetensors headers, which hold the
Hugging Face names the learner exports; a tied `lm_head` is absent there and so refused.

- Every update carries the complete set of the served model's tensors, each exactly once, with
  its served shape, in a float wire dtype; its version is newer than the served one (unless it
  rolls back) and one a Completion can carry (`check_update_header`, `check_tensor`).
- A streamed update is checked chunk by chunk as it is placed in the update file
  (assemble.py, bytes_file.py); a complete tensor there is a `PreloadTensor`.
- A shared update (UpdateWeightsShared) names a file directly inside the server's shared
  folder (links resolved first, so a link cannot point the engine elsewhere), whose tensors lie
  `UPDATE_FILE_ALIGNMENT`-aligned, inside the file and apart (`check_shared_layout`); a
  progressive one keeps the file's first `PROGRESS_BYTES` for the count of tensors written.

Pure Python (no torch).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from jaxrlhf_wire.dtypes import SAFETENSORS_TO_WIRE, WIRE_DTYPES, tensor_nbytes
from jaxrlhf_wire.files import ALIGNMENT, PROGRESS_BYTES

# Every tensor's region starts on a page boundary: aligned views when the engine maps the file.
UPDATE_FILE_ALIGNMENT = ALIGNMENT  # the learner's shared files use the same
# Completion.token_policy_versions are int64: no version above this could be reported.
MAX_POLICY_VERSION = 2**63 - 1
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


@dataclass(frozen=True)
class PreloadTensor:
    """A complete tensor in the update file: `nbytes` bytes at byte `position`."""

    name: str
    wire_dtype: str
    shape: tuple[int, ...]
    position: int
    nbytes: int


def check_update_header(
    specs: dict[str, TensorSpec],
    current_version: int,
    policy_version: int,
    num_tensors: int,
    allow_rollback: bool,
) -> None:
    """A newer version (unless rolling back) that completions can carry, and every one of the
    served model's tensors."""
    if policy_version > MAX_POLICY_VERSION:
        raise _invalid(
            f"policy_version {policy_version} is over 2**63 - 1, the largest version a "
            "Completion can carry (token_policy_versions are int64)"
        )
    if policy_version <= current_version and not allow_rollback:
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"policy_version {policy_version} is not newer than the served version "
            f"{current_version}",
        )
    if num_tensors != len(specs):
        raise _invalid(
            f"num_tensors is {num_tensors} but the served model has {len(specs)} "
            "tensors; a weight update must carry all of them"
        )


def check_tensor(
    specs: dict[str, TensorSpec], where: str, name: str, dtype: str, shape: tuple[int, ...]
) -> TensorSpec:
    """The served spec of tensor `name`, if `dtype` and `shape` fit it; else INVALID_ARGUMENT."""
    spec = specs.get(name)
    if spec is None:
        hint = ""
        if name == "lm_head.weight":
            hint = " (the served model ties it to model.embed_tokens.weight; send only that)"
        raise _invalid(f"{where}: unknown tensor {name!r}, not in the served model{hint}")
    if dtype not in WIRE_DTYPES:
        raise _invalid(f"{where}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    if spec.dtype not in SAFETENSORS_TO_WIRE:
        raise _invalid(f"{where}: the served tensor has dtype {spec.dtype}, not a float")
    if shape != spec.shape:
        raise _invalid(f"tensor {name} has shape {list(shape)}, expected {list(spec.shape)}")
    return spec


def shared_file_path(path: str, directory: str) -> str:
    """`path` resolved, if it names a regular file directly inside `directory` (the folder the
    server maps shared updates from); FAILED_PRECONDITION otherwise. Symbolic links are
    resolved first, so a link cannot point the engine at a file elsewhere."""
    if "\x00" in path:
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"shared weight file {path!r} has a NUL byte in its path",
        )
    resolved = os.path.realpath(path)
    if os.path.dirname(resolved) != os.path.realpath(directory):
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"shared weight file {path} is not in the server's shared folder {directory}",
        )
    if not os.path.isfile(resolved):
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"shared weight file {path} does not exist or is not a regular file",
        )
    if not os.access(resolved, os.R_OK | os.W_OK):
        # The engine maps it shared and writable (see worker_extension.map_preloaded_tensors).
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the server cannot open shared weight file {path} for reading and writing",
        )
    return resolved


def shared_file_size(path: str) -> int:
    """The size of a shared weight file; FAILED_PRECONDITION if it went away meanwhile."""
    try:
        return os.path.getsize(path)
    except OSError as error:
        raise WeightUpdateError(
            grpc.StatusCode.FAILED_PRECONDITION, f"cannot read shared weight file {path}: {error}"
        ) from error


def check_shared_layout(
    specs: dict[str, TensorSpec],
    current_version: int,
    policy_version: int,
    entries: Iterable[tuple[str, str, tuple[int, ...], int]],
    file_size: int,
    allow_rollback: bool = False,
) -> list[PreloadTensor]:
    """Checks the (name, dtype, shape, byte position) of every tensor of a shared update against
    the served model and the file's size: each served tensor exactly once, each region
    `UPDATE_FILE_ALIGNMENT`-aligned, inside the file and apart from the others. Returns the tensors
    in the order given."""
    entries = list(entries)
    check_update_header(specs, current_version, policy_version, len(entries), allow_rollback)
    preloaded: list[PreloadTensor] = []
    seen: set[str] = set()
    for index, (name, dtype, shape, position) in enumerate(entries):
        where = f"tensor {index + 1} ({name or '<unnamed>'})"
        spec = check_tensor(specs, where, name, dtype, tuple(shape))
        if name in seen:
            raise _invalid(f"{where}: tensor {name} is listed twice: duplicated data")
        seen.add(name)
        nbytes = tensor_nbytes(dtype, spec.shape)
        if position % UPDATE_FILE_ALIGNMENT:
            raise _invalid(
                f"{where}: byte position {position} is not a multiple of {UPDATE_FILE_ALIGNMENT}"
            )
        if position + nbytes > file_size:
            raise WeightUpdateError(
                grpc.StatusCode.DATA_LOSS,
                f"{where}: bytes [{position}, {position + nbytes}) lie past the end of the "
                f"shared file ({file_size} bytes): truncated data",
            )
        preloaded.append(PreloadTensor(name, dtype, spec.shape, position, nbytes))
    ordered = sorted(preloaded, key=lambda tensor: tensor.position)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if before.position + before.nbytes > after.position:
            raise _invalid(
                f"tensors {before.name} and {after.name} overlap in the shared file: "
                "duplicated data"
            )
    return preloaded


def check_progress_page(tensors: list[PreloadTensor]) -> None:
    """A progressive shared update keeps the file's first `PROGRESS_BYTES` for its count."""
    for tensor in tensors:
        if tensor.position < PROGRESS_BYTES and tensor.nbytes:
            raise _invalid(
                f"tensor {tensor.name} lies at byte {tensor.position} of a progressive shared "
                f"update, whose first {PROGRESS_BYTES} bytes hold the count of tensors written"
            )


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)
