"""A generator replica's lifecycle, as the learner's pool sees it: live, failed, rejoining.

- live: it takes Generate calls and every publish;
- failed (`fail`): one of its calls missed its deadline, was cut off or refused (the replica
  died, hung, or went away). It gets no work. A prober thread asks it for its status every
  `probe_interval` seconds; a replica that the learner started itself (`restart`) is restarted
  instead, a bounded number of times with growing back-off;
- rejoining: it answers again (restarted, continued, or a replacement at the same address) but
  may serve stale weights, or none it can vouch for (NOT_SERVING after a swap that failed
  half-way: its version is then UNKNOWN_VERSION). It first receives the learner's current
  weights and version, in full, whatever it served before (the pool's next publish, or one with
  `rejoining_only`); then it is live again (`join`).

The pool (`jaxrlhf.fleet.pool.GeneratorPool`) decides what counts as a failure and sends the
weights; this piece holds the states, under the pool's lock, and brings failed replicas back.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from jaxrlhf.fleet.rpc import generator_pb2
from jaxrlhf.fleet.rpc.client import GeneratorClient

LIVE, FAILED, REJOINING = "live", "failed", "rejoining"
UNKNOWN_VERSION = -1  # of a replica whose weights are unknown: it is sent the full update


@dataclasses.dataclass
class Replica:
    client: GeneratorClient
    state: str = LIVE
    version: int = UNKNOWN_VERSION  # the version it serves, as far as the pool knows
    failed_at: float = 0.0
    error: str = ""
    restarts: int = 0
    restarting: bool = False
    # Sequences it may generate at once for `GeneratorPool.lease` (its engine's max_num_seqs,
    # or the pool's `capacity`), and how many leased calls hold now.
    capacity: int = 0
    in_use: int = 0
    # What it serves besides the weights (`served_identity`), as the run's start saw it: a
    # replica that answers again serving anything else does not rejoin.
    identity: tuple = ()

    @property
    def target(self) -> str:
        return self.client.target


def served_identity(status: generator_pb2.GeneratorStatus) -> tuple:
    """What a replica serves besides its weights' version: its model folder (a LoRA run's
    adapters apply to that base alone), dtype, swap mode, and largest adapter rank."""
    return (status.model, status.dtype, status.swap_mode or "drain", status.max_lora_rank)


class Lifecycle:
    """The states of `replicas` (module docstring). `cond` is the pool's lock (every state
    change notifies it), `counters` the pool's (failures, restarts, rejoins), `client_for(target)`
    makes the client of a restarted replica, `restart(target) -> new target` starts one (None:
    the replicas are someone else's; they are only probed)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        cond: threading.Condition,
        counters: collections.Counter[str],
        client_for: Callable[[str], GeneratorClient],
        status_timeout: float,
        probe_interval: float,
        restart: Callable[[str], str] | None,
        max_restarts: int,
        log: Callable[[str], None],
    ):
        self.replicas, self._cond, self.counters = replicas, cond, counters
        self._client_for, self.status_timeout = client_for, status_timeout
        self.probe_interval, self.restart, self.max_restarts = probe_interval, restart, max_restarts
        self.log = log
        self._closed = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="replica-prober",
                                        daemon=True)  # fmt: skip
        self._prober.start()

    def in_states(self, *states: str) -> list[Replica]:
        with self._cond:
            return [r for r in self.replicas if r.state in states]

    def count(self, counter: str, n: int = 1) -> None:
        """Adds `n` to one of the pool's counters (under its lock)."""
        with self._cond:
            self.counters[counter] += n

    def summary(self) -> str:
        return f"{len(self.in_states(LIVE))} of {len(self.replicas)} replica(s) live"

    def fail(self, replica: Replica, reason: str) -> None:
        with self._cond:
            if replica.state == FAILED:
                return
            replica.state, replica.failed_at, replica.error = FAILED, time.monotonic(), reason
            self.counters["failures"] += 1
            self._cond.notify_all()
        self.log(f"generator {replica.target} failed ({reason}); {self.summary()}")

    def join(self, replica: Replica, version: int) -> None:
        """`replica` took `version` in full: it is live (a rejoin, if it was rejoining)."""
        with self._cond:
            rejoined = replica.state == REJOINING
            replica.state, replica.version, replica.error = LIVE, version, ""
            if rejoined:
                self.counters["rejoins"] += 1
            self._cond.notify_all()
        if rejoined:
            self.log(f"generator {replica.target} rejoined at version {version}; "
                     f"{self.summary()}")  # fmt: skip

    def may_come_back(self) -> bool:
        """Whether a failed replica can rejoin: the run restarts it, or it still answers
        (NOT_SERVING after a failed swap, say)."""
        for replica in self.in_states(FAILED):
            if self.restart is not None and replica.restarts < self.max_restarts:
                return True
            try:
                replica.client.status(timeout=self.status_timeout)
            except grpc.RpcError:
                continue
            return True
        return False

    def close(self) -> None:
        self._closed.set()
        self._prober.join(timeout=10)

    # --- the prober thread -------------------------------------------------------------------

    def _probe_loop(self) -> None:
        while not self._closed.wait(self.probe_interval):
            for replica in self.in_states(FAILED):
                if replica.restarting:
                    continue
                try:
                    status = replica.client.status(timeout=self.status_timeout)
                except grpc.RpcError:
                    self._maybe_restart(replica)
                    continue
                self._rejoining(replica, status)

    def _rejoining(self, replica: Replica, status: generator_pb2.GeneratorStatus) -> None:
        """A failed replica answers again: it waits for the current weights. One NOT_SERVING
        (a swap failed half-way) holds weights of no known version: it gets the full update.
        One that serves another model, dtype or swap mode than at the run's start (its
        `identity`) stays failed, said once."""
        identity = served_identity(status)
        if replica.identity and identity != replica.identity:
            if replica.error != f"serves {identity}":
                replica.error = f"serves {identity}"
                self.log(f"generator {replica.target} answers again but serves (model, dtype, "
                         f"swap mode, max LoRA rank) {identity}, not {replica.identity} as at "
                         "the start: it does not rejoin")  # fmt: skip
            return
        version = status.policy_version if status.serving else UNKNOWN_VERSION
        with self._cond:
            replica.state, replica.version = REJOINING, version
            self._cond.notify_all()
        served = (f"version {status.policy_version}" if status.serving
                  else "not serving: its weights are unknown")  # fmt: skip
        self.log(f"generator {replica.target} answers again ({served}): it rejoins with the "
                 "current weights")  # fmt: skip

    def _maybe_restart(self, replica: Replica) -> None:
        """Restarts a failed replica the learner started, once its back-off has passed."""
        if self.restart is None or replica.restarts >= self.max_restarts:
            return
        if time.monotonic() - replica.failed_at < 5.0 * 2**replica.restarts:
            return
        replica.restarting = True
        replica.restarts += 1
        self.log(f"restarting generator {replica.target} "
                 f"(restart {replica.restarts} of at most {self.max_restarts})")  # fmt: skip

        def run() -> None:
            try:
                target = self.restart(replica.target)
                client = self._client_for(target)
                old, replica.client = replica.client, client
                old.close()
                with self._cond:
                    self.counters["restarts"] += 1
                self.log(f"generator restarted at {target}")
            except Exception as error:  # noqa: BLE001 - logged; the prober tries again later
                replica.failed_at = time.monotonic()
                self.log(f"restarting generator {replica.target} failed: {error}")
            finally:
                replica.restarting = False

        threading.Thread(target=run, name="replica-restart", daemon=True).start()
