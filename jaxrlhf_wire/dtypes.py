"""The dtypes a weight tensor may travel in (WeightChunk.dtype, SharedTensor.dtype).

A wire name is numpy's name of the dtype (`str(array.dtype)`, bfloat16 being ml_dtypes'), so
the learner names its arrays' dtypes as they are. The server reads the served checkpoint's
safetensors codes; its engine views the received bytes through a numpy dtype of the same width
(numpy itself has no bfloat16) and reinterprets them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WireDtype:
    name: str  # on the wire, = str(numpy dtype)
    itemsize: int  # bytes per element
    safetensors: str  # the safetensors code of the same type
    view: type  # a numpy type of the same width, to view the bytes with


WIRE_DTYPES: dict[str, WireDtype] = {
    dtype.name: dtype
    for dtype in (
        WireDtype("float32", 4, "F32", np.float32),
        WireDtype("bfloat16", 2, "BF16", np.int16),
        WireDtype("float16", 2, "F16", np.float16),
    )
}
WEIGHT_DTYPES = tuple(WIRE_DTYPES)  # the names, in the table's order
SAFETENSORS_TO_WIRE = {dtype.safetensors: dtype.name for dtype in WIRE_DTYPES.values()}


def wire_dtype_name(dtype) -> str | None:
    """The wire name of a numpy dtype (or dtype-like), None if weights cannot travel in it."""
    name = str(np.dtype(dtype))
    return name if name in WIRE_DTYPES else None


def tensor_nbytes(dtype_name: str, shape: Iterable[int]) -> int:
    """The bytes of a tensor of `shape` in wire dtype `dtype_name`."""
    return math.prod(shape) * WIRE_DTYPES[dtype_name].itemsize
