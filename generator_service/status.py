"""What the engine records of itself, for GetStatus and each update's answer (server.py
translates them into messages).

- `Served`: the weights the engine serves. Only a swap writes it (updates/swap.py): a swap that
  succeeds sets its version and the update's id together (GetStatus never shows one without
  the other), counts it and stamps its time (`swapped_in`); one that fails half-way clears
  `serving` and the id, which stay clear until a complete update succeeds. A Generate
  call reads it once, when it is admitted (calls.py).
- `Occupancy`: how busy the engine was since it started, on the server's clock, with the span
  its totals cover (a client divides their changes by that span, not by its own clock's).
- `SwapTimes`: what one swap took, while generation went on and while it was held back.
- `TokenCounter`: the tokens running requests generated meanwhile (a preload's `preload_tokens`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class Served:
    """The weights the engine serves (module docstring)."""

    policy_version: int = 0
    serving: bool = True  # False: a swap failed half-way, the weights are in an unknown state
    update_id: str = ""  # the sender's name for the update that put the served weights in place
    num_updates: int = 0
    last_update_unix_time: float = 0.0

    def swapped_in(self, policy_version: int, update_id: str) -> None:
        """A complete update, named `update_id` by its sender, is live as `policy_version`."""
        self.policy_version, self.update_id = policy_version, update_id
        self.serving = True
        self.num_updates += 1
        self.last_update_unix_time = time.time()


class Occupancy:
    """How busy the engine was: seconds with no request generating (none running, or the
    scheduler paused for a swap), and request-seconds (the number generating, at most the
    engine's `capacity` (its max_num_seqs: more are queued, not generating), integrated over
    time), since the engine started."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._started = self._since = time.monotonic()
        self._running = 0
        self._paused = False
        self.idle_seconds = 0.0
        self.request_seconds = 0.0

    def _advance(self) -> None:
        now = time.monotonic()
        elapsed, self._since = now - self._since, now
        generating = 0 if self._paused else min(self._running, self.capacity)
        if generating == 0:
            self.idle_seconds += elapsed
        self.request_seconds += generating * elapsed

    def started(self) -> None:
        self._advance()
        self._running += 1

    def finished(self) -> None:
        self._advance()
        self._running -= 1

    def paused(self, paused: bool) -> None:
        self._advance()
        self._paused = paused

    def totals(self) -> tuple[float, float]:
        """(idle seconds, request-seconds) up to now (`seconds`: the span they cover)."""
        self._advance()
        return self.idle_seconds, self.request_seconds

    @property
    def seconds(self) -> float:
        """Seconds since the start, up to the last reading of the totals: the span they cover,
        on this clock. A client that divides their change between two readings by its own
        clock's interval instead is off by the difference of its two calls' latencies: above 1
        at a full engine when the first answer took longer than the second."""
        return self._since - self._started

    def fraction(self) -> float:
        """Request-seconds ÷ (seconds × capacity) since the start, in [0, 1]."""
        self._advance()
        seconds = self.seconds
        return self.request_seconds / (seconds * self.capacity) if seconds > 0 else 0.0


@dataclass(frozen=True)
class SwapTimes:
    """What a swap took: `preload_seconds` while generation went on (converting the update into
    the engine's layout; 0 when not preloaded), `pause_seconds` while it was held back, and
    `preload_tokens`, the tokens generated while the update was preloaded (a lower bound: read every
    few ms from the engine's running requests)."""

    preload_seconds: float = 0.0
    pause_seconds: float = 0.0
    preload_tokens: int = 0


class TokenCounter:
    """Counts the tokens that running requests generate between `__init__` and the last
    `update` (requests that finish in between count up to the last update that saw them)."""

    def __init__(self, request_states) -> None:
        self._states = request_states
        self._first = self._read()
        self._last = dict(self._first)

    def _read(self) -> dict[str, int]:
        return {
            request_id: state.detokenizer.num_output_tokens()
            for request_id, state in list(self._states.items())
        }

    def update(self) -> int:
        self._last.update(self._read())
        return sum(n - self._first.get(request_id, 0) for request_id, n in self._last.items())
