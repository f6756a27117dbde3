"""A tiny watchdog beside the server: no engine process outlives it, however the server dies.

vLLM runs its engine core (and its workers) as child processes of the server. When the server
exits normally it stops them; when it is SIGKILLed or crashes, nothing told them, and the engine
core kept running as an orphan, holding its memory (seen: ~670 MB, hours later). The server
leads a process group of its own (`generator_service.__main__`) and starts this reaper first
(`python -m generator_service.reaper SERVER_PID`), so that every process it starts afterwards,
vLLM's included, is born into that group. Once the server is gone (the reaper is re-parented),
the reaper SIGKILLs every process of the group but itself, until none is left: a process spawned
an instant before the server died is in it too, and while the reaper lives the group's id
cannot be reused. It also records the server's descendants every half second and kills those
still alive, for any that left the group. It ignores SIGINT and SIGTERM so that a signal meant
for the server's terminal group cannot stop it before its work is done.

Processes of the group that are the server's siblings (a shell pipeline's other commands, which
share the server's group) are spared: they were never the server's.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

INTERVAL = 0.5
# Rounds of killing the group: each round kills what is left, including anything a dying
# member spawned meanwhile.
GROUP_KILL_ROUNDS = 100


@dataclass(frozen=True)
class Process:
    pid: int
    parent: int
    group: int
    started: int  # in clock ticks since boot: with the pid, names one process for good
    zombie: bool


def processes() -> list[Process]:
    """Every process now, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        found.append(Process(int(entry.name), int(fields[1]), int(fields[2]), int(fields[19]),
                             fields[0] == "Z"))  # fmt: skip
    return found


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below `root`."""
    children: dict[int, list[tuple[int, int]]] = {}
    for process in processes():
        children.setdefault(process.parent, []).append((process.pid, process.started))
    found, stack = set(), [root]
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


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def kill_group(group: int, spared_parent: int | None) -> set[int]:
    """SIGKILLs every live process of `group` but this one and the children of `spared_parent`
    (the server's siblings), round after round until none is left; returns their pids."""
    me, killed = os.getpid(), set()
    for _ in range(GROUP_KILL_ROUNDS):
        members = [
            p.pid for p in processes()
            if p.group == group and p.pid != me and not p.zombie and p.parent != spared_parent
        ]  # fmt: skip
        if not members:
            break
        killed |= {pid for pid in members if _kill(pid)}
        time.sleep(0.01)  # let them die before looking again
    return killed


def reap(server_pid: int) -> int:
    """Watches `server_pid` (this process's parent) until it is gone, then kills what it left.
    Returns how many processes it killed."""
    me = os.getpid()
    # The server leads its group (unless started otherwise): then the group is all its own.
    group = os.getpgrp() if os.getpgrp() == server_pid else None
    spared_parent = _parent_of(server_pid)
    recorded: set[tuple[int, int]] = set()
    while True:
        seen = descendants(server_pid)
        if os.getppid() != server_pid:
            # The server died during that scan: its children were being re-parented, so the
            # scan may have missed some; everything recorded before still counts.
            break
        recorded |= {p for p in seen if p[0] != me}  # (pid, start time): never a reused pid
        time.sleep(INTERVAL)
    killed = kill_group(group, spared_parent) if group is not None else set()
    for pid, started in recorded:
        if pid not in killed and _start_time(pid) == started and _kill(pid):
            killed.add(pid)  # the same process, not a reused pid; it had left the group
    return len(killed)


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
