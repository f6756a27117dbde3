"""Same-host weight sync: the learner writes the update into a file that the server maps.

A learner and a generator on one host need not push the weights through a socket at all.
`SharedWeightsFile` lays the Hugging Face tensors (or a LoRA adapter's, by PEFT's names) out in
one file in the server's shared folder (`GeneratorStatus.shared_weights_dir`, normally
/dev/shm, i.e. memory), page-aligned and in a fixed order, and `write` puts each converted
tensor straight into its region (the conversion's one copy is the only one);
`UpdateWeightsShared` then sends only where each tensor lies, and the engine loads views of the
file. The file is created once and rewritten in place by every update
(its pages stay allocated), and deleted by `close`; files of dead learners (whose lock no
process holds, whatever its PID namespace: `jaxrlhf_wire.files`) are removed when a new one is
created. Memory: the file is one copy of the model in /dev/shm, and it takes the
place of the service's update file (which a streamed update fills), so the host holds the same
as with streaming, not more.

The file must not change while a replica loads it: `GeneratorPool.publish_weights` writes the
next update only after every replica answered the last one.

Written as it is preloaded (`SharedWeights.progressive`, for servers whose status says
`shared_progress`): the request goes out first (`begin_progress`, then `request(...,
progressive=True)`), and `write(..., progress=True)` counts the tensors written so far in the
file's first bytes (`PROGRESS_BYTES`; no tensor lies in the first page, and the count is stored
under the file's lock: `jaxrlhf_wire.files.write_progress_count`), so that each server preloads
the layers already written while the learner writes the next. A write that fails marks the file
abandoned (`PROGRESS_ABANDONED`) and the servers refuse the update.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

# ALIGNMENT and remove_stale_files live in jaxrlhf_wire (the service's update file uses them too).
from jaxrlhf_wire.dtypes import WEIGHT_DTYPES, wire_dtype_name
from jaxrlhf_wire.files import (  # noqa: F401
    ALIGNMENT,
    PROGRESS_ABANDONED,
    PROGRESS_BYTES,
    aligned,
    create_owned_file,
    release_owned_file,
    remove_stale_files,
    write_progress_count,
)
from jaxrlhf_wire.stubs import generator_pb2

PREFIX = "jaxrlhf-shared-"


class SharedWeightsFile:
    """One update's worth of tensors, `specs` = [(HF name, shape, numpy dtype)] in the order the
    tensors will be written, laid out in a memory-mapped file in `directory`."""

    def __init__(self, directory: str, specs: Sequence[tuple[str, tuple[int, ...], Any]]):
        self._lay_out(specs)
        self._owner = True  # created here: deleted by close
        size = self.size
        remove_stale_files(directory, PREFIX)
        # Owned by a lock while this process lives (jaxrlhf_wire.files), not by its PID.
        fd, self.path, self._lock_fd = create_owned_file(directory, PREFIX)
        try:
            os.ftruncate(fd, max(size, 1))
            self._map: mmap.mmap | None = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.close(fd)
            release_owned_file(self.path, self._lock_fd)
            raise
        os.close(fd)

    def begin_progress(self) -> None:
        """Counts no tensor written yet (before a progressive request is sent: a count left by
        the last version would say its tensors are this one's)."""
        self._count(0)

    def _count(self, count: int, fd: int | None = None) -> None:
        # Under the file's lock, never torn and seen after the tensors it counts
        # (jaxrlhf_wire.files, where the server's read is too).
        own = fd is None
        fd = os.open(self.path, os.O_WRONLY) if own else fd
        try:
            write_progress_count(fd, count)
        finally:
            if own:
                os.close(fd)

    def write(self, tensors: Iterable[tuple[str, Any]], progress: bool = False) -> int:
        """Copies each (name, array) into its region, casting to the laid-out dtype (the arrays
        may be strided views, e.g. transposed kernels: they are copied once, in place). The
        tensors must come in the order of `specs`. Returns the bytes written. `progress`:
        count each tensor written in the file (module docstring); a failure marks it
        abandoned."""
        if not progress:
            return self._write(tensors, None)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            return self._write(tensors, lambda done: self._count(done, fd))
        except BaseException:
            self._count(PROGRESS_ABANDONED, fd)
            raise
        finally:
            os.close(fd)

    def _write(self, tensors, count) -> int:
        if self._map is None:
            raise ValueError("the shared weight file is closed")
        expected = iter(zip(self.specs, self.positions, strict=True))
        written = done = 0
        for name, array in tensors:
            try:
                (want, shape, dtype), position = next(expected)
            except StopIteration:
                message = f"tensor {name} is one more than the {len(self.specs)} laid out"
                raise ValueError(message) from None
            array = np.asarray(array)
            if name != want or tuple(array.shape) != shape:
                raise ValueError(
                    f"expected tensor {want} {list(shape)} next, got {name} {list(array.shape)}"
                )
            region = np.ndarray(shape, dtype, self._map, position)
            np.copyto(region, array, casting="unsafe")
            written += region.nbytes
            done += 1
            if count is not None:
                count(done)
        missing = [spec[0] for spec, _ in expected]
        if missing:
            raise ValueError(f"{len(missing)} tensors were not written, e.g. {missing[0]}")
        return written

    @classmethod
    def attach(
        cls, path: str, specs: Sequence[tuple[str, tuple[int, ...], Any]]
    ) -> SharedWeightsFile:
        """The file another process of the learner created at `path` for `specs`, mapped here to
        write this process's slices into (`write_slices`); `close` leaves it in place."""
        self = cls.__new__(cls)
        self._lay_out(specs)
        self.path, self._owner, self._lock_fd = path, False, None
        with open(path, "r+b") as file:
            if os.fstat(file.fileno()).st_size != max(self.size, 1):
                raise ValueError(f"shared weight file {path} is not laid out for these tensors")
            self._map = mmap.mmap(file.fileno(), max(self.size, 1))
        return self

    def _lay_out(self, specs) -> None:
        """`specs`, each tensor's page-aligned position in the file, and the file's size."""
        self.specs = [(name, tuple(shape), np.dtype(dtype)) for name, shape, dtype in specs]
        self.positions: list[int] = []
        size = ALIGNMENT  # the first page: the count of a progressive write
        for name, shape, dtype in self.specs:
            if wire_dtype_name(dtype) is None:
                raise ValueError(f"tensor {name} has dtype {dtype}; one of {WEIGHT_DTYPES}")
            size = aligned(size)
            self.positions.append(size)
            size += math.prod(shape) * dtype.itemsize
        self.size = size

    def write_slices(self, tensors: Iterable[tuple[str, Any]]) -> int:
        """Copies each (name, `TensorSlice`) into its box of the tensor's region, casting to the
        laid-out dtype, in any order (a process of a multi-process learner writes the slices its
        devices hold, the others theirs). Returns the bytes written."""
        if self._map is None:
            raise ValueError("the shared weight file is closed")
        layout = {name: (shape, dtype, position) for (name, shape, dtype), position
                  in zip(self.specs, self.positions, strict=True)}  # fmt: skip
        written = 0
        for name, piece in tensors:
            if name not in layout:
                raise ValueError(f"tensor {name} is not laid out in the shared weight file")
            shape, dtype, position = layout[name]
            data = np.asarray(piece.data)
            if tuple(piece.shape) != shape:
                raise ValueError(f"a slice of {name} says shape {list(piece.shape)}, "
                                 f"laid out {list(shape)}")  # fmt: skip
            index = tuple(slice(s, s + n) for s, n in zip(piece.start, data.shape, strict=True))
            region = np.ndarray(shape, dtype, self._map, position)
            np.copyto(region[index], data, casting="unsafe")
            written += data.size * dtype.itemsize
        return written

    def request(self, policy_version: int, allow_rollback: bool = False,
                progressive: bool = False, update_id: str = "", lora=None):  # fmt: skip
        """The UpdateWeightsShared request that points a server at this file (`progressive`:
        sent before the file is written, see the module docstring; `update_id`:
        SharedWeights.update_id; `lora`, a `generator_pb2.LoraAdapter`: the file holds that
        adapter's tensors, for a "lora" server)."""
        return generator_pb2.SharedWeights(
            policy_version=policy_version,
            path=self.path,
            allow_rollback=allow_rollback,
            progressive=progressive,
            update_id=update_id,
            lora=lora,
            tensors=[
                generator_pb2.SharedTensor(
                    name=name, dtype=str(dtype), shape=shape, position=position
                )
                for (name, shape, dtype), position in zip(self.specs, self.positions, strict=True)
            ],
        )

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view still holds it; the mapping goes with the last view
            self._map = None
        if self._owner:
            release_owned_file(self.path, self._lock_fd)  # the file, then its lock
            self._lock_fd = None

    def __enter__(self) -> SharedWeightsFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
