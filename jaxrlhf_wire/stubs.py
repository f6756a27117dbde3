"""The generated gRPC stubs of protos/generator.proto, checked against it at import.

They are built at install time (see `jaxrlhf_wire.build`); when they are missing or were built
from another version of the .proto, importing this module raises ImportError naming the
command that builds them. Nothing is generated here.
"""

from __future__ import annotations

from jaxrlhf_wire.build import PROTO_PATH, check_stubs

check_stubs()

from jaxrlhf_wire._generated import generator_pb2, generator_pb2_grpc  # noqa: E402

SERVICE_NAME = generator_pb2.DESCRIPTOR.services_by_name["Generator"].full_name

__all__ = ["PROTO_PATH", "SERVICE_NAME", "generator_pb2", "generator_pb2_grpc"]
