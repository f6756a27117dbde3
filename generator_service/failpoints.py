"""Failpoints: a replica that kills or stops itself at a chosen point, for chaos tests.

Off unless `$JAXRLHF_FAILPOINTS` names a file. Each line of that file arms one point,
`NAME COUNT ACTION`, counted from when the file (as it reads now) was first seen:

- `generate_completion 2 kill`: SIGKILL this server as it is about to send the 2nd Generate
  completion since (in the middle of a call: the client has part of its answer);
- `update_weights 3 stop`: SIGSTOP it (it hangs, alive) in its 3rd weight update since,
  received and checked, before the swap;
- `reload_weights 1 fail`: make its next swap fail (raise) after the engine loaded the new
  weights and before it relabels them: a swap that dies half-way.

A point fires once: the file is deleted first, so a replica restarted with the same environment
runs clean. The engine's processes go with a killed server (`generator_service.reaper`).
"""

from __future__ import annotations

import collections
import logging
import os
import signal
from pathlib import Path

ENV = "JAXRLHF_FAILPOINTS"
POINTS = ("generate_completion", "update_weights", "reload_weights")
ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "fail": None}

logger = logging.getLogger(__name__)


class FailpointError(RuntimeError):
    """Raised at a point armed with the action `fail`."""


_armed: tuple[int, str] | None = None  # (mtime, contents) of the file the counts are for
_counts: collections.Counter[str] = collections.Counter()


def hit(point: str) -> None:
    """Counts a pass through `point`; fires the action armed for this count, if any."""
    global _armed
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        armed = (os.stat(path).st_mtime_ns, Path(path).read_text())
    except FileNotFoundError:
        return
    if armed != _armed:  # newly armed: count from here
        _armed = armed
        _counts.clear()
    _counts[point] += 1
    for line in armed[1].splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[0] == point and int(fields[1]) == _counts[point]:
            Path(path).unlink(missing_ok=True)
            logger.warning("failpoint %s %s: %s", point, fields[1], fields[2])
            for handler in logging.getLogger().handlers:
                handler.flush()
            if ACTIONS[fields[2]] is None:
                raise FailpointError(f"failpoint {point} {fields[1]} fail")
            os.kill(os.getpid(), ACTIONS[fields[2]])
