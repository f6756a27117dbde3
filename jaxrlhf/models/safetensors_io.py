"""Minimal streaming reader/writer for the safetensors format (bfloat16 included, via ml_dtypes).

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the raw bytes. Reading memory-maps the file (no copy until a tensor is
used); writing streams tensor by tensor, so exporting never holds a second copy of the model.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Names used by transformers' `torch_dtype` / our APIs -> numpy dtypes.
NAMED_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float64": np.dtype(np.float64),  # for numerical checks; JAX needs jax_enable_x64
}


def numpy_dtype(name: str) -> np.dtype:
    """numpy dtype for "float32" / "bfloat16" / "float16"."""
    if name not in NAMED_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(NAMED_DTYPES)}, got {name!r}")
    return NAMED_DTYPES[name]


def read_header(path: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """(header dict without __metadata__, byte offset where the data starts)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsFile:
    """A memory-mapped safetensors file: `names()`, `spec(name)`, `get(name)`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header, self._data_start = read_header(self.path)
        self._file = open(self.path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)

    def names(self) -> list[str]:
        return list(self.header)

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        entry = self.header[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name} has unsupported dtype {entry['dtype']}")
        return tuple(entry["shape"]), DTYPES[entry["dtype"]]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only array backed by the memory map."""
        shape, dtype = self.spec(name)
        start, end = self.header[name]["data_offsets"]
        if end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"{self.path}: tensor {name} has {end - start} bytes for {shape}")
        offset = self._data_start + start
        return np.frombuffer(self._map, dtype=dtype, count=math.prod(shape), offset=offset).reshape(
            shape
        )

    def close(self) -> None:
        self._map.close()
        self._file.close()


def write_file(
    path: str | os.PathLike,
    specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    tensors: Iterator[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Writes tensors in the order of `specs` as they come from `tensors`; returns bytes written.

    The header is computed from `specs` first, so each tensor can be produced, written and freed
    one at a time. A tensor that does not match its spec raises ValueError.
    """
    specs = list(specs)
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype in specs:
            got_name, array = next(tensors)
            array = np.ascontiguousarray(array)
            if got_name != name or array.shape != tuple(shape) or array.dtype != np.dtype(dtype):
                raise ValueError(
                    f"expected tensor {name} {tuple(shape)} {np.dtype(dtype)}, got {got_name} "
                    f"{array.shape} {array.dtype}"
                )
            f.write(array.reshape(-1).view(np.uint8).data)
    return offset
