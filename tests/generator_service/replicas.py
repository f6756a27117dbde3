"""Stand-in generator replicas for fan-out tests, beside the suite's one real (vLLM) server.

A second vLLM engine would cost the suite another engine start and both cores, so:

- `RecordingReplica` runs the real service code (`add_generator_service`, `GeneratorServicer`:
  decoding, validation, staging) in this process, on an engine stand-in that records the staged
  tensors instead of loading them into vLLM.
- `DyingReplica` is a separate process that accepts an UpdateWeights stream and SIGKILLs itself
  after a few chunks: a replica that dies mid-stream, connection and all.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

REPO_ROOT = Path(__file__).resolve().parents[2]


class RecordingEngine:
    """What `GeneratorServicer.UpdateWeights` needs of an engine; swaps record the staged bytes."""

    def __init__(self, specs) -> None:
        self.weight_specs = specs
        self.weight_specs_error = ""
        self.policy_version = 0
        self.serving = True
        self.staging_dir = tempfile.gettempdir()
        self.swaps: list[tuple[int, dict[str, tuple[str, bytes]]]] = []

    async def swap_weights(self, staging_path, tensors, policy_version, allow_rollback=False):
        with open(staging_path, "rb") as file:
            data = file.read()
        received = {
            t.name: (t.wire_dtype, data[t.position : t.position + t.nbytes]) for t in tensors
        }
        self.swaps.append((policy_version, received))
        self.policy_version = policy_version
        return 0.0


class RecordingReplica:
    """The service's gRPC code on a `RecordingEngine`, served from a thread of this process."""

    def __init__(self, specs) -> None:
        from grpc_health.v1 import health

        from generator_service.server import GeneratorServicer, add_generator_service
        from jaxrlhf_wire.chunks import CHANNEL_OPTIONS

        self.engine = RecordingEngine(specs)
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def start():
            server = grpc.aio.server(options=list(CHANNEL_OPTIONS))
            servicer = GeneratorServicer(self.engine, health.aio.HealthServicer())
            add_generator_service(servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self._server, port = self._run(start())
        self.address = f"127.0.0.1:{port}"

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=60)

    def received(self, policy_version: int) -> dict[str, tuple[str, bytes]]:
        """{name: (wire dtype, bytes)} of the update swapped in as `policy_version`."""
        (received,) = [
            tensors for version, tensors in self.engine.swaps if version == policy_version
        ]
        return received

    def stop(self) -> None:
        self._run(self._server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)


class DyingReplica:
    """A process that takes UpdateWeights streams and kills itself (SIGKILL) at chunk `after`."""

    def __init__(self, after: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.generator_service.replicas", "--die-after", str(after)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        port = self.process.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"the dying replica did not start ({self.process.wait()})")
        self.address = f"127.0.0.1:{port}"

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait(timeout=30)


def _serve_until_chunk(after: int) -> None:
    from jaxrlhf_wire.chunks import CHANNEL_OPTIONS
    from jaxrlhf_wire.stubs import SERVICE_NAME

    def update_weights(request_iterator, context):
        for count, _ in enumerate(request_iterator, start=1):
            if count == after:
                os.kill(os.getpid(), signal.SIGKILL)
        context.abort(grpc.StatusCode.INTERNAL, "the stream ended before this replica died")

    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME, {"UpdateWeights": grpc.stream_unary_rpc_method_handler(update_weights)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=2), options=list(CHANNEL_OPTIONS))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--die-after", type=int, required=True)
    _serve_until_chunk(parser.parse_args().die_after)
