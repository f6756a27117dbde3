"""What a failed call to a generator replica means: a replica gone or hung (`REPLICA_DOWN`: it
is failed and brought back), or a refusal the learner cannot get past (`GeneratorError`)."""

from __future__ import annotations

import grpc

# Ways a call ends that mean the replica is gone or hung (not that the request was wrong).
REPLICA_DOWN = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED,
})  # fmt: skip


class GeneratorError(RuntimeError):
    """No replica could do the work, or one refused it as malformed; the message names each
    replica and its gRPC status."""


def describe(target: str, error: grpc.RpcError) -> str:
    return f"generator {target}: {error.code().name}: {error.details()}"
