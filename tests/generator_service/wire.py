"""WeightChunk streams as message objects, for tests that read, alter or split them: what the
learner sends (`encode_weight_chunks`), parsed back by protobuf."""

from __future__ import annotations

from collections.abc import Iterator

from jaxrlhf_wire.chunks import encode_weight_chunks
from jaxrlhf_wire.stubs import generator_pb2


def chunk_messages(*args, **kwargs) -> Iterator:
    """`encode_weight_chunks(*args, **kwargs)`, each chunk a `WeightChunk` message (lazily)."""
    for raw in encode_weight_chunks(*args, **kwargs):
        yield generator_pb2.WeightChunk.FromString(raw)
