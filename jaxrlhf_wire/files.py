"""Tensor regions in files: the learner's shared weight files and the service's staging file.

Both lay tensors out raw, each region starting on a page boundary (`ALIGNMENT`), so that the
engine gets aligned views when it maps the file; and both name their files PREFIX<pid>-*.bin,
so that a new file's creator can remove the files of processes that died.

The count of a progressive shared file (SharedWeights.progressive) is stored by the learner
while the server reads it, from another process. Two things must hold. A read never sees half a
store: at 255 -> 256 a torn read says 0 (a decrease, which ends the update) or 511 (tensors not
written yet, staged from the last version's bytes). And a reader that sees a count sees the
tensor bytes it counts, which the learner wrote before it through a shared mapping (on weakly
ordered CPUs another core may see stores late and out of order). Python has neither an atomic
8-byte store nor release/acquire ordering, so both come from the kernel: the count is stored
(`write_progress_count`) and read (`read_progress_count`) only while holding the file's
flock(2) lock, exclusive to store, shared to read. The lock makes a store and a read exclusive,
so a read is never torn; releasing and taking it are a release and an acquire in the kernel, so
whatever the learner did before releasing it (the tensor's bytes, then the count) is seen by a
reader that takes it after, and by the engine the reader then hands the tensor to. flock, not
fcntl's record locks: those belong to a process (closing any descriptor of the file in it drops
them, and two threads of one process never exclude each other); flock's belong to the open
file. Re-reading until two reads agree would not do: two reads during one slow store can agree
on the same torn value, and nothing would order the count after the tensors.

A read never waits (the server reads from its event loop): while a store holds the lock the
count is not known yet, and the reader asks again. A store waits for a read in progress (one
pread), and gives up after `PROGRESS_LOCK_TIMEOUT_S` (only a reader stopped while reading holds
the lock that long).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

ALIGNMENT = 4096
# A shared weight file written while the server stages it (SharedWeights.progressive) counts
# its written tensors in its first bytes, as a little-endian uint64; this count means the
# writer gave up.
PROGRESS_BYTES = 8
PROGRESS_ABANDONED = (1 << 64) - 1
# How long a store of the count waits for the readers to let go of the lock.
PROGRESS_LOCK_TIMEOUT_S = 10.0
# How often a waiting store tries the lock again: from 10 µs, doubling up to 1 ms.
PROGRESS_LOCK_POLL_S = (1e-5, 1e-3)


def aligned(position: int) -> int:
    """`position` rounded up to the next multiple of `ALIGNMENT`."""
    return position + -position % ALIGNMENT


def remove_stale_files(directory: str, prefix: str) -> None:
    """Deletes the files named PREFIX<pid>-*.bin in `directory` whose process no longer runs
    (shared files of dead learners, staging files of dead servers)."""
    for path in Path(directory).glob(f"{prefix}*.bin"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


class ProgressLockedError(TimeoutError):
    """The count's lock stayed taken: a reader stopped while reading it."""


def write_progress_count(fd: int, count: int,
                         timeout: float = PROGRESS_LOCK_TIMEOUT_S) -> None:  # fmt: skip
    """Stores `count` as the count of the shared file open for writing as `fd`, under the
    file's exclusive lock (module docstring), after the tensors it counts were written."""
    deadline, poll = time.monotonic() + timeout, PROGRESS_LOCK_POLL_S[0]
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise ProgressLockedError(
                    f"the shared file's count stayed locked for {timeout:g} s by a reader (a "
                    "server stopped while reading it); the count was not stored"
                ) from None
            time.sleep(poll)
            poll = min(2 * poll, PROGRESS_LOCK_POLL_S[1])
    try:
        os.pwrite(fd, count.to_bytes(PROGRESS_BYTES, "little"), 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def read_progress_count(fd: int) -> int | None:
    """The count of the shared file open as `fd`, read under the file's shared lock (module
    docstring); None while a store holds the lock (ask again). Raises OSError if it cannot be
    read, or if the file ends before it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return None
    try:
        stored = os.pread(fd, PROGRESS_BYTES, 0)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    if len(stored) != PROGRESS_BYTES:
        raise OSError(f"the file ends before its count's {PROGRESS_BYTES} bytes")
    return int.from_bytes(stored, "little")
