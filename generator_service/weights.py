"""Validating a streamed weight update and staging it, byte for byte, where the engine loads it.

Nothing here touches the engine: a stream is fully received and checked first, so that any
malformed stream is refused while the old weights keep serving. The expected tensors (names,
shapes, dtypes) are read from the served model folder's safetensors headers, which hold the
Hugging Face names the learner exports; a tied `lm_head` is absent there and so refused.

Staging: every chunk's bytes are written straight to their final place in one file (the
tensor's region + the chunk's offset) as they arrive, so the update is never assembled in memory.
Regions are handed out as tensors start, page-aligned, in the learner's order: a tensor's size
is known only from the dtype of its first chunk (each tensor may come in any wire dtype). The
file is raw bytes, not safetensors: the engine gets each tensor's name, dtype, shape and position
with the reload call, maps the file and loads views of it (`worker_extension.py`). Pure Python
(no torch).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from jaxrlhf_wire.dtypes import SAFETENSORS_TO_WIRE, WIRE_DTYPES, tensor_nbytes
from jaxrlhf_wire.files import ALIGNMENT, PROGRESS_BYTES, aligned, remove_stale_files

logger = logging.getLogger(__name__)

# Every tensor's region starts on a page boundary: aligned views when the engine maps the file.
STAGING_ALIGNMENT = ALIGNMENT  # the learner's shared files use the same
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


class _ByteRanges:
    """The byte ranges of `nbytes` bytes received so far (sorted, disjoint)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.received = 0

    def add(self, offset: int, length: int, what: str, layout: str) -> None:
        """Records [offset, offset + length); INVALID_ARGUMENT past the end or over bytes
        already received. `what` names the tensor (or slice), `layout` its dtype and shape."""
        end = offset + length
        if end > self.nbytes:
            raise _invalid(
                f"{what}: chunk at byte offset {offset} with {length} bytes ends at {end}, "
                f"past the {self.nbytes} bytes ({layout}): over-long data"
            )
        position = bisect.bisect_right(self.starts, offset)
        overlaps_before = position > 0 and self.ends[position - 1] > offset
        overlaps_after = position < len(self.starts) and self.starts[position] < end
        if overlaps_before or overlaps_after or (not length and offset in self.starts):
            raise _invalid(
                f"{what}: bytes [{offset}, {end}) were already received: duplicated data"
            )
        self.starts.insert(position, offset)
        self.ends.insert(position, end)
        self.received += length


@dataclass
class _Slice:
    """A box of a tensor being received: `start` and `shape` per dimension, its bytes (its own
    row-major order) and where they go in the tensor's region. In the whole tensor's layout the
    box is contiguous runs of `run_bytes` bytes starting at `run_offsets`: its extent in the
    last dimension it does not span whole, times the (whole) dimensions after it."""

    start: tuple[int, ...]
    shape: tuple[int, ...]
    ranges: _ByteRanges
    run_bytes: int
    run_offsets: list[int]  # each run's byte offset in the tensor (one run: [its offset])

    @classmethod
    def of(cls, full: tuple[int, ...], start: tuple[int, ...], shape: tuple[int, ...],
           itemsize: int) -> _Slice:  # fmt: skip
        ndim = len(full)
        strides = [math.prod(full[j + 1 :]) * itemsize for j in range(ndim)]  # bytes
        # The last dimension the box does not span whole: a run is the box's extent there.
        last = max((j for j in range(ndim) if shape[j] != full[j]), default=-1)
        base = sum(s * stride for s, stride in zip(start, strides, strict=True))
        if last < 0:
            run_bytes = math.prod(full) * itemsize
        else:
            run_bytes = shape[last] * strides[last]
        offsets = [base]
        for j in range(last - 1, -1, -1):  # each outer index, in the box's row-major order
            if shape[j] > 1:
                offsets = [o + i * strides[j] for i in range(shape[j]) for o in offsets]
        return cls(start, shape, _ByteRanges(math.prod(shape) * itemsize), run_bytes, offsets)

    def pieces(self, offset: int, data: memoryview) -> list[tuple[int, memoryview]]:
        """(byte offset in the tensor, bytes) of `data`, the slice's bytes from `offset`."""
        if len(self.run_offsets) == 1:
            return [(self.run_offsets[0] + offset, data)]
        out = []
        done = 0
        while done < len(data):
            run, inner = divmod(offset + done, self.run_bytes)
            take = min(self.run_bytes - inner, len(data) - done)
            out.append((self.run_offsets[run] + inner, data[done : done + take]))
            done += take
        return out

    def overlaps(self, start: tuple[int, ...], shape: tuple[int, ...]) -> bool:
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.start, self.shape, start, shape, strict=True)
        )


@dataclass
class _PartialTensor:
    """One tensor being received: its region of the staging file and the slices started so far
    (the whole tensor is one slice)."""

    spec: TensorSpec
    wire_dtype: str
    position: int
    nbytes: int
    slices: dict[tuple[tuple[int, ...], tuple[int, ...]], _Slice] = field(default_factory=dict)

    @property
    def received(self) -> int:
        return sum(piece.ranges.received for piece in self.slices.values())

    @property
    def complete(self) -> bool:
        # The slices are disjoint boxes inside the tensor (checked as each starts): all bytes
        # of as many elements as the tensor has cover it exactly once.
        return self.received == self.nbytes

    def slice(self, start: tuple[int, ...], shape: tuple[int, ...]) -> _Slice:
        """The slice `start`/`shape` (both empty: the whole tensor), started on first sight."""
        full = self.spec.shape
        whole = not start and not shape  # (a zero-size tensor, too, is sent whole)
        if whole:
            start, shape = (0,) * len(full), full
        key = (start, shape)
        found = self.slices.get(key)
        if found is not None:
            return found
        name = self.spec.name
        if len(start) != len(full) or len(shape) != len(full):
            raise _invalid(
                f"tensor {name}: a slice needs slice_start and slice_shape with one entry per "
                f"dimension of {list(full)}, got {list(start)} and {list(shape)}"
            )
        outside = any(
            s < 0 or n <= 0 or s + n > f for s, n, f in zip(start, shape, full, strict=True)
        )
        if outside and not whole:
            raise _invalid(
                f"tensor {name}: slice at {list(start)} of shape {list(shape)} is empty or lies "
                f"outside the tensor's {list(full)}"
            )
        for other in self.slices.values():
            if other.overlaps(start, shape):
                raise _invalid(
                    f"tensor {name}: slice at {list(start)} of shape {list(shape)} overlaps the "
                    f"slice at {list(other.start)} of shape {list(other.shape)}: duplicated data"
                )
        created = _Slice.of(full, start, shape, WIRE_DTYPES[self.wire_dtype].itemsize)
        self.slices[key] = created
        return created

    def add(self, start: tuple[int, ...], shape: tuple[int, ...], offset: int,
            data: memoryview) -> list[tuple[int, memoryview]]:  # fmt: skip
        """Records a chunk of slice `start`/`shape`; (file position, bytes) to write."""
        piece = self.slice(start, shape)
        what, layout = f"tensor {self.spec.name}", f"{self.wire_dtype} {list(self.spec.shape)}"
        if piece.shape != self.spec.shape:
            what += f" slice at {list(piece.start)} of shape {list(piece.shape)}"
            layout = f"{self.wire_dtype} {list(piece.shape)}"
        piece.ranges.add(offset, len(data), what, layout)
        return [(self.position + at, part) for at, part in piece.pieces(offset, data)]

    def missing_description(self) -> str:
        return f"{self.spec.name} (received {self.received} of {self.nbytes} bytes)"

    def staged(self) -> StagedTensor:
        return StagedTensor(self.spec.name, self.wire_dtype, self.spec.shape, self.position,
                            self.nbytes)  # fmt: skip


@dataclass(frozen=True)
class StagedTensor:
    """A complete tensor in the staging file: `nbytes` bytes at byte `position`."""

    name: str
    wire_dtype: str
    shape: tuple[int, ...]
    position: int
    nbytes: int


class WeightAssembler:
    """Checks the chunks of one UpdateWeights stream as they come and places them in the file.

    Every update must carry the complete set of the served model's tensors: vLLM's in-place reload
    materialises each layer afresh, so a layer given only some of its tensors would keep garbage
    in the rest. `add` returns where in the staging file a chunk's bytes go; the caller writes
    them there. The chunks of several streams (senders) of one update may go through one
    assembler: each tensor may come as slices, from any of them. The file grows to one copy of
    the model in the dtypes sent.
    """

    def __init__(self, specs: dict[str, TensorSpec], current_version: int) -> None:
        self.specs = specs
        self.current_version = current_version
        self.policy_version: int | None = None
        self.num_tensors: int | None = None
        self.allow_rollback = False
        self.num_senders = 1
        self.update_id = ""
        self.num_chunks = 0
        self.num_bytes = 0
        self.staged_bytes = 0  # the end of the last region handed out: the file's size
        self._tensors: dict[str, _PartialTensor] = {}
        self._completed: list[StagedTensor] = []  # since the last `take_completed`

    def add(
        self,
        policy_version: int,
        num_tensors: int,
        name: str,
        dtype: str,
        shape: Iterable[int],
        offset: int,
        data: bytes | memoryview,
        allow_rollback: bool = False,
        slice_start: Iterable[int] = (),
        slice_shape: Iterable[int] = (),
        num_senders: int = 0,
        update_id: str = "",
    ) -> list[tuple[int, memoryview]]:
        """Checks one chunk; returns (byte position in the staging file, bytes) for each part
        of `data` (one, unless the chunk carries a slice whose rows lie apart in the tensor).

        Raises WeightUpdateError on the first problem.
        """
        self.num_chunks += 1
        where = f"chunk {self.num_chunks} (tensor {name or '<unnamed>'})"
        num_senders = max(1, num_senders)
        if self.policy_version is None:
            self._check_header(policy_version, num_tensors, allow_rollback)
            self.num_senders, self.update_id = num_senders, update_id
        elif (policy_version, num_tensors, allow_rollback, num_senders, update_id) != (
            self.policy_version,
            self.num_tensors,
            self.allow_rollback,
            self.num_senders,
            self.update_id,
        ):
            raise _invalid(
                f"{where} has policy_version {policy_version}, num_tensors {num_tensors}, "
                f"allow_rollback {allow_rollback}, num_senders {num_senders}, update_id "
                f"{update_id!r}; the update started with {self.policy_version}, "
                f"{self.num_tensors}, {self.allow_rollback}, {self.num_senders}, "
                f"{self.update_id!r}: every chunk of one update must carry the same values, "
                "from every sender"
            )
        partial = self._tensors.get(name)
        if partial is None:
            partial = self._start_tensor(where, name, dtype, tuple(shape))
        elif dtype != partial.wire_dtype or tuple(shape) != partial.spec.shape:
            raise _invalid(
                f"{where} has dtype {dtype} and shape {list(shape)}; earlier chunks of this "
                f"tensor had {partial.wire_dtype} and {list(partial.spec.shape)}"
            )
        if not len(data) and partial.nbytes > 0:
            raise _invalid(f"{where} at offset {offset} carries no data")
        pieces = partial.add(tuple(slice_start), tuple(slice_shape), offset, memoryview(data))
        self.num_bytes += len(data)
        if partial.complete:  # (a tensor's bytes are never counted twice: complete once)
            self._completed.append(partial.staged())
        return pieces

    def take_completed(self) -> list[StagedTensor]:
        """The tensors whose last bytes the chunks added since the last call brought."""
        completed, self._completed = self._completed, []
        return completed

    def _check_header(self, policy_version: int, num_tensors: int, allow_rollback: bool) -> None:
        check_update_header(
            self.specs, self.current_version, policy_version, num_tensors, allow_rollback
        )
        self.policy_version = policy_version
        self.num_tensors = num_tensors
        self.allow_rollback = allow_rollback

    def _start_tensor(
        self, where: str, name: str, dtype: str, shape: tuple[int, ...]
    ) -> _PartialTensor:
        spec = check_tensor(self.specs, where, name, dtype, shape)
        if len(self._tensors) >= len(self.specs):
            raise _invalid(f"{where}: more than num_tensors={self.num_tensors} tensors")
        nbytes = tensor_nbytes(dtype, shape)
        position = aligned(self.staged_bytes)
        self.staged_bytes = position + nbytes
        partial = _PartialTensor(spec, dtype, position, nbytes)
        self._tensors[name] = partial
        return partial

    def finish(self) -> list[StagedTensor]:
        """Called at the end of the stream: every tensor present and complete, or DATA_LOSS.

        Returns the tensors in the order they started (the learner's, layer by layer, which is
        the order in which the engine's layer-wise reload wants them)."""
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
        return [p.staged() for p in self._tensors.values()]


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
        # The engine maps it shared and writable (see worker_extension.map_staged_tensors).
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
) -> list[StagedTensor]:
    """Checks the (name, dtype, shape, byte position) of every tensor of a shared update against
    the served model and the file's size: each served tensor exactly once, each region
    `STAGING_ALIGNMENT`-aligned, inside the file and apart from the others. Returns the tensors
    in the order given."""
    entries = list(entries)
    check_update_header(specs, current_version, policy_version, len(entries), allow_rollback)
    staged: list[StagedTensor] = []
    seen: set[str] = set()
    for index, (name, dtype, shape, position) in enumerate(entries):
        where = f"tensor {index + 1} ({name or '<unnamed>'})"
        spec = check_tensor(specs, where, name, dtype, tuple(shape))
        if name in seen:
            raise _invalid(f"{where}: tensor {name} is listed twice: duplicated data")
        seen.add(name)
        nbytes = tensor_nbytes(dtype, spec.shape)
        if position % STAGING_ALIGNMENT:
            raise _invalid(
                f"{where}: byte position {position} is not a multiple of {STAGING_ALIGNMENT}"
            )
        if position + nbytes > file_size:
            raise WeightUpdateError(
                grpc.StatusCode.DATA_LOSS,
                f"{where}: bytes [{position}, {position + nbytes}) lie past the end of the "
                f"shared file ({file_size} bytes): truncated data",
            )
        staged.append(StagedTensor(name, dtype, spec.shape, position, nbytes))
    ordered = sorted(staged, key=lambda tensor: tensor.position)
    for before, after in zip(ordered, ordered[1:], strict=False):
        if before.position + before.nbytes > after.position:
            raise _invalid(
                f"tensors {before.name} and {after.name} overlap in the shared file: "
                "duplicated data"
            )
    return staged


def check_progress_page(tensors: list[StagedTensor]) -> None:
    """A progressive shared update keeps the file's first `PROGRESS_BYTES` for its count."""
    for tensor in tensors:
        if tensor.position < PROGRESS_BYTES and tensor.nbytes:
            raise _invalid(
                f"tensor {tensor.name} lies at byte {tensor.position} of a progressive shared "
                f"update, whose first {PROGRESS_BYTES} bytes hold the count of tensors written"
            )


def minimum_update_bytes(specs: dict[str, TensorSpec]) -> int:
    """The least staging space a complete update can take (every tensor in a 2-byte dtype)."""
    smallest = min(dtype.itemsize for dtype in WIRE_DTYPES.values())
    return sum(math.prod(spec.shape) * smallest for spec in specs.values())


class StagingFile:
    """The file updates are staged in, written chunk by chunk at the positions given by
    `WeightAssembler.add`, then loaded by the engine; one update at a time.

    One file serves every update of a server: its pages stay allocated, and writing over them
    costs about half as much as writing into fresh ones (measured on tmpfs), at the price of
    keeping one copy of the model in the staging folder between updates. Files left by servers
    that died are removed when a server creates its own.

    Writes run in a thread of their own (`os.pwrite` releases the GIL), so that the next chunk
    is received while the last one is written; at most `max_pending` chunks wait to be written.
    A full disk (`ENOSPC` from pwrite, never a SIGBUS as with a mapped file) is answered with
    RESOURCE_EXHAUSTED.
    """

    PREFIX = "jaxrlhf-weights-"

    def __init__(self, directory: str, max_pending: int = 4) -> None:
        self.directory = directory
        try:
            remove_stale_files(directory, self.PREFIX)
            fd, self.path = tempfile.mkstemp(
                prefix=f"{self.PREFIX}{os.getpid()}-", suffix=".bin", dir=directory
            )
        except OSError as error:
            raise WeightUpdateError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"cannot create a staging file in {directory}: {error.strerror}",
            ) from error
        self._fd: int | None = fd
        self._max_pending = max_pending
        self._pending: deque[asyncio.Future] = deque()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-staging")

    def check_space(self, min_bytes: int) -> None:
        """Refuses an update that cannot fit, before any of it is received."""
        free = shutil.disk_usage(self.directory).free + os.fstat(self._fd).st_size
        if free < min_bytes:
            raise WeightUpdateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"staging the update needs at least {min_bytes} bytes free in "
                f"{self.directory}, which has {free}",
            )

    async def write(self, pieces: list[tuple[int, memoryview]]) -> asyncio.Future:
        """Queues each (position, bytes) of one chunk to be written; waits while too many
        chunks' writes are queued. Returns the write's future (the writes run one at a time,
        in order: when one is done, so are all queued before it)."""
        loop = asyncio.get_running_loop()
        written = loop.run_in_executor(self._writer, self._write, pieces)
        self._pending.append(written)
        while len(self._pending) > self._max_pending:
            await self._next_done()
        return written

    async def flush(self, size: int) -> None:
        """Waits until every queued write is in the file, and sets its size to `size` (the end
        of the update's last region: what a larger earlier update left beyond it goes)."""
        while self._pending:
            await self._next_done()
        os.ftruncate(self._fd, size)

    async def settle(self) -> None:
        """Waits for the writes still queued, whatever their outcome (after a refused stream)."""
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()

    async def _next_done(self) -> None:
        try:
            await self._pending.popleft()
        except OSError as error:
            # The file is the server's own: its path goes to the log, the folder (the status's
            # shared_weights_dir) and the reason to the client.
            logger.error("writing the staging file %s failed: %s", self.path, error)
            raise WeightUpdateError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"could not stage the update in {self.directory}: {error.strerror}",
            ) from error

    def _write(self, pieces: list[tuple[int, memoryview]]) -> None:
        for position, data in pieces:
            view = memoryview(data).cast("B")
            while view:
                written = os.pwrite(self._fd, view, position)
                view, position = view[written:], position + written

    def close(self) -> None:
        """Deletes the file (call `settle` first if a stream may still be writing)."""
        self._writer.shutdown(wait=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)
