"""Failpoints: a replica that kills or stops itself at a chosen point, for chaos tests.

Off unless `$JAXRLHF_FAILPOINTS` names a file. Each line of that file arms one point,
`NAME COUNT ACTION`, counted from when the file (as it reads now) was first seen:

- `generate_completion 2 kill`: SIGKILL this server as it is about to send the 2nd Generate
  completion since (in the middle of a call: the client has part of its answer);
- `update_weights 3 stop`: SIGSTOP it (it hangs, alive) in its 3rd weight update since,
  received and checked, before the swap;
- `reload_weights 1 fail`: make its next swap fail (raise) after the engine loaded the new
  weights and before it relabels them: a swap that dies half-way;
- `pause_for_swap 1 tokens=50`: hold its next swap, before it pauses the engine, until every
  running request has generated 50 tokens: the swap lands at a known place in them;
- `reload_weights 1 sleep=3`: hold its next swap for 3 s with the engine paused and the new
  weights loaded but not yet labelled (where a client's deadline can land mid-swap);
- `preload_weights 1 sleep=2` / `preload_weights 1 fail`: hold its next preloaded update for 2 s
  in the worker's preloading thread, after loading and before processing, with generation going
  on (a slow preload) / make that preload fail there.

A point fires once: its line is removed from the file first (the file is deleted once empty),
so a replica restarted with the same environment runs clean, and the lines left count their
passes anew from there. The engine's processes go with a killed server
(`generator_service.reaper`).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from pathlib import Path

ENV = "JAXRLHF_FAILPOINTS"
POINTS = (
    "generate_completion", "update_weights", "reload_weights", "pause_for_swap", "preload_weights"
)  # fmt: skip
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "fail": None}
# Holds the caller performs itself (it knows what to wait for): `tokens=N`, until every running
# request has N tokens; `sleep=S`, S seconds.
HOLDS = ("tokens=", "sleep=")

logger = logging.getLogger(__name__)


class FailpointError(RuntimeError):
    """Raised at a point armed with the action `fail`."""


_armed: tuple[int, str] | None = None  # (mtime, contents) of the file the counts are for
_counts: collections.Counter[str] = collections.Counter()


def hit(point: str) -> str | None:
    """Counts a pass through `point`; fires the action armed for this count, if any. Returns a
    hold (`tokens=N`, `sleep=S`: see `HOLDS`) for the caller to perform, else None."""
    global _armed
    path = os.environ.get(ENV)
    if not path:
        return None
    try:
        armed = (os.stat(path).st_mtime_ns, Path(path).read_text())
    except FileNotFoundError:
        return None
    if armed != _armed:  # newly armed: count from here
        _armed = armed
        _counts.clear()
    _counts[point] += 1
    lines = armed[1].splitlines()
    for index, line in enumerate(lines):
        fields = line.split()
        if len(fields) == 3 and fields[0] == point and int(fields[1]) == _counts[point]:
            _disarm(Path(path), lines[:index] + lines[index + 1 :])
            logger.warning("failpoint %s %s: %s", point, fields[1], fields[2])
            for handler in logging.getLogger().handlers:
                handler.flush()
            action = fields[2]
            if action.startswith(HOLDS):
                return action
            if ACTIONS[action] is None:
                raise FailpointError(f"failpoint {point} {fields[1]} fail")
            os.kill(os.getpid(), ACTIONS[action])
    return None


def _disarm(path: Path, left: list[str]) -> None:
    """Leaves only the lines `left` armed (none: the file is deleted), before a point fires."""
    if not any(line.strip() for line in left):
        path.unlink(missing_ok=True)
        return
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(line + "\n" for line in left))
    os.replace(partial, path)
