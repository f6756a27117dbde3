"""The learner's client of the generator service (`client`) and its same-host weight files
(`weights_file`).

The wire contract itself (the gRPC stubs, built at install time, the chunk encoder, dtypes,
alignment, the loopback rule) lives in `jaxrlhf_wire`, which the service imports too; the names
below that come from it are re-exported for the learner's existing imports. This package must
stay light: the learner imports it, so no vLLM, no JAX, no torch.
"""

from __future__ import annotations

from jaxrlhf.fleet.rpc.client import GeneratorClient, auth_metadata

# These live in jaxrlhf_wire (the contract both sides import); re-exported here.
from jaxrlhf_wire.chunks import encode_weight_chunks
from jaxrlhf_wire.stubs import PROTO_PATH, SERVICE_NAME, generator_pb2, generator_pb2_grpc

__all__ = [
    "PROTO_PATH",
    "SERVICE_NAME",
    "GeneratorClient",
    "auth_metadata",
    "encode_weight_chunks",
    "generator_pb2",
    "generator_pb2_grpc",
]
