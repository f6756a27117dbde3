"""How a version of the weights gets from the learner to the generator replicas.

`base.WeightTransport` is the interface (one attempt of one version to a set of replicas, each
replica's response or error); `stream.StreamTransport` sends gRPC chunks to any host,
`shared_file.SharedFileTransport` writes one file in the replicas' shared memory folder and sends
only where each tensor lies (same host). The pool (`jaxrlhf.fleet.pool`) picks one, retries and
decides what a failure means.
"""

from jaxrlhf.fleet.transport.base import TRANSPORTS, PublishStats, WeightTransport, WeightUpdate
from jaxrlhf.fleet.transport.shared_file import SharedFileTransport
from jaxrlhf.fleet.transport.stream import StreamTransport

__all__ = [
    "TRANSPORTS",
    "PublishStats",
    "SharedFileTransport",
    "StreamTransport",
    "WeightTransport",
    "WeightUpdate",
]
