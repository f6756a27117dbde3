"""A tiny watchdog beside the server: no engine process outlives it, however the server dies.

vLLM runs its engine core (and its workers) as child processes of the server. When the server
exits normally it stops them; when it is SIGKILLed or crashes, nothing told them, and the engine
core kept running as an orphan, holding its memory (seen: ~670 MB, hours later). The server
starts this reaper first (`python -m generator_service.reaper SERVER_PID`). It records the
server's descendants every half second (every process ever seen below it); once the server is
gone (the reaper is re-parented), it SIGKILLs every recorded descendant still alive and exits.
It ignores SIGINT and SIGTERM so that a signal meant for the server's terminal group cannot
stop it before its work is done.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

INTERVAL = 0.5


def _children() -> dict[int, list[tuple[int, int]]]:
    """parent pid -> [(child pid, start time)] of every process now."""
    out: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        out.setdefault(int(fields[1]), []).append((int(entry.name), int(fields[19])))
    return out


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below `root`."""
    children, found, stack = _children(), set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child[0])
    return found


def _start_time(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def reap(server_pid: int) -> int:
    """Watches `server_pid` (this process's parent) until it is gone, then kills what it left.
    Returns how many processes it killed."""
    me = os.getpid()
    recorded: set[tuple[int, int]] = set()
    while True:
        seen = descendants(server_pid)
        if os.getppid() != server_pid:
            # The server died during that scan: its children were being re-parented, so the
            # scan may have missed some; everything recorded before still counts.
            break
        recorded |= {p for p in seen if p[0] != me}  # (pid, start time): never a reused pid
        time.sleep(INTERVAL)
    killed = 0
    for pid, started in recorded:
        if _start_time(pid) == started:  # the same process, not a reused pid
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    killed = reap(int(sys.argv[1]))
    if killed:
        print(f"generator_service.reaper: the server died; killed {killed} engine process(es)",
              file=sys.stderr, flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
