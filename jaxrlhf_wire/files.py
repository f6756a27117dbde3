"""Tensor regions in files: the learner's shared weight files and the service's update file.

Both lay tensors out raw, each region starting on a page boundary (`ALIGNMENT`), so that the
engine gets aligned views when it maps the file.

Each file is owned by a lock, not by a PID (`create_owned_file`): beside PREFIX<pid>-X.bin lies
PREFIX<pid>-X.lock, on which its creator holds a shared flock(2) lock for the file's life. The
kernel drops the lock when its last descriptor closes, however the creator ends (a child it
forked holds it too, while it lives), and `remove_stale_files`, which a new file's creator runs,
deletes a file only when it can take that lock exclusively itself. A PID would not do:
containers that share /dev/shm but not a PID namespace (the usual vLLM setup) see none of each
other's processes, and deleted each other's live files. The lock is on a file of its own: on
the data file, a flock would be the count's lock below (a store waits for every shared holder),
and fcntl's record locks belong to a process (the learner opens the file again to store a count,
and closing that descriptor would drop them). The lock file comes first and goes last
(`release_owned_file`), so a data file of a live creator always has its lock beside it; a data
file without one was made before files had one, and goes by the PID in its name as before.

The count of a progressive shared file (SharedWeights.progressive) is stored by the learner
while the server reads it, from another process. Two things must hold. A read never sees half a
store: at 255 -> 256 a torn read says 0 (a decrease, which ends the update) or 511 (tensors not
written yet, preloaded from the last version's bytes). And a reader that sees a count sees the
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
import tempfile
import time
from pathlib import Path

ALIGNMENT = 4096
# The lock file beside each data file (module docstring).
LOCK_SUFFIX = ".lock"
# A shared weight file written while the server preloads it (SharedWeights.progressive) counts
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


def create_owned_file(directory: str, prefix: str) -> tuple[int, str, int]:
    """Creates PREFIX<pid>-X.bin in `directory`, empty and open for reading and writing, owned by
    this process (module docstring): returns (its descriptor, its path, the descriptor that
    holds its lock). Give both back with `release_owned_file`."""
    lock_fd, lock_path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=LOCK_SUFFIX,
                                          dir=directory)  # fmt: skip
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_SH)  # before the data file exists: never unowned
        path = lock_path[: -len(LOCK_SUFFIX)] + ".bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except BaseException:
        os.close(lock_fd)
        Path(lock_path).unlink(missing_ok=True)
        raise
    return fd, path, lock_fd


def release_owned_file(path: str, lock_fd: int | None) -> None:
    """Deletes the owned file at `path` (`create_owned_file`), then its lock file, then lets go
    of the lock (`lock_fd`; None: not held here)."""
    Path(path).unlink(missing_ok=True)
    if lock_fd is not None:
        Path(lock_file(path)).unlink(missing_ok=True)
        os.close(lock_fd)


def lock_file(path: str | os.PathLike) -> str:
    """The lock file of the data file at `path` (module docstring)."""
    return str(Path(path).with_suffix(LOCK_SUFFIX))


def remove_stale_files(directory: str, prefix: str) -> None:
    """Deletes the files named PREFIX*.bin in `directory` that no process owns (shared files of
    dead learners, update files of dead servers), whatever PID namespace their owners ran in:
    those whose lock no process holds (module docstring), with their lock files."""
    for path in Path(directory).glob(f"{prefix}*.bin"):
        lock = Path(lock_file(path))
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            if not pid_runs(path.name[len(prefix) :].split("-", 1)[0]):
                path.unlink(missing_ok=True)  # made before files had a lock
            continue
        except PermissionError:
            continue  # another user's
        try:
            if _take_unheld(fd, lock):
                path.unlink(missing_ok=True)
                lock.unlink(missing_ok=True)
        finally:
            os.close(fd)  # the lock goes with it


def _take_unheld(fd: int, lock: Path) -> bool:
    """Whether this process got the lock of `fd` at once and `fd` is still the file at `lock`
    (not one that another cleaner deleted meanwhile, or a new file of the same name)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return os.stat(lock).st_ino == os.fstat(fd).st_ino
    except (BlockingIOError, FileNotFoundError):
        return False  # held: its owner runs; or gone


def pid_runs(pid: str) -> bool:
    """Whether the process `pid` (a name's; a name without one: yes) runs, as this process sees."""
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


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
