"""An update received and checked, put live through the engine's swap, and what the server
records of it. Both ways an update comes use it: a stream (receive_stream.py) and a shared
file (receive_shared.py).

- One update at a time (`lock`): they share the update file, and versions apply in order.
- `update_id` (GetStatus) names the update that put the served weights in place. The engine
  records it with the version, in the same step (status.py `Served`), so GetStatus never shows
  a new version under the previous update's id. That also holds when the call is cancelled
  after the swap's pause began (the swap then runs to its end: a learner whose answer was lost
  can tell its update was applied). It is cleared while a failed swap has left the weights
  unknown.
- `last_swap` (GetStatus): the last successful update's times; its `preload_seconds` count the
  time the update took to arrive and be checked (generation went on meanwhile).
- An update that fails on an error of the server's own is answered INTERNAL with what the
  engine serves now, and no class names, messages or paths of the server's (the log has them).
- Health follows the engine: NOT_SERVING while a failed swap has left the weights unknown.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2

from generator_service.engine import GeneratorEngine
from generator_service.status import SwapTimes
from generator_service.updates.adapter import LoraSettings
from generator_service.updates.tensors import PreloadTensor, WeightUpdateError
from jaxrlhf_wire.stubs import SERVICE_NAME


@dataclass(frozen=True)
class Applied:
    """What an update that went live answers (server.py makes it an UpdateWeightsResponse)."""

    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
    swap: SwapTimes = SwapTimes()  # unknown (zeros) for a sender whose call was cancelled


class UpdateApplier:
    """Puts updates live, one at a time, and keeps the record (module docstring)."""

    def __init__(self, engine: GeneratorEngine, health_servicer: health.aio.HealthServicer,
                 lock: asyncio.Lock) -> None:  # fmt: skip
        self.engine = engine
        self._health = health_servicer
        self.lock = lock  # one update at a time
        self.last_swap = SwapTimes()

    async def apply(
        self,
        path: str,
        tensors: list[PreloadTensor],
        policy_version: int,
        allow_rollback: bool,
        preload_id: int,
        update_id: str,
        received_seconds: float,
        lora: LoraSettings | None = None,
    ) -> SwapTimes:
        """`Engine.swap_weights` of the update in `path` (preloaded as `preload_id`, 0: none),
        which took `received_seconds` to arrive and be checked, named `update_id` (an adapter
        with settings `lora`, in "lora" mode); keeps the swap's times (module docstring)."""
        swap = await self.engine.swap_weights(
            path,
            tensors,
            policy_version,
            allow_rollback,
            preload_id=preload_id,
            update_id=update_id,
            lora=lora,
        )
        self.last_swap = dataclasses.replace(
            swap, preload_seconds=received_seconds + swap.preload_seconds
        )
        return self.last_swap

    def internal_error(self, policy_version: int) -> WeightUpdateError:
        """The answer to an update that failed on an unexpected error of the server's own
        (logged by the caller): INTERNAL, what the engine serves now, and no class names,
        messages or paths of the server's."""
        version = self.engine.policy_version
        served = (
            f"the served weights (policy_version {version}) are unchanged"
            if self.engine.serving
            else "the served weights are in an unknown state (NOT_SERVING until a complete "
            "update succeeds)"
        )
        return WeightUpdateError(
            grpc.StatusCode.INTERNAL,
            f"policy_version {policy_version} was refused on an internal error of the server "
            f"(see the server's log); {served}",
        )

    async def publish_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.engine.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in ("", SERVICE_NAME):
            await self._health.set(service, status)
