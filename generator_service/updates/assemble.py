"""A streamed weight update's chunks, checked as they come and placed in the update file.

Every chunk's bytes are written straight to their final place in one file (the tensor's region
+ the chunk's offset) as they arrive, so the update is never assembled in memory. Regions are
handed out as tensors start, page-aligned, in the learner's order: a tensor's size is known only
from the dtype of its first chunk (each tensor may come in any wire dtype). A tensor may come
whole or as slices (boxes of it, from several senders: join.py); a slice's rows go to their
places in the tensor's region. A tensor is complete when every byte of it has come exactly
once: overlapping or repeated bytes, and data past a tensor's end, are refused. Nothing here
touches the engine or the file (the caller writes the bytes: bytes_file.py). Pure Python (no
torch).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

from generator_service.updates.tensors import (
    PreloadTensor,
    TensorSpec,
    WeightUpdateError,
    check_tensor,
    check_update_header,
)
from jaxrlhf_wire.dtypes import WIRE_DTYPES, tensor_nbytes
from jaxrlhf_wire.files import aligned


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
    """One tensor being received: its region of the update file and the slices started so far
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

    def preloaded(self) -> PreloadTensor:
        return PreloadTensor(self.spec.name, self.wire_dtype, self.spec.shape, self.position,
                            self.nbytes)  # fmt: skip


class WeightAssembler:
    """Checks the chunks of one UpdateWeights stream as they come and places them in the file.

    Every update must carry the complete set of the served model's tensors: vLLM's in-place reload
    materialises each layer afresh, so a layer given only some of its tensors would keep garbage
    in the rest. `add` returns where in the update file a chunk's bytes go; the caller writes
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
        self.file_bytes = 0  # the end of the last region handed out: the file's size
        self._tensors: dict[str, _PartialTensor] = {}
        self._completed: list[PreloadTensor] = []  # since the last `take_completed`

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
        """Checks one chunk; returns (byte position in the update file, bytes) for each part
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
            self._completed.append(partial.preloaded())
        return pieces

    def take_completed(self) -> list[PreloadTensor]:
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
        position = aligned(self.file_bytes)
        self.file_bytes = position + nbytes
        partial = _PartialTensor(spec, dtype, position, nbytes)
        self._tensors[name] = partial
        return partial

    def finish(self) -> list[PreloadTensor]:
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
        return [p.preloaded() for p in self._tensors.values()]


def _invalid(message: str) -> WeightUpdateError:
    return WeightUpdateError(grpc.StatusCode.INVALID_ARGUMENT, message)
